"""rwkv7_out oracle: today's torch composition (nn.GroupNorm over heads, the bonus, the gate),
differentiated by autograd, in fp32 at least (fp64: the gradient-check oracle), the output in the
inputs' dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rwkv7_out_reference(y, bonus, g, weight, bias, *, eps: float = 64e-5):
    B, T, H, N = y.shape
    dt = torch.float64 if y.dtype == torch.float64 else torch.float32
    yn = F.group_norm(y.to(dt).reshape(B * T, H * N), H, weight.to(dt), bias.to(dt), eps).view(B, T, H, N)
    return ((yn + bonus.to(dt)) * g.to(dt)).to(y.dtype)
