"""shift_mix oracle: today's torch composition (nn.LayerNorm, the token shift, the lerps),
differentiated by autograd, in fp32 at least (fp64 makes it the gradient-check oracle), the outputs in
x's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shift_mix_reference(x, weight, bias, mix, state, *, eps: float = 1e-5, residual: bool = False, starts=None):
    C = x.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xn = F.layer_norm(x.to(dt), (C,), weight.to(dt), bias.to(dt), eps)
    prev = torch.cat([state[:, None].to(dt), xn[:, :-1]], dim=1)
    if starts is not None:  # a document's first token shifts in zeros
        prev = prev * (~starts)[:, :, None].to(dt)
    xx = prev - xn
    mix = (mix if isinstance(mix, torch.Tensor) else torch.stack([m.reshape(C) for m in mix])).to(dt)
    outs = tuple((xn + xx * mix[m]).to(x.dtype) for m in range(mix.shape[0]))
    return (outs, xn[:, -1], x) if residual else (outs, xn[:, -1])
