"""shift_mix `cpu` backend: the fused C++ kernel of csrc/shift_mix_cpu.cpp behind a
torch.autograd.Function. OpenMP over contiguous ranges of the B·T rows, SIMD over C, one pass
over every tensor; the forward keeps the LayerNorm's per-row mean and 1/std ([B, T]) and the
backward recomputes x̂ from x with them. fp32 or fp64 tensors, fp64 arithmetic for both (see the
kernel's source: outputs that cancel toward 0 keep their relative accuracy).

The kernel's two entry points are torch custom ops, `torch.ops.rwkvx.shift_mix_cpu_fwd` and
`torch.ops.rwkvx.shift_mix_cpu_bwd` (docs/operators.md#the-cpu-kernels-as-torch-ops), so
torch.compile traces the autograd.Function around them with no graph break. channel_mix's `cpu`
backend calls the same ops with one lerp (its backward passes the residual's gradient as
`dx_add`)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from rwkvx_cli.native import optional_ptr, ptr, ptr_array
from rwkvx_cli.ops._cpu_op import NativeKernel, cpu_kernel_op
from rwkvx_cli.ops.shift_mix import MAX_MIXES, mix_grads, mix_rows

# csrc/shift_mix_cpu.cpp; the forward takes eps, a double
KERNEL = NativeKernel("shift_mix", forward=[ctypes.c_void_p] * 10 + [ctypes.c_int] * 5 + [ctypes.c_double])
unavailable = KERNEL.unavailable


def _contiguous(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


@cpu_kernel_op("rwkvx::shift_mix_cpu_fwd")
def shift_mix_cpu_fwd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    mix: list[Tensor],
    state: Tensor | None,
    eps: float,
    starts: Tensor | None = None,
) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """The forward kernel: x [B, T, C], weight, bias [C], mix M (<= 8) lerp weights of C values each,
    state [B, C] (None: zeros), all fp32 or all fp64; starts bool [B, T] (None: no document starts).
    Returns ([y_0, ..., y_{M-1}] each [B, T, C], state_out [B, C], and the LayerNorm's mean and
    1/std [B, T])."""
    B, T, C = x.shape
    M = len(mix)
    if not 1 <= M <= MAX_MIXES:
        raise ValueError(f"the shift_mix cpu kernel takes 1 to {MAX_MIXES} lerps, got {M}")
    ins = [t.contiguous() for t in (x, weight, bias)]
    mix = [m.contiguous() for m in mix]
    state, starts = _contiguous(state), _contiguous(starts)
    ys, s_out, mean, rstd = _shift_mix_fwd_fake(x, weight, bias, mix, state, eps)
    fn = KERNEL.forward(x)
    fn(
        *map(ptr, ins),
        ptr_array(mix),
        optional_ptr(state),
        optional_ptr(starts),
        ptr_array(ys),
        *map(ptr, (s_out, mean, rstd)),
        *(B, T, C, M, torch.get_num_threads(), eps),
    )
    return ys, s_out, mean, rstd


@shift_mix_cpu_fwd.register_fake
def _shift_mix_fwd_fake(x, weight, bias, mix, state, eps, starts=None):
    B, T, C = x.shape
    return [x.new_empty(B, T, C) for _ in range(len(mix))], x.new_empty(B, C), x.new_empty(B, T), x.new_empty(B, T)


@cpu_kernel_op("rwkvx::shift_mix_cpu_bwd")
def shift_mix_cpu_bwd(
    dys: list[Tensor | None],
    dstate_out: Tensor | None,
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    mix: list[Tensor],
    state: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    dx_add: Tensor | None,
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the M outputs' cotangents (None: zero, not read), state_out's (None:
    zero), the forward's inputs (state None: the zero state) and statistics, dx_add [B, T, C],
    a gradient added into dx (None: nothing), and the forward's starts. Returns (dx, dweight,
    dbias, dmix [M, C], dstate), dstate empty ([0]) for a None state."""
    B, T, C = x.shape
    M = len(mix)
    if len(dys) != M:
        raise ValueError(f"shift_mix_cpu_bwd: {len(dys)} output cotangents for {M} lerps")
    dys = [_contiguous(g) for g in dys]
    dstate_out, dx_add, state = _contiguous(dstate_out), _contiguous(dx_add), _contiguous(state)
    starts = _contiguous(starts)
    ins = [t.contiguous() for t in (x, weight, bias)]
    mix = [m.contiguous() for m in mix]
    stats = [mean.contiguous(), rstd.contiguous()]
    grads = _shift_mix_bwd_fake(dys, dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add)
    fn = KERNEL.backward(x)
    fn(
        ptr_array(dys),
        optional_ptr(dstate_out),
        *map(ptr, ins),
        ptr_array(mix),
        optional_ptr(state),
        optional_ptr(starts),
        *map(ptr, stats),
        optional_ptr(dx_add),
        *map(ptr, grads[:4]),
        optional_ptr(grads[4] if state is not None else None),
        *(B, T, C, M, torch.get_num_threads()),
    )
    return grads


@shift_mix_cpu_bwd.register_fake
def _shift_mix_bwd_fake(dys, dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add, starts=None):
    B, T, C = x.shape
    dstate = x.new_empty(0) if state is None else state.new_empty(B, C)
    return x.new_empty(B, T, C), weight.new_empty(C), bias.new_empty(C), x.new_empty(len(mix), C), dstate


class _ShiftMixCPU(torch.autograd.Function):
    """Inputs (x, weight, bias, state, starts, eps, residual, *mix): mix one [M, C] tensor, or M tensors
    of C values each (the model's parameters, passed as they are: no cat of them)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, starts, eps, residual, *mix):
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        xc, *params = (t.detach().to(cdt).contiguous() for t in (x, weight, bias))
        rows = mix_rows(mix, cdt)
        s0 = None if state is None else state.detach().to(cdt).contiguous()
        ys, s_out, mean, rstd = shift_mix_cpu_fwd(xc, *params, rows, s0, eps, starts)
        ctx.save_for_backward(xc, *params, s0, starts, mean, rstd, *rows)
        ctx.set_materialize_grads(False)  # an unused output's cotangent stays None: the kernel skips it
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype, None if state is None else state.dtype)
        ctx.mix_like = [(m.shape, m.dtype) for m in mix]
        ctx.residual = residual
        return (*(y.to(x.dtype) for y in ys), s_out, *((x,) if residual else ()))  # x as is: autograd views it

    @staticmethod
    def backward(ctx, *douts):
        x, weight, bias, s0, starts, mean, rstd, *rows = ctx.saved_tensors
        dres = douts[-1] if ctx.residual else None  # the residual stream's gradient: added into dx by the kernel
        douts = douts[:-1] if ctx.residual else douts
        *dys, ds = (None if g is None else g.to(x.dtype) for g in douts)
        dres = None if dres is None else dres.to(x.dtype)
        dx, dw, db, dmix, dstate = shift_mix_cpu_bwd(dys, ds, x, weight, bias, rows, s0, mean, rstd, dres, starts)
        grads = [None if dt is None else g.to(dt) for g, dt in zip((dx, dw, db, dstate), ctx.dtypes, strict=True)]
        return (*grads, None, None, None, *mix_grads(dmix, ctx.mix_like))


def shift_mix_cpu(x, weight, bias, mix, state, *, eps: float = 1e-5, residual: bool = False, starts=None):
    """state None: the zero state, with no tensor for it (Backend.optional_state). `residual`: x is
    returned too, its gradient added into dx by the kernel (the public function's docstring). mix:
    one [M, C] tensor or a sequence of M tensors of C values. starts: bool [B, T] or None."""
    mixes = (mix,) if isinstance(mix, torch.Tensor) else tuple(mix)
    outs = _ShiftMixCPU.apply(x, weight, bias, state, starts, eps, residual, *mixes)
    if residual:
        *ys, s_out, x_out = outs
        return tuple(ys), s_out, x_out
    *ys, s_out = outs
    return tuple(ys), s_out
