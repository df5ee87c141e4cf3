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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from rwkvx_cli.ops.moba import with_cache

# Elements of the largest per-block intermediate (the gathered keys) before the
# query chunks are split into several blocks: 2^24 fp32 = 64 MiB.
BLOCK_ELEMENTS = 1 << 24


def to_chunks(q, k, v, chunk_size: int, top_k: int):
    """q [B, T, H, N] at positions P .. P + T - 1 and the keys and values of all S = P + T tokens
    [B, S, H, N] -> qc [B*H, nq, c, N] (the query chunks first .. last, q placed at offset
    P - first * c of chunk `first` = P // c, zero-padded), kc, vc [B*H, n_chunks, c, N] (zero-padded
    to whole chunks), in fp32 (fp64 for fp64 inputs); and `first`, the offset, and the number of
    earlier-chunk slots per query."""
    B, T, H, N = q.shape
    S = k.shape[1]
    n_chunks = -(-S // chunk_size)
    first = (S - T) // chunk_size
    offset = S - T - first * chunk_size
    nq = n_chunks - first
    # Every earlier chunk is complete, so at most n_chunks - 1 of them are candidates.
    slots = n_chunks - 1 if top_k <= 0 else min(top_k, n_chunks - 1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    def chunks(x, before, n):
        x = F.pad(x.to(acc).transpose(1, 2), (0, 0, before, n * chunk_size - before - x.shape[1]))
        return x.reshape(B * H, n, chunk_size, N).contiguous()

    return chunks(q, offset, nq), chunks(k, 0, n_chunks), chunks(v, 0, n_chunks), first, offset, slots


def from_chunks(y: torch.Tensor, q: torch.Tensor, offset: int) -> torch.Tensor:
    """[B*H, nq, c, N] outputs of the query chunks -> [B, T, H, N] outputs of q, in q's dtype."""
    B, T, H, N = q.shape
    return y.reshape(B, H, -1, N)[:, :, offset : offset + T].transpose(1, 2).to(q.dtype)


def moba_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state, *, chunk_size: int, top_k: int):
    B, T, H, N = q.shape
    c = chunk_size
    keys, values = with_cache(k, v, state)
    qc, kc, vc, first, offset, slots = to_chunks(q, keys, values, c, top_k)
    n_chunks = kc.shape[1]
    # Largest per-block intermediates: the gathered keys and the gate scores.
    block = max(1, BLOCK_ELEMENTS // (B * H * c * ((slots + 1) * c * N + n_chunks)))
    y = _MobaFunction.apply(qc, kc, vc, first, slots, block)
    return from_chunks(y, q, offset), (keys, values)


def _select(qb: torch.Tensor, kc: torch.Tensor, first: int, slots: int) -> torch.Tensor:
    """Top `slots` earlier chunks per query of the block starting at chunk `first`:
    [Z, nb, c, slots] chunk indices, -1 in slots a query has no candidate for."""
    Z, nb, c, N = qb.shape
    n_full = first + nb - 1  # candidates of the block's last chunk: 0 .. n_full-1
    k_mean = kc[:, :n_full].mean(dim=2)  # [Z, n_full, N]
    gate = torch.einsum("zbcn,zjn->zbcj", qb, k_mean)
    own = torch.arange(first, first + nb, device=qb.device)
    candidate = torch.arange(n_full, device=qb.device)[None, :] < own[:, None]  # [nb, n_full]
    gate = gate.masked_fill(~candidate[:, None, :], -math.inf)
    idx = gate.topk(min(slots, n_full), dim=-1).indices
    # Candidates are finite, so a query with fewer than `slots` of them gets them all
    # first; the rest of its slots point at chunks >= its own and are marked empty.
    idx = idx.masked_fill(idx >= own[:, None, None], -1)
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
    """qc: the query chunks first .. n_chunks - 1 [Z, nq, c, N]; kc, vc: every key chunk [Z, n_chunks, c, N]."""

    @staticmethod
    def forward(ctx, qc, kc, vc, first, slots, block):
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
                idx_all[:, blk] = _select(qb, kc, own.start, slots)
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
        return dq, dk, dv, None, None, None
