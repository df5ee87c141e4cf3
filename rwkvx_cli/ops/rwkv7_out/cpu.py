"""rwkv7_out `cpu` backend: the fused C++ kernel of csrc/rwkv7_out_cpu.cpp behind a
torch.autograd.Function. One pass over each tensor, OpenMP over the B·T rows, SIMD over each
head's channels, fp32 math (fp64 for fp64 inputs). The backward saves the inputs and each
(row, head)'s mean and rstd ([B, T, H]).

The kernel's two entry points are torch custom ops, `torch.ops.rwkvx.rwkv7_out_cpu_fwd` and
`torch.ops.rwkvx.rwkv7_out_cpu_bwd` (docs/operators.md#the-cpu-kernels-as-torch-ops), so
torch.compile traces the autograd.Function around them with no graph break."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from rwkvx_cli.native import ptr
from rwkvx_cli.ops._cpu_op import NativeKernel, cpu_kernel_op, threads

# csrc/rwkv7_out_cpu.cpp; the forward takes eps, a double
KERNEL = NativeKernel("rwkv7_out", forward=[ctypes.c_void_p] * 8 + [ctypes.c_int] * 4 + [ctypes.c_double])
unavailable = KERNEL.unavailable


@cpu_kernel_op("rwkvx::rwkv7_out_cpu_fwd")
def rwkv7_out_cpu_fwd(
    y: Tensor, bonus: Tensor, g: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernel: y, bonus, g [B, T, H, N], weight and bias [C], all fp32 or all fp64.
    Returns (out, mean, rstd), the statistics [B, T, H] in fp64 (the backward's dy cancels down to
    far below its terms, see the kernel)."""
    B, T, H, N = y.shape
    ins = [x.contiguous() for x in (y, bonus, g, weight, bias)]
    outs = _fwd_fake(y, bonus, g, weight, bias, eps)
    fn = KERNEL.forward(y)
    fn(*map(ptr, (*ins, *outs)), B * T, H, N, threads(B * T), eps)
    return outs


@rwkv7_out_cpu_fwd.register_fake
def _fwd_fake(y, bonus, g, weight, bias, eps):
    B, T, H, N = y.shape
    stats = (B, T, H)
    return y.new_empty(B, T, H, N), y.new_empty(stats, dtype=torch.float64), y.new_empty(stats, dtype=torch.float64)


@cpu_kernel_op("rwkvx::rwkv7_out_cpu_bwd")
def rwkv7_out_cpu_bwd(
    y: Tensor, bonus: Tensor, g: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs, its mean and rstd, and the output's cotangent.
    Returns (dy, dbonus, dg, dweight, dbias)."""
    B, T, H, N = y.shape
    ins = [x.contiguous() for x in (y, bonus, g, weight, bias, mean, rstd, dout)]
    grads = _bwd_fake(y, bonus, g, weight, bias, mean, rstd, dout)
    fn = KERNEL.backward(y)
    fn(*map(ptr, (*ins, *grads)), B * T, H, N, threads(B * T))
    return grads


@rwkv7_out_cpu_bwd.register_fake
def _bwd_fake(y, bonus, g, weight, bias, mean, rstd, dout):
    return (*(y.new_empty(y.shape) for _ in range(3)), y.new_empty(weight.shape), y.new_empty(bias.shape))


class _Rwkv7OutCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bonus, g, weight, bias, eps):
        cdt = torch.float64 if y.dtype == torch.float64 else torch.float32
        ins = [x.detach().to(cdt).contiguous() for x in (y, bonus, g, weight, bias)]
        out, mean, rstd = rwkv7_out_cpu_fwd(*ins, eps)
        ctx.save_for_backward(*ins, mean, rstd)
        ctx.dtypes = (y.dtype, bonus.dtype, g.dtype, weight.dtype, bias.dtype)
        return out.to(y.dtype)

    @staticmethod
    def backward(ctx, dout):
        *ins, mean, rstd = ctx.saved_tensors
        grads = rwkv7_out_cpu_bwd(*ins, mean, rstd, dout.to(ins[0].dtype))
        return (*(gr.to(dt) for gr, dt in zip(grads, ctx.dtypes, strict=True)), None)


def rwkv7_out_cpu(y, bonus, g, weight, bias, *, eps):
    C = y.shape[-2] * y.shape[-1]
    return _Rwkv7OutCPU.apply(y, bonus, g, weight.reshape(C), bias.reshape(C), float(eps))
