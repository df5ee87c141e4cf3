"""channel_mix oracle: today's torch composition (nn.LayerNorm, the token shift and lerp, the key
matmul, relu², the value matmul, the residual sum), differentiated by autograd; the elementwise
work in fp32 at least (fp64: the gradient-check oracle), the matmuls in the inputs' dtype or
autocast's, as nn.Linear runs them, the output in x's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def channel_mix_reference(x, weight, bias, mix, key, value, state, *, eps: float = 1e-5, starts=None):
    C = x.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xn = F.layer_norm(x.to(dt), (C,), weight.to(dt), bias.to(dt), eps)
    prev = torch.cat([state[:, None].to(dt), xn[:, :-1]], dim=1)
    if starts is not None:  # a document's first token shifts in zeros
        prev = prev * (~starts)[:, :, None].to(dt)
    xk = (xn + (prev - xn) * mix.to(dt)).to(x.dtype)
    h = torch.relu(F.linear(xk, key.to(x.dtype))) ** 2
    return (x + F.linear(h, value.to(x.dtype))).to(x.dtype), xn[:, -1]
