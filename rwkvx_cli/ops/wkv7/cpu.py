"""WKV7 `cpu` backend: the fused C++ kernel of csrc/wkv7_cpu.cpp behind a
torch.autograd.Function. fp32 (or fp64) state and math, parallel over batch x
heads with OpenMP; the forward saves a state snapshot every CHUNK steps and
sa_t = S_{t-1} a_t for the backward (memory B*H*(T/CHUNK)*N² + B*T*H*N). The kernel
takes the log-decay and forms each step's exp(w) itself; a None state is the zero
state, with no tensor for it and no gradient.

The kernel's two entry points are torch custom ops, `torch.ops.rwkvx.wkv7_cpu_fwd`
and `torch.ops.rwkvx.wkv7_cpu_bwd` (docs/operators.md#the-cpu-kernels-as-torch-ops),
so torch.compile traces the autograd.Function around them with no graph break."""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.native import optional_ptr, ptr
from rwkvx_cli.ops._cpu_op import NativeKernel, cpu_kernel_op

CHUNK = 16
KERNEL = NativeKernel("wkv7")  # csrc/wkv7_cpu.cpp
unavailable = KERNEL.unavailable


@cpu_kernel_op("rwkvx::wkv7_cpu_fwd")
def wkv7_cpu_fwd(
    r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: r..b [B, T, H, N] (w the log-decay, <= 0) and state [B, H, N, N] (None:
    zeros), all fp32 or all fp64. Returns (y, state_out, snapshots, sa)."""
    B, T, H, N = r.shape
    ins = [x.contiguous() for x in (r, w, k, v, a, b)]
    s0 = None if state is None else state.contiguous()  # kept alive by the name while the kernel runs
    y, s_out, snaps, sas = _wkv7_fwd_fake(r, w, k, v, a, b, state)
    fn = KERNEL.forward(r)
    fn(*map(ptr, ins), optional_ptr(s0), *map(ptr, (y, s_out, snaps, sas)), B, T, H, N, CHUNK, torch.get_num_threads())
    return y, s_out, snaps, sas


@wkv7_cpu_fwd.register_fake
def _wkv7_fwd_fake(r, w, k, v, a, b, state):
    B, T, H, N = r.shape
    y = r.new_empty(B, T, H, N)
    return y, r.new_empty(B, H, N, N), r.new_empty(B, H, (T + CHUNK - 1) // CHUNK, N, N), r.new_empty(B, T, H, N)


@cpu_kernel_op("rwkvx::wkv7_cpu_bwd")
def wkv7_cpu_bwd(
    r: Tensor,
    w: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    snaps: Tensor,
    sas: Tensor,
    dy: Tensor,
    ds_out: Tensor | None,
    need_dstate: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs (w the log-decay), its snapshots and sa, the
    cotangents of y and state_out (None: zero, as in training without a carried state), and
    whether the initial state's gradient is wanted. Returns (dr, dw_log, dk, dv, da, db, dstate),
    dstate empty ([0]) when not wanted."""
    B, T, H, N = r.shape
    ins = [x.contiguous() for x in (r, w, k, v, a, b, snaps, sas, dy)]
    grads = _wkv7_bwd_fake(r, w, k, v, a, b, snaps, sas, dy, ds_out, need_dstate)
    fn = KERNEL.backward(r)
    ds = None if ds_out is None else ds_out.contiguous()  # kept alive by the name while the kernel runs
    ds0 = optional_ptr(grads[6] if need_dstate else None)
    fn(*map(ptr, ins), optional_ptr(ds), *map(ptr, grads[:6]), ds0, B, T, H, N, CHUNK, torch.get_num_threads())
    return grads


@wkv7_cpu_bwd.register_fake
def _wkv7_bwd_fake(r, w, k, v, a, b, snaps, sas, dy, ds_out, need_dstate):
    B, T, H, N = r.shape
    return (*(r.new_empty(B, T, H, N) for _ in range(6)), r.new_empty((B, H, N, N) if need_dstate else (0,)))


class _WKV7CPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, w, k, v, a, b, state):
        cdt = torch.float64 if r.dtype == torch.float64 else torch.float32
        ins = [x.detach().to(cdt).contiguous() for x in (r, w, k, v, a, b)]
        s0 = None if state is None else state.detach().to(cdt).contiguous()
        y, s_out, snaps, sas = wkv7_cpu_fwd(*ins, s0)
        ctx.save_for_backward(*ins, snaps, sas)
        ctx.dtypes = (r.dtype, None if state is None else state.dtype)
        ctx.set_materialize_grads(False)  # an unused final state's cotangent stays None: the kernel reads no zeros
        return y.to(r.dtype), s_out

    @staticmethod
    def backward(ctx, dy, ds_out):
        *ins, snaps, sas = ctx.saved_tensors
        cdt = ins[0].dtype
        dy = torch.zeros_like(ins[0]) if dy is None else dy.to(cdt)
        ds_out = None if ds_out is None else ds_out.to(cdt)
        in_dtype, state_dtype = ctx.dtypes
        grads = wkv7_cpu_bwd(*ins, snaps, sas, dy, ds_out, state_dtype is not None and ctx.needs_input_grad[6])
        ds0 = grads[6].to(state_dtype) if grads[6].numel() else None
        return (*(g.to(in_dtype) for g in grads[:6]), ds0)


def wkv7_cpu(r, w, k, v, a, b, state):
    """state None: the zero state, with no tensor for it (Backend.optional_state)."""
    return _WKV7CPU.apply(r, w, k, v, a, b, state)
