"""rwkv8 oracle: the normalized decayed recurrence, one step per loop iteration,
differentiated by autograd.

Per (batch, head), with ρ [L, E], n [L] and eps = 1e-6:

    q̃_t   = q_t / (Σ_l q_t[l] + eps)
    y_t[e] = Σ_l q̃_t[l] ρ[l, e] / (n[l] + eps)     (the state before step t)
    ρ      = d ⊙ ρ + q_t v_tᵀ
    n      = d ⊙ n + q_t

With `starts` (bool [B, T]), ρ and n are set to zero before each step where it is
True: a new document starts from the zero state.

Runs in the dtype of its inputs (fp64 makes it the gradient-check oracle).
"""

from __future__ import annotations

import torch

EPS = 1e-6


def rwkv8_reference(
    q: torch.Tensor,
    v: torch.Tensor,
    d: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    *,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    dtype = q.dtype
    decay = d.to(dtype)  # [H, L]
    rho, norm = (s.to(dtype) for s in state)  # [B, H, L, E], [B, H, L]
    q_tilde = q / (q.sum(dim=-1, keepdim=True) + EPS)
    ys = []
    for t in range(q.shape[1]):
        if starts is not None:
            keep = (~starts[:, t]).to(dtype)[:, None, None]  # [B, 1, 1]
            rho, norm = rho * keep[..., None], norm * keep
        z = q_tilde[:, t] / (norm + EPS)  # [B, H, L]
        ys.append(torch.einsum("bhl,bhle->bhe", z, rho))
        rho = decay[:, :, None] * rho + q[:, t, :, :, None] * v[:, t, :, None, :]  # v's head dim broadcasts
        norm = decay * norm + q[:, t]
    return torch.stack(ys, dim=1), (rho, norm)
