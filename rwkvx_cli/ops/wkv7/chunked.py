"""WKV7 `chunked` backend: the recurrence in matmul form over chunks of L steps,
pure torch (the GPU fallback where Triton is absent), differentiated by autograd
with each chunk recomputed in backward (torch.utils.checkpoint).

Within a chunk starting from state S0, with g_t = Σ_{s<=t} w_s (log-decay, so
every exp below has an exponent <= 0 and stays finite for any decay in (0, 1]),
and u_t = S_{t-1} a_t:

    S_t = S0 diag(e^{g_t}) + Σ_{s<=t} (u_s b_sᵀ + v_s k_sᵀ) diag(e^{g_t - g_s})
    u_t = S0 (a_t e^{g_{t-1}}) + Σ_{s<t} u_s (a_t·b_s)_{t,s} + v_s (a_t·k_s)_{t,s}

where (x_t·z_s)_{t,s} = Σ_j x_tj z_sj e^{g_{t-1,j} - g_{s,j}}. So
U = (I - M_ab)^{-1} (Ã S0ᵀ + M_ak V), one unit-lower-triangular solve per chunk,
then Y = R̃ S0ᵀ + N_rb U + N_rk V and the chunk's final state by two matmuls.
The pairwise decays cost [L, L, N] per chunk and head: L = 16 keeps that small.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK = 16


def _segment_masks(L: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[t, s, r] masks selecting s < r <= t and s < r < t."""
    i = torch.arange(L, device=device)
    t, s, r = i[:, None, None], i[None, :, None], i[None, None, :]
    return (s < r) & (r <= t), (s < r) & (r < t)


def _chunk(r, w, k, v, a, b, S0):
    """One chunk; inputs [Z, L, N] (Z = B*H), S0 [Z, N, N] ([value, key]).

    Every decay product is a sum of the w it spans, formed directly (never as a
    difference of two cumulative sums): in fp32 the gradient of such a
    difference cancels catastrophically when decays are near 0."""
    Z, L, N = r.shape
    incl_mask, strict_mask = _segment_masks(L, r.device)
    # [Z, t, s, N]: Σ_{s<r<=t} w_r and Σ_{s<r<t} w_r
    g_incl = torch.einsum("tsq,zqj->ztsj", incl_mask.to(r.dtype), w)
    g_strict = torch.einsum("tsq,zqj->ztsj", strict_mask.to(r.dtype), w)
    i = torch.arange(L, device=r.device)
    neg_inf = torch.tensor(float("-inf"), dtype=r.dtype, device=r.device)
    e_incl = torch.exp(torch.where((i[None, :] <= i[:, None])[None, :, :, None], g_incl, neg_inf))  # s <= t
    e_prev = torch.exp(torch.where((i[None, :] < i[:, None])[None, :, :, None], g_strict, neg_inf))  # s < t
    # (a_t · b_s) e^{Σ_{s<r<t} w}: a_t acts on S_{t-1}, which b_s entered at step s.
    M_ab = torch.einsum("ztj,zsj,ztsj->zts", a, b, e_prev)
    M_ak = torch.einsum("ztj,zsj,ztsj->zts", a, k, e_prev)
    N_rb = torch.einsum("ztj,zsj,ztsj->zts", r, b, e_incl)
    N_rk = torch.einsum("ztj,zsj,ztsj->zts", r, k, e_incl)
    g = torch.cumsum(w, dim=1)  # Σ_{r<=t} w_r
    g_excl = torch.cat([torch.zeros_like(w[:, :1]), g[:, :-1]], dim=1)  # Σ_{r<t} w_r
    rev = torch.flip(torch.cumsum(torch.flip(w, [1]), dim=1), [1])  # Σ_{r>=s} w_r
    tail = torch.cat([rev[:, 1:], torch.zeros_like(w[:, :1])], dim=1)  # Σ_{r>s} w_r
    S0T = S0.transpose(1, 2)  # [Z, key, value]
    rhs = (a * torch.exp(g_excl)) @ S0T + M_ak @ v
    eye = torch.eye(L, dtype=r.dtype, device=r.device)
    U = torch.linalg.solve_triangular(eye - M_ab, rhs, upper=False, unitriangular=True)
    y = (r * torch.exp(g)) @ S0T + N_rb @ U + N_rk @ v
    decay_tail = torch.exp(tail)  # [Z, L, N]
    S_end = S0 * torch.exp(g[:, -1:, :]) + U.transpose(1, 2) @ (b * decay_tail) + v.transpose(1, 2) @ (k * decay_tail)
    return y, S_end


def wkv7_chunked(r, w, k, v, a, b, state):
    B, T, H, N = r.shape
    cdt = torch.float64 if r.dtype == torch.float64 else torch.float32

    def heads(x):  # [B, T, H, N] -> [B*H, T, N]
        return x.to(cdt).transpose(1, 2).reshape(B * H, T, N)

    r_, w_, k_, v_, a_, b_ = (heads(x) for x in (r, w, k, v, a, b))
    S = state.to(cdt).reshape(B * H, N, N)
    ys = []
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (r, w, k, v, a, b, state))
    for t0 in range(0, T, CHUNK):
        piece = [x[:, t0 : t0 + CHUNK] for x in (r_, w_, k_, v_, a_, b_)]
        if grad:
            y, S = checkpoint(_chunk, *piece, S, use_reentrant=False)
        else:
            y, S = _chunk(*piece, S)
        ys.append(y)
    y = torch.cat(ys, dim=1).reshape(B, H, T, N).transpose(1, 2)
    return y.to(r.dtype), S.reshape(B, H, N, N)
