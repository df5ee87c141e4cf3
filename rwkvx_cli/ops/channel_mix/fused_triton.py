"""channel_mix `triton` backend: the shared autograd Function (fused.py) around torch's matmuls, over
shift_mix's Triton kernels with one lerp (its backward adding the residual's gradient into dx)
and a relu² pair: a = relu(h)² forward, dh = 2 sqrt(a) da backward (from the output, so h is
not kept). One flat pass each over h [B·T, F], in its dtype, math in fp32 (fp64 for fp64).

The relu² launches are torch ops, `torch.ops.rwkvx.relu2_triton_fwd` and `_bwd`; shift_mix's are
`torch.ops.rwkvx.shift_mix_triton_fwd` and `_bwd` (docs/operators.md#the-triton-kernels-as-torch-ops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)
from rwkvx_cli.ops.channel_mix.fused import Kernels, channel_mix_with
from rwkvx_cli.ops.shift_mix import fused_triton as shift  # noqa: F401  (registers shift_mix's ops)

BLOCK = 2048  # elements per program
WARPS = 4

if triton is not None:

    @triton.jit
    def _relu2_fwd_kernel(h, a, numel, BLOCK: tl.constexpr, DT: tl.constexpr):
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # i64: B·T·F passes 2^31
        m = off < numel
        x = tl.maximum(tl.load(h + off, mask=m, other=0.0).to(DT), 0.0)
        tl.store(a + off, (x * x).to(a.dtype.element_ty), mask=m)

    @triton.jit
    def _relu2_bwd_kernel(da, a, dh, numel, BLOCK: tl.constexpr, DT: tl.constexpr):
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < numel
        g = tl.load(da + off, mask=m, other=0.0).to(DT)
        r = tl.sqrt(tl.load(a + off, mask=m, other=0.0).to(DT))  # relu(h), from a = relu(h)²
        tl.store(dh + off, (2.0 * r * g).to(dh.dtype.element_ty), mask=m)


@triton_op("rwkvx::relu2_triton_fwd")
def relu2_triton_fwd(h: Tensor) -> Tensor:
    """relu(h)², in h's dtype."""
    h = h.contiguous()
    a = torch.empty_like(h)
    _, DT = tr.compute_dtype(h.dtype)
    wrap_triton(_relu2_fwd_kernel)[(triton.cdiv(h.numel(), BLOCK),)](h, a, h.numel(), BLOCK, DT, num_warps=WARPS)
    return a


@triton_op("rwkvx::relu2_triton_bwd")
def relu2_triton_bwd(da: Tensor, a: Tensor) -> Tensor:
    """2 sqrt(a) da, the gradient of h from a = relu(h)², in da's dtype."""
    da, a = da.contiguous(), a.contiguous()
    dh = torch.empty_like(da)
    _, DT = tr.compute_dtype(da.dtype)
    wrap_triton(_relu2_bwd_kernel)[(triton.cdiv(da.numel(), BLOCK),)](da, a, dh, da.numel(), BLOCK, DT, num_warps=WARPS)
    return dh


def _shift_fwd(x, weight, bias, mix, state, eps, starts):
    (xk,), s_out, mean, rstd = torch.ops.rwkvx.shift_mix_triton_fwd(x, weight, bias, [*mix], state, eps, starts)
    return xk, s_out, mean, rstd


def _shift_bwd(dxk, dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add, starts):
    return torch.ops.rwkvx.shift_mix_triton_bwd(
        [dxk], dstate_out, x, weight, bias, [*mix], state, mean, rstd, dx_add, starts
    )


# x_k comes back in x's dtype (the compute dtype's rounding to it is what the Function's cast to the
# matmul dtype does anyway), and dx in x's dtype too: no fp32 copy of either for bf16 inputs.
channel_mix_triton = channel_mix_with(
    Kernels(_shift_fwd, _shift_bwd, torch.ops.rwkvx.relu2_triton_fwd, torch.ops.rwkvx.relu2_triton_bwd)
)
