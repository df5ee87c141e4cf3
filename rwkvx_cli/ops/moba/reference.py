"""MoBA oracle: the selection as a dense [B, H, T, P + T] mask, then masked softmax attention.

Per (batch, head), query t (at position P + t, after the P cached tokens) attends the causal part
of its own chunk plus the top_k earlier chunks of its document with the best gate score
q_t · mean(K_j), over the keys of all P + T tokens. Chunks are counted from the start of each
token's document (position 0 without document starts), and a chunk is named by the position of
its first token: with starts, a key attended lies in the query's document, by construction of
the names. Runs in the dtype of its inputs (fp64 makes it the gradient-check oracle); the gate
scores are computed in fp32 or better. Kept deliberately simple: T x (P + T) memory.
"""

from __future__ import annotations

import math

import torch

from rwkvx_cli.ops.moba import document_begins, with_cache


def gate_scores(q: torch.Tensor, keys: torch.Tensor, begins: torch.Tensor | None, chunk_size: int):
    """The gate of queries q [B, T, H, N] (the last T of the S tokens of `keys` [B, S, H, N]) over
    the chunks of their documents (`begins`: document_begins, None for one document): [B, H, T, S]
    scores in fp32 or better, where column j is the chunk whose first token is j, -inf where that
    is no candidate (not a complete earlier chunk of the query's document); and each token's chunk
    [B, S], the position of that chunk's first token."""
    B, T, H, N = q.shape
    S, c = keys.shape[1], chunk_size
    pos = torch.arange(S, device=q.device)
    begins = torch.zeros(B, S, dtype=torch.long, device=q.device) if begins is None else begins
    chunk = pos - (pos - begins) % c  # [B, S]
    own = chunk[:, S - T :]
    # A candidate names a chunk (j is its first token) of the query's document before the query's
    # own chunk: it is complete, since the document goes on past it.
    candidate = (chunk == pos)[:, None, :] & (begins[:, None, :] == begins[:, S - T :, None]) & (pos < own[..., None])
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    k_sum = torch.zeros(B, H, S, N, dtype=acc, device=q.device)
    k_sum.scatter_add_(2, chunk[:, None, :, None].expand(B, H, S, N), keys.transpose(1, 2).to(acc))
    gate = q.transpose(1, 2).to(acc) @ (k_sum / c).transpose(-1, -2)
    return gate.masked_fill(~candidate[:, None], -math.inf), chunk


def moba_reference(
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
    keys, values = with_cache(k, v, state)
    S = keys.shape[1]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, keys, values))  # [B, H, T or S, N]
    begins = document_begins(starts, cache_starts, B, S - T, T, q.device)
    with torch.no_grad():  # hard selection: not differentiated
        gate, chunk = gate_scores(q, keys, begins, chunk_size)
        keep = gate > -math.inf  # [B, H, T, S]: the candidates, by the chunks' first tokens
        if 0 < top_k < S:  # a query with at most top_k candidates keeps them all (they are finite)
            keep &= torch.zeros_like(keep).scatter_(-1, gate.topk(top_k, dim=-1).indices, True)

    pos = torch.arange(S, device=q.device)
    mask = keep.gather(-1, chunk[:, None, None, :].expand(B, H, T, S))  # each key its chunk's choice
    mask |= ((chunk[:, None, :] == chunk[:, S - T :, None]) & (pos <= pos[S - T :, None]))[:, None]

    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(N)
    weights = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return (weights @ vh).transpose(1, 2), (keys, values)
