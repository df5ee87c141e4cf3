"""rwkv7_out: RWKV-7's time-mix output before its projection, in one op: the per-head group norm
(`ln_x`), the bonus term and the output gate (docs/operators.md#rwkv7_out).

For y (wkv7's output), bonus (rwkv7_prep's) and g (the gate) [B, T, H, N], with each head's N
channels normalised over themselves (GroupNorm with H groups, weight and bias [C], `eps`,
RWKV-LM's 64e-5 by default):

    out = (GroupNorm(y) + bonus) ⊙ g

Returns out [B, T, H, N] in the inputs' dtype (computed in fp32, or fp64 for fp64 inputs).
Differentiable with respect to every input; weight and bias may have another floating dtype than
the activations, and get their gradients in their own dtype. The registry entry is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_eps, check_same_layout, per_channel
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("y", "bonus", "g", "weight", "bias")
LN_X_EPS = 64e-5  # RWKV-LM's ln_x


def rwkv7_out(y, bonus, g, weight, bias, *, eps: float = LN_X_EPS, backend: str = "auto") -> torch.Tensor:
    """(GroupNorm_H(y) + bonus) ⊙ g over [B, T, H, N]."""
    check_same_layout(INPUTS[:3], (y, bonus, g), ndim=4)
    B, T, H, N = y.shape
    if min(B, T, H, N) < 1:
        raise ValueError(f"rwkv7_out needs every dimension >= 1, got [B, T, H, N] = {list(y.shape)}")
    weight = per_channel("weight", weight, H * N, y.device)
    bias = per_channel("bias", bias, H * N, y.device)
    eps = check_eps(eps)
    bk = resolve_backend(get_op("rwkv7_out"), backend, y.device)
    if y.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of rwkv7_out does not support float64 inputs")
    return bk.fn(y, bonus, g, weight, bias, eps=eps)
