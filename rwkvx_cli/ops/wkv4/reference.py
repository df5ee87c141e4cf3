"""WKV4 oracle: RWKV-LM v4neo's stabilised recurrence, one step per loop
iteration, differentiated by autograd.

Per channel, with the state (aa, bb, pp) standing for the true numerator and
denominator sums A = aa e^pp, B = bb e^pp:

    q  = max(pp, u + k_t);  e1 = e^{pp - q};  e2 = e^{u + k_t - q}
    y_t = (e1 aa + e2 v_t) / (e1 bb + e2)
    q' = max(pp + w, k_t);  f1 = e^{pp + w - q'};  f2 = e^{k_t - q'}
    aa = f1 aa + f2 v_t ;  bb = f1 bb + f2 ;  pp = q'

Every exponent is <= 0, so nothing overflows however long T or large k is.
With `starts` (bool [B, T]), the state is set to the fresh state (0, 0, -1e38)
before each step where it is True: a new document starts from nothing.
Runs in the dtype of its inputs (fp64 makes it the gradient-check oracle).
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops.wkv4 import FRESH_PP


def wkv4_reference(
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    dtype = k.dtype
    w, u = w.to(dtype), u.to(dtype)  # [H, N], broadcast over [B, H, N]
    aa, bb, pp = (s.to(dtype) for s in state)
    ys = []
    for t in range(k.shape[1]):
        if starts is not None:
            fresh = starts[:, t, None, None]
            aa, bb, pp = torch.where(fresh, 0.0, aa), torch.where(fresh, 0.0, bb), torch.where(fresh, FRESH_PP, pp)
        k_t, v_t = k[:, t], v[:, t]
        uk = u + k_t
        q = torch.maximum(pp, uk)
        e1, e2 = torch.exp(pp - q), torch.exp(uk - q)
        ys.append((e1 * aa + e2 * v_t) / (e1 * bb + e2))
        ww = pp + w
        q = torch.maximum(ww, k_t)
        f1, f2 = torch.exp(ww - q), torch.exp(k_t - q)
        aa, bb, pp = f1 * aa + f2 * v_t, f1 * bb + f2, q
    return torch.stack(ys, dim=1), (aa, bb, pp)
