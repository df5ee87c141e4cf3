"""Gated delta rule `cpu` backend: the fused C++ kernel of csrc/delta_cpu.cpp behind a
torch.autograd.Function. fp32 (or fp64) state and math, parallel over batch x heads
with OpenMP, SIMD over a state row. Saved for backward: q, k, the gates, β, w = v - Pᵀk
per step and a state snapshot every `chunk_size` steps (64 at N <= 64) that the
backward recomputes from (never dividing by the gate): O(B·T·H·N + B·H·(T/chunk)·N²).

The kernel's two entry points are torch custom ops, `torch.ops.rwkvx.delta_cpu_fwd`
and `torch.ops.rwkvx.delta_cpu_bwd` (docs/operators.md#the-cpu-kernels-as-torch-ops),
so torch.compile traces the autograd.Function around them with no graph break."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from rwkvx_cli.native import ptr
from rwkvx_cli.ops._cpu_op import NativeKernel, cpu_kernel_op, threads

SCRATCH_BYTES = 1 << 20  # the backward's per-thread states buffer: about half a core's L2
# csrc/delta_cpu.cpp: each entry point takes (pointers..., B, T, H, N, G, scale, chunk, threads) and
# returns 0, or -1 for a head size past the kernel's (_check)
_SIZES = [ctypes.c_int] * 5 + [ctypes.c_double, ctypes.c_int, ctypes.c_int]
KERNEL = NativeKernel("delta", forward=[ctypes.c_void_p] * 10 + _SIZES, backward=[ctypes.c_void_p] * 14 + _SIZES)
unavailable = KERNEL.unavailable


def chunk_size(N: int, itemsize: int) -> int:
    """Steps between state snapshots: the most (up to 64) whose recomputed states
    (N rows padded to 64 bytes each) fit SCRATCH_BYTES, at least 8. Longer chunks
    save snapshot memory and the forward's transposed snapshot copies."""
    row = -(-N * itemsize // 64) * 64
    chunk = 64
    while chunk > 8 and chunk * N * row > SCRATCH_BYTES:
        chunk //= 2
    return chunk


def _check(rc: int, N: int) -> None:
    if rc != 0:
        raise ValueError(f"the cpu backend supports head sizes up to 512 (fp32) / 256 (fp64), got N = {N}")


@cpu_kernel_op("rwkvx::delta_cpu_fwd")
def delta_cpu_fwd(
    q: Tensor, k: Tensor, v: Tensor, A: Tensor, beta: Tensor, state: Tensor, scale: float, chunk: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: q, k, v [B, T, H, N], the gate itself A = exp(g) [B, T, H, G]
    (G = 1 or N), β [B, T, H], state [B, H, N, N], all fp32 or all fp64; a snapshot every
    `chunk` steps (see chunk_size). Returns (y, state_out, snapshots, w = v - Pᵀk)."""
    B, T, H, N = q.shape
    ins = [x.contiguous() for x in (q, k, v, A, beta, state)]
    outs = _delta_fwd_fake(q, k, v, A, beta, state, scale, chunk)
    fn = KERNEL.forward(q)
    _check(fn(*map(ptr, (*ins, *outs)), B, T, H, N, A.shape[-1], scale, chunk, threads(B * H)), N)
    return outs


@delta_cpu_fwd.register_fake
def _delta_fwd_fake(q, k, v, A, beta, state, scale, chunk):
    B, T, H, N = q.shape
    return (
        q.new_empty(B, T, H, N),
        state.new_empty(B, H, N, N),
        q.new_empty(B, H, -(-T // chunk), N, N),
        q.new_empty(B, T, H, N),
    )


@cpu_kernel_op("rwkvx::delta_cpu_bwd")
def delta_cpu_bwd(
    q: Tensor,
    k: Tensor,
    A: Tensor,
    beta: Tensor,
    snaps: Tensor,
    w: Tensor,
    dy: Tensor,
    ds_out: Tensor,
    scale: float,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's q, k, A, β, snapshots and w, and the cotangents
    of y and state_out. Returns (dq, dk, dv, dg (w.r.t. the log-gate), dβ, dstate)."""
    B, T, H, N = q.shape
    ins = [x.contiguous() for x in (q, k, A, beta, snaps, w, dy, ds_out)]
    grads = _delta_bwd_fake(q, k, A, beta, snaps, w, dy, ds_out, scale, chunk)
    fn = KERNEL.backward(q)
    _check(fn(*map(ptr, (*ins, *grads)), B, T, H, N, A.shape[-1], scale, chunk, threads(B * H)), N)
    return grads


@delta_cpu_bwd.register_fake
def _delta_bwd_fake(q, k, A, beta, snaps, w, dy, ds_out, scale, chunk):
    return (
        *(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3)),
        torch.empty_like(A, memory_format=torch.contiguous_format),
        torch.empty_like(beta, memory_format=torch.contiguous_format),
        torch.empty_like(ds_out, memory_format=torch.contiguous_format),
    )


class _DeltaCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, scale):
        N = q.shape[-1]
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        q_, k_, v_, g_, beta_ = (x.detach().to(cdt).contiguous() for x in (q, k, v, g, beta))
        A = torch.exp(g_)  # the kernel takes the gate itself
        s0 = state.detach().to(cdt).contiguous()
        chunk = chunk_size(N, 8 if cdt == torch.float64 else 4)
        y, s_out, snaps, w = delta_cpu_fwd(q_, k_, v_, A, beta_, s0, scale, chunk)
        ctx.save_for_backward(q_, k_, A, beta_, snaps, w)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.dtypes = (q.dtype, g.dtype, beta.dtype, state.dtype)
        return y.to(q.dtype), s_out

    @staticmethod
    def backward(ctx, dy, ds_out):
        q_, k_, A, beta_, snaps, w = ctx.saved_tensors
        cdt = q_.dtype
        dy = dy.to(cdt).contiguous()
        ds_out = ds_out.to(cdt).contiguous()
        dq, dk, dv, dg, dbeta, ds0 = delta_cpu_bwd(
            q_, k_, A, beta_, snaps, w, dy, ds_out, ctx.scale, ctx.chunk
        )
        x_dtype, g_dtype, beta_dtype, state_dtype = ctx.dtypes
        return (
            *(x.to(x_dtype) for x in (dq, dk, dv)),
            dg.to(g_dtype),
            dbeta.to(beta_dtype),
            ds0.to(state_dtype),
            None,
        )


def delta_cpu(q, k, v, g, beta, state, scale):
    return _DeltaCPU.apply(q, k, v, g, beta, state, float(scale))
