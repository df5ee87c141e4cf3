"""channel_mix: RWKV's channel mix with its LayerNorm and residual, the second half of every block
kind, in one op (docs/operators.md#channel_mix).

For x [B, T, C] (the residual stream), with x̂ = LayerNorm(x) (weight, bias [C], `eps`) and
x̂[-1] = state [B, C] (the previous segment's last x̂; zeros when None):

    x_k = x̂ + (x̂[t-1] - x̂) ⊙ mix                  mix [C]: the token-shift lerp (`ffn.x_k`)
    y   = x + relu(x_k keyᵀ)² valueᵀ               key [F, C], value [C, F] (F = 4C in the models)

Returns (y [B, T, C] in x's dtype, state_out = x̂[T-1] [B, C] fp32, fp64 for fp64 inputs).
Under autocast the two matmuls run in its dtype (bf16-mixed: bf16, fp32 accumulation) and the
residual sum in x's, as `x + ffn(ln2(x))` does. Differentiable with respect to every input, the
state, and through state_out. The registry entry is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_eps, check_rows, check_starts, check_state, per_channel
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("x", "weight", "bias", "mix", "key", "value")
STATES = ("state",)


def channel_mix(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mix: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x + ffn(LayerNorm(x)); returns (y, state_out). `starts` (bool [B, T]): x̂[t-1] is 0 where a
    document starts (docs/operators.md#document-starts)."""
    check_rows("x", x, 3)
    B, T, C = x.shape
    weight, bias, mix = (per_channel(n, p, C, x.device) for n, p in (("weight", weight), ("bias", bias), ("mix", mix)))
    for name, w in (("key", key), ("value", value)):
        check_rows(name, w, 2)
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")
    F = key.shape[0]
    if key.shape != (F, C):
        raise ValueError(f"key must have shape [F, {C}], got {tuple(key.shape)}")
    if value.shape != (C, F):
        raise ValueError(f"value must have shape [{C}, {F}] (key is [{F}, {C}]), got {tuple(value.shape)}")
    eps = check_eps(eps)
    if state is not None:
        check_state("state", state, (B, C), x.device)
    starts = check_starts(starts, B, T, x.device)
    spec = get_op("channel_mix")
    bk = resolve_backend(spec, backend, x.device)
    if x.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of channel_mix does not support float64 inputs")
    if state is None and not bk.optional_state:
        state_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        state = torch.zeros(B, C, dtype=state_dtype, device=x.device)
    _, extra = spec.with_starts(bk, {}, starts)
    return bk.fn(x, weight, bias, mix, key, value, state, eps=eps, **extra)
