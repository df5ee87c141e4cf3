"""Gated delta rule oracle: the plain sequential recurrence, differentiated by autograd.

Per (batch, head), with S the [N_k, N_v] state (row = key channel) and
A_t = exp(g_t) broadcast over the key rows (one value for gdn, one per row
for kda):

    P   = A_t ⊙ S_{t-1}
    u_t = β_t (v_t - Pᵀ k_t)
    S_t = P + k_t u_tᵀ
    y_t = c S_tᵀ q_t

Runs in the dtype of its inputs (fp64 makes it the gradient-check oracle).
One time step per loop iteration, no tricks; the inputs are split into steps
with unbind (indexing x[:, t] would cost a full-size zero-filled gradient per
step in backward).
"""

from __future__ import annotations

import torch


def delta_reference(q, k, v, g, beta, state, scale, starts=None):
    """q, k, v [B, T, H, N]; g [B, T, H, G] with G = 1 (gdn) or N (kda); beta [B, T, H];
    state [B, H, N, N]; starts None or bool [B, T] (the state is zero before a True).
    Returns (y [B, T, H, N], S_T [B, H, N, N])."""
    S = state.to(q.dtype)
    ys = []
    keeps = (~starts).to(q.dtype).unbind(1) if starts is not None else (None,) * q.shape[1]
    for q_t, k_t, v_t, g_t, beta_t, keep in zip(*(x.unbind(1) for x in (q, k, v, g, beta)), keeps, strict=True):
        if keep is not None:
            S = S * keep[:, None, None, None]
        P = S * torch.exp(g_t).unsqueeze(-1)  # [B, H, G, 1] scales the key rows
        m = (P * k_t.unsqueeze(-1)).sum(-2)  # Pᵀ k
        u = beta_t.unsqueeze(-1) * (v_t - m)
        S = P + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        ys.append(scale * (S * q_t.unsqueeze(-1)).sum(-2))  # Sᵀ q
    return torch.stack(ys, dim=1), S
