"""rwkv7_prep oracle: today's torch composition of RWKV-7's time mix between its matmuls and the
recurrence, differentiated by autograd, in the dtype of its inputs (fp64: the gradient-check
oracle). The parameters arrive as [C]. Computed in fp32 at least (bf16 inputs are upcast, as the
kernels do), the outputs in the inputs' dtype."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DECAY_SCALE = math.exp(-0.5)  # w = -e^{-1/2} σ(...): the decay e^w lies in (0.545, 1)


def rwkv7_prep_reference(r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k, *, pass_r=False):
    B, T, H, N = r.shape
    r_in = r
    out_dtype = r.dtype
    dt = torch.float64 if out_dtype == torch.float64 else torch.float32
    r, k, v, w_lora, a_lora, v_first, v_lora = (
        None if t is None else t.to(dt) for t in (r, k, v, w_lora, a_lora, v_first, v_lora)
    )

    def chan(p):
        return p.to(dt).view(H, N)

    w = -DECAY_SCALE * torch.sigmoid(chan(w0) + w_lora)
    ag = torch.sigmoid(chan(a0) + a_lora)
    if v_first is not None:
        v = v + (v_first - v) * torch.sigmoid(chan(v0) + v_lora)
    kk = F.normalize(k * chan(k_k), dim=-1, p=2.0)
    k = k * (1 + (ag - 1) * chan(k_a))
    bonus = (r * k * chan(r_k)).sum(dim=-1, keepdim=True) * v
    outs = tuple(t.to(out_dtype) for t in (w, k, v, -kk, kk * ag, bonus))
    return (*outs, r_in) if pass_r else outs
