"""MoBA production backend: gathered chunks, blockwise, hand-written backward.

Queries are processed in blocks of whole query chunks. For each query the keys
and values of its selected earlier chunks are gathered (index tensor
[B, H, T, slots]) next to its own chunk's keys, so a block costs
O(block * (slots + 1) * c * N) memory and no T x T matrix is ever formed. The
gate scores, [T, T / c] per head, are the one term above linear in T; the
block size (BLOCK_ELEMENTS) bounds them as well.

Backward is flash-attention style: only q, k, v, the selection, the output and
the per-query log-sum-exp are saved (O(T * (N + slots)) per head); each block's
weights are recomputed from them. Autograd through the gathers would instead
save the gathered keys and values, T * slots * c * N per head, which exceeds
the dense T x T scores whenever slots * c * N > T.

With cached keys and values (the state), only the query chunks that hold the new queries are
computed; the keys are those of every token. Computes in fp32 (fp64 for fp64 inputs) and returns
the input dtype.

With document starts the tokens are laid out again, each document from a chunk edge (its last
chunk zero-padded, as the sequence's last chunk is without starts), so that every chunk holds one
document's tokens on that document's own grid; a query's candidates are then the earlier chunks of
its own document (`doc_first`, per chunk), and the own chunk's causal mask is unchanged. The rows
are shifted by whole chunks so that the first query of every row lies in one chunk. The keys
before the first query's document (dead, under a later start) are left out. The layout costs a
gather of q, k, v and of y (a scatter each in the backward), the padding (under one chunk per
document), and one host sync for the grid's size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from rwkvx_cli.ops.moba import document_begins, with_cache

# Elements of the largest per-block intermediate (the gathered keys) before the
# query chunks are split into several blocks: 2^24 fp32 = 64 MiB.
BLOCK_ELEMENTS = 1 << 24


def to_chunks(q, k, v, chunk_size: int, top_k: int, begins: torch.Tensor | None = None):
    """q [B, T, H, N] at positions P .. P + T - 1 and the keys and values of all S = P + T tokens
    [B, S, H, N] -> qc [B*H, nq, c, N] (the query chunks first .. n_chunks - 1, zero-padded), kc, vc
    [B*H, n_chunks, c, N] (zero-padded to whole chunks), in fp32 (fp64 for fp64 inputs); `first`;
    the number of earlier-chunk slots per query; `doc_first` [B*H, n_chunks], the first chunk of
    each chunk's document (None without document starts: chunk 0); and where the queries lie in
    qc, for from_chunks. Without `begins` (document_begins) token p is at p of the padded grid, so
    q sits at offset P - first * c of chunk `first` = P // c; with it, see the module docstring."""
    B, T, H, N = q.shape
    S, c = k.shape[1], chunk_size
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if begins is None:
        n_chunks = -(-S // c)
        first = (S - T) // c
        doc_first, where = None, S - T - first * c

        def chunks(x, before, n):
            x = F.pad(x.to(acc).transpose(1, 2), (0, 0, before, n * c - before - x.shape[1]))
            return x.reshape(B * H, n, c, N).contiguous()

        qc, kc, vc = chunks(q, where, n_chunks - first), chunks(k, 0, n_chunks), chunks(v, 0, n_chunks)
    else:
        slot, first, n_chunks, doc_first = _document_grid(begins, S - T, c)
        where = slot[:, S - T :] - first * c

        def chunks(x, slots_of, n):
            # A gather of the tokens and of a zero row, which every empty slot reads; a token at
            # slot n * c (past the grid) is left out.
            src = torch.full((B, n * c + 1), x.shape[1], dtype=torch.long, device=x.device)
            src.scatter_(1, slots_of, torch.arange(x.shape[1], device=x.device).expand(B, -1))
            x = F.pad(x.to(acc), (0, 0, 0, 0, 0, 1))[torch.arange(B, device=x.device)[:, None], src[:, :-1]]
            return x.transpose(1, 2).reshape(B * H, n, c, N).contiguous()

        qc, kc, vc = chunks(q, where, n_chunks - first), chunks(k, slot, n_chunks), chunks(v, slot, n_chunks)
        doc_first = doc_first.repeat_interleave(H, dim=0)
    # Every earlier chunk is complete, so at most n_chunks - 1 of them are candidates.
    slots = n_chunks - 1 if top_k <= 0 else min(top_k, n_chunks - 1)
    return qc, kc, vc, first, slots, doc_first, where


def _document_grid(begins: torch.Tensor, P: int, c: int):
    """The chunk grid of documents (`begins` [B, S]: document_begins) after P cached tokens: each
    token's slot [B, S] (a slot past the grid for the dead tokens, before the first query's
    document); `first`, the chunk of every row's first query; the number of chunks; and the
    first chunk of each chunk's document [B, n_chunks]. One host sync, for the two sizes."""
    B, S = begins.shape
    pos = torch.arange(S, device=begins.device)
    rel = pos - begins  # the position in the document
    live_from = begins[:, P : P + 1]
    # A start after the first live one moves the grid past the chunks of the document before it.
    ends = (rel[:, 1:] == 0) & (pos[1:] > live_from)
    done = torch.where(ends, rel[:, :-1] // c + 1, 0)
    chunk = F.pad(done.cumsum(1), (1, 0)) + rel // c
    shift = chunk[:, P].max() - chunk[:, P]  # whole chunks of zeros ahead of the row
    chunk = chunk + shift[:, None]
    first, n_chunks = torch.stack([chunk[:, P].max(), chunk[:, -1].max() + 1]).tolist()
    live = pos >= live_from
    slot = torch.where(live, chunk * c + rel % c, n_chunks * c)
    doc_first = torch.arange(n_chunks + 1, device=begins.device).repeat(B, 1)
    doc_first.scatter_(1, torch.where(live, chunk, n_chunks), chunk - rel // c)
    return slot, first, n_chunks, doc_first[:, :-1]


def from_chunks(y: torch.Tensor, q: torch.Tensor, where) -> torch.Tensor:
    """[B*H, nq, c, N] outputs of the query chunks -> [B, T, H, N] outputs of q, in q's dtype; `where`
    (to_chunks): the first query's offset in the grid, or each query's slot [B, T]."""
    B, T, H, N = q.shape
    y = y.reshape(B, H, -1, N).transpose(1, 2)
    if isinstance(where, int):
        return y[:, where : where + T].to(q.dtype)
    return y[torch.arange(B, device=y.device)[:, None], where].to(q.dtype)


def moba_sparse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state,
    *,
    chunk_size: int,
    top_k: int,
    starts: torch.Tensor | None = None,
    cache_starts: torch.Tensor | None = None,
):
    B, T, H, N = q.shape
    c = chunk_size
    keys, values = with_cache(k, v, state)
    begins = document_begins(starts, cache_starts, B, keys.shape[1] - T, T, q.device)
    qc, kc, vc, first, slots, doc_first, where = to_chunks(q, keys, values, c, top_k, begins)
    n_chunks = kc.shape[1]
    # Largest per-block intermediates: the gathered keys and the gate scores.
    block = max(1, BLOCK_ELEMENTS // (B * H * c * ((slots + 1) * c * N + n_chunks)))
    y = _MobaFunction.apply(qc, kc, vc, first, slots, block, doc_first)
    return from_chunks(y, q, where), (keys, values)


def _select(qb: torch.Tensor, kc: torch.Tensor, first: int, slots: int, doc_first=None) -> torch.Tensor:
    """Top `slots` earlier chunks per query of the block starting at chunk `first`, among those of
    its document (`doc_first` [Z, n_chunks]: the first chunk of each chunk's; None: chunk 0):
    [Z, nb, c, slots] chunk indices, -1 in slots a query has no candidate for."""
    Z, nb, c, N = qb.shape
    n_full = first + nb - 1  # candidates of the block's last chunk: 0 .. n_full-1
    k_mean = kc[:, :n_full].mean(dim=2)  # [Z, n_full, N]
    gate = torch.einsum("zbcn,zjn->zbcj", qb, k_mean)
    own = torch.arange(first, first + nb, device=qb.device)[:, None, None]  # [nb, 1, 1]
    if doc_first is None:
        low = torch.zeros_like(own)
    else:
        low = doc_first[:, first : first + nb, None, None]  # [Z, nb, 1, 1]
    j = torch.arange(n_full, device=qb.device)
    gate = gate.masked_fill((j >= own) | (j < low), -math.inf)
    idx = gate.topk(min(slots, n_full), dim=-1).indices
    # Candidates are finite, so a query with fewer than `slots` of them gets them all
    # first; the rest of its slots point at other chunks and are marked empty.
    idx = idx.masked_fill((idx >= own) | (idx < low), -1)
    return F.pad(idx, (0, slots - idx.shape[-1]), value=-1)


def _gather(xc: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """xc [Z, n_chunks, c, N], idx [Z, nb, c, slots] -> [Z, nb, c, slots, c, N]."""
    z = torch.arange(xc.shape[0], device=xc.device)[:, None, None, None]
    return xc[z, idx.clamp(min=0)]


def _logits(qb, kb, k_sel, idx, scale):
    """Scaled scores of the block's queries: [Z, nb, c, slots*c + c], -inf where not attended."""
    Z, nb, c, _ = qb.shape
    sel = torch.einsum("zbqn,zbqsin->zbqsi", qb, k_sel).masked_fill((idx < 0)[..., None], -math.inf)
    own = (qb @ kb.transpose(-1, -2)).masked_fill(
        torch.ones(c, c, dtype=torch.bool, device=qb.device).triu(1), -math.inf
    )
    return torch.cat([sel.reshape(Z, nb, c, -1), own], dim=-1) * scale


class _MobaFunction(torch.autograd.Function):
    """qc: the query chunks first .. n_chunks - 1 [Z, nq, c, N]; kc, vc: every key chunk [Z, n_chunks, c, N];
    doc_first: the first chunk of each chunk's document [Z, n_chunks] (None: chunk 0)."""

    @staticmethod
    def forward(ctx, qc, kc, vc, first, slots, block, doc_first):
        Z, nq, c, N = qc.shape
        scale = 1.0 / math.sqrt(N)
        y = torch.empty_like(qc)
        lse = qc.new_empty(Z, nq, c)
        idx_all = torch.full((Z, nq, c, slots), -1, dtype=torch.long, device=qc.device)
        for lo in range(0, nq, block):
            blk = slice(lo, min(lo + block, nq))
            own = slice(first + lo, first + blk.stop)  # the block's own key chunks
            qb, kb, vb = qc[:, blk], kc[:, own], vc[:, own]
            if slots > 0 and own.stop > 1:
                idx_all[:, blk] = _select(qb, kc, own.start, slots, doc_first)
            idx = idx_all[:, blk]
            logits = _logits(qb, kb, _gather(kc, idx), idx, scale)
            lse[:, blk] = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - lse[:, blk, :, None])
            p_sel = p[..., : slots * c].unflatten(-1, (slots, c))
            y[:, blk] = torch.einsum("zbqsi,zbqsin->zbqn", p_sel, _gather(vc, idx)) + p[..., slots * c :] @ vb
        ctx.save_for_backward(qc, kc, vc, idx_all, y, lse)
        ctx.block, ctx.first = block, first
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        qc, kc, vc, idx_all, y, lse = ctx.saved_tensors
        Z, nq, c, N = qc.shape
        n_chunks, first = kc.shape[1], ctx.first
        slots = idx_all.shape[-1]
        scale = 1.0 / math.sqrt(N)
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        delta = (dy * y).sum(dim=-1)  # Σ_j p_j dp_j per query: the softmax backward's subtrahend
        z = torch.arange(Z, device=qc.device)[:, None, None, None]
        for lo in range(0, nq, ctx.block):
            blk = slice(lo, min(lo + ctx.block, nq))
            own = slice(first + lo, first + blk.stop)
            qb, kb, vb, dyb, idx = qc[:, blk], kc[:, own], vc[:, own], dy[:, blk], idx_all[:, blk]
            k_sel, v_sel = _gather(kc, idx), _gather(vc, idx)
            p = torch.exp(_logits(qb, kb, k_sel, idx, scale) - lse[:, blk, :, None])
            p_sel, p_own = p[..., : slots * c].unflatten(-1, (slots, c)), p[..., slots * c :]
            dp_sel = torch.einsum("zbqn,zbqsin->zbqsi", dyb, v_sel)
            dp_own = dyb @ vb.transpose(-1, -2)
            ds_sel = p_sel * (dp_sel - delta[:, blk, :, None, None]) * scale
            ds_own = p_own * (dp_own - delta[:, blk, :, None]) * scale
            dq[:, blk] = torch.einsum("zbqsi,zbqsin->zbqn", ds_sel, k_sel) + ds_own @ kb
            dk[:, own] += ds_own.transpose(-1, -2) @ qb
            dv[:, own] += p_own.transpose(-1, -2) @ dyb
            # Empty slots carry p = ds = 0, so adding them to chunk 0 is harmless.
            target = (z * n_chunks + idx.clamp(min=0)).reshape(-1)
            dk.view(-1, c, N).index_add_(0, target, torch.einsum("zbqsi,zbqn->zbqsin", ds_sel, qb).reshape(-1, c, N))
            dv.view(-1, c, N).index_add_(0, target, torch.einsum("zbqsi,zbqn->zbqsin", p_sel, dyb).reshape(-1, c, N))
        return dq, dk, dv, None, None, None, None
