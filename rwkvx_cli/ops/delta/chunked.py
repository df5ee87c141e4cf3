"""Gated delta rule `chunked` backend: pure torch, the WY/UT form of fla's
chunk_gated_delta_rule, differentiated by autograd.

Within a chunk starting from state S0, with Γ_t = Σ_{r<=t} g_r (log-gates
summed from the chunk start, per key row for kda) and u_t the delta-rule
update of step t, the recurrence unrolls to

    S_t = e^{Γ_t} ⊙ S0 + Σ_{s<=t} (k_s ⊙ e^{Γ_t - Γ_s}) u_sᵀ
    u_t = β_t (v_t - S0ᵀ (k_t ⊙ e^{Γ_t}) - Σ_{s<t} <k_t, k_s>_{ts} u_s)

with <x_t, z_s>_{ts} = Σ_j x_tj z_sj e^{Γ_tj - Γ_sj}. Stacking the chunk's rows,
(I + strict_tril(diag(β) <K, K>)) U = diag(β) (V - K̃ S0) with K̃ = K ⊙ e^{Γ},
so with the UT transform T = (I + strict_tril(diag(β) <K, K>))⁻¹

    W = T diag(β) K̃ ,  Ũ = T diag(β) V            (every chunk at once)
    U = Ũ - W S0 ;  S_end = e^{Γ_C} ⊙ S0 + (K ⊙ e^{Γ_C - Γ})ᵀ U   (chunk by chunk)
    Y = c (Q̃ S0 + tril(<Q, K>) U)                  (every chunk at once)

T is applied by a unit-lower-triangular solve, never formed. Every pairwise
decay e^{Γ_t - Γ_s} is the exponential of a segment sum Σ_{s<r<=t} g_r formed
directly (never a difference of cumulative sums, whose fp32 gradient cancels
catastrophically), so each exponent is <= 0 and every term stays finite for
gates down to large negative values (g itself must be finite).

Chunk length: 64 for gdn (fla's choice), where a scalar gate makes every pairwise
product a 64 x 64 matmul. kda's per-channel decays are a [C, C, N] tensor per
chunk and head whose segment sums cost C³N: total work grows linearly with C,
so kda uses 8 (fwd+bwd at N = 64 on 2 CPU cores: 144 ms at T = 1024, B = 1 and
229 ms at T = 256, B = 8, against 174 and 449 ms with 16 and over 1 s with 64;
fla keeps 64 by splitting the chunk into 16-step sub-chunks inside its kernel).
The intra-chunk part is recomputed in backward (torch.utils.checkpoint) rather
than saved. A ragged last chunk is padded with identity steps (g = 0,
k = v = q = 0, β = 0).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK = 64
CHUNK_PER_CHANNEL = 8


def _gated_dot(x: torch.Tensor, z: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """<x_t, z_s>_{ts} = Σ_j x_tj z_sj decay_tsj; x, z [..., C, N], decay [..., C, C, G]
    with G = 1 (one gate per head: a plain matmul) or G = N."""
    if decay.shape[-1] == 1:
        return (x @ z.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("...tj,...sj,...tsj->...ts", x, z, decay)


def _intra_chunk(q, k, v, g, beta):
    """Everything that does not depend on the chunk's initial state, for all chunks.

    q, k, v [..., C, N]; g [..., C, G]; beta [..., C]. Returns the output matrix
    tril(<Q, K>) [..., C, C], W and Ũ [..., C, N], Q̃ = Q ⊙ e^{Γ}, K ⊙ e^{Γ_C - Γ}
    [..., C, N], and the whole-chunk decay e^{Γ_C} [..., G]."""
    C, N = q.shape[-2:]
    i = torch.arange(C, device=q.device)
    t, s, r = i[:, None, None], i[None, :, None], i[None, None, :]
    segment = ((s < r) & (r <= t)).to(g.dtype)  # [t, s, r]: s < r <= t
    seg = torch.einsum("tsr,...rj->...tsj", segment, g)  # Σ_{s<r<=t} g_r
    causal = (i[None, :] <= i[:, None])[:, :, None]  # s <= t
    decay = torch.exp(torch.where(causal, seg, torch.tensor(float("-inf"), dtype=g.dtype, device=g.device)))
    gam = torch.cumsum(g, dim=-2)  # Γ_t
    rev = torch.flip(torch.cumsum(torch.flip(g, [-2]), dim=-2), [-2])  # Σ_{r>=t} g_r
    tail = torch.cat([rev[..., 1:, :], torch.zeros_like(g[..., :1, :])], dim=-2)  # Σ_{r>t} g_r = Γ_C - Γ_t
    A_kk = torch.tril(_gated_dot(k, k, decay), -1)
    A_qk = _gated_dot(q, k, decay)  # decay is 0 above the diagonal
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = beta[..., None] * torch.cat([k * torch.exp(gam), v], dim=-1)
    WU = torch.linalg.solve_triangular(eye + beta[..., None] * A_kk, rhs, upper=False, unitriangular=True)
    return A_qk, WU[..., :N], WU[..., N:], q * torch.exp(gam), k * torch.exp(tail), torch.exp(gam[..., -1, :])


def delta_chunked(q, k, v, g, beta, state, scale, chunk_size: int | None = None):
    """q, k, v [B, T, H, N]; g [B, T, H, G] (G = 1 or N); beta [B, T, H]; state [B, H, N, N]."""
    B, T, H, N = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    C = min(chunk_size or (CHUNK if g.shape[-1] == 1 else CHUNK_PER_CHANNEL), T)
    n = -(-T // C)
    pad = n * C - T

    def chunks(x):  # [B, T, H, *] -> [n, B*H, C, *], zero-padded in time; chunk c is contiguous
        x = x.to(cdt).transpose(1, 2)
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else torch.nn.functional.pad(x, (0, pad))
        return x.reshape(B * H, n, C, *x.shape[3:]).transpose(0, 1).contiguous()

    pieces = [chunks(x) for x in (q, k, v, g, beta)]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, state))
    if grad:
        A_qk, W, U_tilde, q_g, k_tail, last = checkpoint(_intra_chunk, *pieces, use_reentrant=False)
    else:
        A_qk, W, U_tilde, q_g, k_tail, last = _intra_chunk(*pieces)
    S = state.to(cdt).reshape(B * H, N, N)
    starts, us = [], []
    # unbind, not indexing: the backward of W[c] would zero-fill all of W once per chunk.
    per_chunk = zip(W.unbind(0), U_tilde.unbind(0), k_tail.unbind(0), last.unbind(0), strict=True)
    for W_c, U_tilde_c, k_tail_c, last_c in per_chunk:
        starts.append(S)
        U = U_tilde_c - W_c @ S
        us.append(U)
        S = last_c[..., None] * S + k_tail_c.transpose(1, 2) @ U
    y = scale * (q_g @ torch.stack(starts) + A_qk @ torch.stack(us))  # [n, B*H, C, N]
    y = y.transpose(0, 1).reshape(B, H, n * C, N)[:, :, :T].transpose(1, 2)
    return y.to(q.dtype), S.reshape(B, H, N, N)
