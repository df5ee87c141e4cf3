"""WKV7 oracle: the plain sequential recurrence, differentiated by autograd.

Per (batch, head), with S the [N_v, N_k] state and w = exp(w_log):

    sa  = S a_t
    S   = S diag(w_t) + sa b_tᵀ + v_t k_tᵀ
    y_t = S r_t

With `starts` (bool [B, T]), S is set to zero before each step where it is
True: a new document starts from the zero state.

Runs in the dtype of its inputs (fp64 makes it the gradient-check oracle).
Kept deliberately simple: one time step per loop iteration, no tricks.
"""

from __future__ import annotations

import torch


def wkv7_reference(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor,
    *,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T = r.shape[1]
    decay = torch.exp(w)
    S = state.to(r.dtype)
    ys = []
    for t in range(T):
        if starts is not None:
            S = S * (~starts[:, t]).to(S.dtype)[:, None, None, None]
        r_t, w_t, k_t, v_t, a_t, b_t = (x[:, t] for x in (r, decay, k, v, a, b))  # [B, H, N]
        sa = torch.einsum("bhij,bhj->bhi", S, a_t)
        S = S * w_t[:, :, None, :] + sa[:, :, :, None] * b_t[:, :, None, :] + v_t[:, :, :, None] * k_t[:, :, None, :]
        ys.append(torch.einsum("bhij,bhj->bhi", S, r_t))
    return torch.stack(ys, dim=1), S
