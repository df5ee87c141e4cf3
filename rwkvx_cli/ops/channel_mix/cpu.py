"""channel_mix `cpu` backend: the shared Function of fused.py over C++ kernels: shift_mix's own
(`torch.ops.rwkvx.shift_mix_cpu_fwd` / `_bwd` with one lerp, the residual's gradient passed as
`dx_add`) and relu² from csrc/channel_mix_cpu.cpp, one pass each way, as the torch custom ops
`torch.ops.rwkvx.relu2_cpu_fwd` and `torch.ops.rwkvx.relu2_cpu_bwd`
(docs/operators.md#the-cpu-kernels-as-torch-ops). The matmuls are torch's."""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.native import ptr
from rwkvx_cli.ops._cpu_op import NativeKernel, cpu_kernel_op
from rwkvx_cli.ops.channel_mix.fused import Kernels, channel_mix_with
from rwkvx_cli.ops.shift_mix import cpu as shift_mix_cpu

KERNEL = NativeKernel("channel_mix", needs=shift_mix_cpu.KERNEL)  # csrc/channel_mix_cpu.cpp: relu²
unavailable = KERNEL.unavailable
KERNEL_DTYPES = (torch.float32, torch.float64)


def _rows_cols(t: Tensor) -> tuple[int, int]:
    """Any shape as rows × cols (two C ints, so that the count may pass 2³¹)."""
    cols = t.shape[-1] if t.dim() else 1
    return (t.numel() // cols if cols else 0), cols


@cpu_kernel_op("rwkvx::relu2_cpu_fwd")
def relu2_cpu_fwd(h: Tensor) -> Tensor:
    """a = relu(h)², any shape, fp32 or fp64."""
    h = h.contiguous()
    a = torch.empty_like(h)
    KERNEL.forward(h)(ptr(h), ptr(a), *_rows_cols(h), torch.get_num_threads())
    return a


@relu2_cpu_fwd.register_fake
def _relu2_fwd_fake(h):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@cpu_kernel_op("rwkvx::relu2_cpu_bwd")
def relu2_cpu_bwd(da: Tensor, a: Tensor) -> Tensor:
    """dh = 2 sqrt(a) da, the gradient of relu(h)² from its output a, both of one shape and dtype."""
    da, a = da.contiguous(), a.contiguous()
    dh = torch.empty_like(a)
    KERNEL.backward(a)(ptr(da), ptr(a), ptr(dh), *_rows_cols(a), torch.get_num_threads())
    return dh


@relu2_cpu_bwd.register_fake
def _relu2_bwd_fake(da, a):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _shift_fwd(x, weight, bias, mix, state, eps, starts):
    ys, s_out, mean, rstd = shift_mix_cpu.shift_mix_cpu_fwd(
        x.to(weight.dtype), weight, bias, [*mix], state, eps, starts
    )
    return ys[0], s_out, mean, rstd


def _shift_bwd(dxk, dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add, starts):
    x = x.to(weight.dtype)
    return shift_mix_cpu.shift_mix_cpu_bwd(
        [dxk], dstate_out, x, weight, bias, [*mix], state, mean, rstd, dx_add, starts
    )


# Under bf16 autocast h and a are bf16 (the matmuls' dtype), which the kernels do not take: torch's
# elementwise ops then, as the composition runs them.
def _relu2_fwd(h):
    return relu2_cpu_fwd(h) if h.dtype in KERNEL_DTYPES else torch.relu(h).square()


def _relu2_bwd(da, a):
    return relu2_cpu_bwd(da, a) if a.dtype in KERNEL_DTYPES else 2 * a.sqrt() * da


channel_mix_cpu = channel_mix_with(Kernels(_shift_fwd, _shift_bwd, _relu2_fwd, _relu2_bwd))
