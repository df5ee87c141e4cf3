"""wkv7: the RWKV-7 "Goose" generalized delta rule (docs/operators.md#wkv7).

    sa  = S a_t ;  S = S diag(exp(w_t)) + sa b_tᵀ + v_t k_tᵀ ;  y_t = S r_t

Inputs are [B, T, H, N]; `w` is the log of the effective decay (<= 0); the
state is [B, H, N, N] in the [value, key] orientation, fp32 (fp64 when the
inputs are fp64). The registry entry (backends, gradient-check cases) is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_same_layout, check_state
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("r", "w", "k", "v", "a", "b")


def wkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the WKV7 recurrence; returns (y [B,T,H,N], state_out [B,H,N,N]).

    Differentiable with respect to every input, the initial state, and through
    `state_out`, so consecutive segments can be chained.
    """
    check_same_layout(INPUTS, (r, w, k, v, a, b), ndim=4)
    B, T, H, N = r.shape
    if min(B, T, H, N) < 1:
        raise ValueError(f"wkv7 needs every dimension >= 1, got [B, T, H, N] = {list(r.shape)}")
    if state is not None:
        check_state("state", state, (B, H, N, N), r.device)
    bk = resolve_backend(get_op("wkv7"), backend, r.device)
    if r.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of wkv7 does not support float64 inputs")
    if state is None and not bk.optional_state:
        state_dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
        state = torch.zeros(B, H, N, N, dtype=state_dtype, device=r.device)
    return bk.fn(r, w, k, v, a, b, state)
