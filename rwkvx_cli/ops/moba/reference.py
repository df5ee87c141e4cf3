"""MoBA oracle: the selection as a dense [B, H, T, P + T] mask, then masked softmax attention.

Per (batch, head), query t (at position P + t, after the P cached tokens) in chunk
ct = (P + t) // c attends the causal part of its own chunk plus the top_k earlier
chunks j < ct with the best gate score q_t · mean(K_j), over the keys of all P + T
tokens. Runs in the dtype of its inputs (fp64 makes it the gradient-check oracle);
the gate scores are computed in fp32 or better. Kept deliberately simple:
T x (P + T) memory.
"""

from __future__ import annotations

import math

import torch

from rwkvx_cli.ops.moba import with_cache


def moba_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state, *, chunk_size: int, top_k: int):
    B, T, H, N = q.shape
    c = chunk_size
    keys, values = with_cache(k, v, state)
    S = keys.shape[1]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, keys, values))  # [B, H, T or S, N]
    q_pos = torch.arange(S - T, S, device=q.device)
    k_pos = torch.arange(S, device=q.device)
    n_full = S // c  # only complete chunks are ever candidates (they all lie before the query's chunk)
    chunk_of_query = q_pos // c  # [T]
    candidate = torch.arange(n_full, device=q.device)[None, :] < chunk_of_query[:, None]  # [T, n_full]

    with torch.no_grad():  # hard selection: not differentiated
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        k_mean = kh[:, :, : n_full * c].to(acc).reshape(B, H, n_full, c, N).mean(dim=3)
        gate = (qh.to(acc) @ k_mean.transpose(-1, -2)).masked_fill(~candidate, -math.inf)  # [B, H, T, n_full]
        keep = candidate.expand(B, H, T, n_full).clone()
        if 0 < top_k < n_full:
            best = torch.zeros_like(keep).scatter_(-1, gate.topk(top_k, dim=-1).indices, True)
            keep &= best | (chunk_of_query <= top_k)[:, None]  # top_k >= ct: every earlier chunk

    mask = torch.zeros(B, H, T, S, dtype=torch.bool, device=q.device)
    mask[..., : n_full * c] = keep.repeat_interleave(c, dim=-1)
    mask |= (chunk_of_query[:, None] == (k_pos // c)[None, :]) & (k_pos[None, :] <= q_pos[:, None])

    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(N)
    weights = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return (weights @ vh).transpose(1, 2), (keys, values)
