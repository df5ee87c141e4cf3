"""rwkv8 `cpu` backend: the fused C++ kernel of csrc/rwkv8_cpu.cpp behind a
torch.autograd.Function. fp32 state and math (fp64 for fp64 inputs), parallel
over batch x heads with OpenMP, SIMD over E (forward) and L (backward, on the
transposed state), a state snapshot every CHUNK steps for the backward. Document
starts go to the kernel as one byte per token (csrc/rwkv8_cpu.cpp).

The kernel's two entry points are torch custom ops, `torch.ops.rwkvx.rwkv8_cpu_fwd`
and `torch.ops.rwkvx.rwkv8_cpu_bwd` (docs/operators.md#the-cpu-kernels-as-torch-ops),
so torch.compile traces the autograd.Function around them with no graph break."""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.native import optional_ptr, ptr
from rwkvx_cli.ops._cpu_op import NativeKernel, cpu_kernel_op

CHUNK = 16
KERNEL = NativeKernel("rwkv8")  # csrc/rwkv8_cpu.cpp
unavailable = KERNEL.unavailable


def _dims(q: Tensor, v: Tensor) -> tuple[int, ...]:
    B, T, H, L = q.shape
    return B, T, H, v.shape[2], L, v.shape[3]


@cpu_kernel_op("rwkvx::rwkv8_cpu_fwd")
def rwkv8_cpu_fwd(
    q: Tensor, v: Tensor, d: Tensor, rho: Tensor, norm: Tensor, starts: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: q [B, T, H, L], v [B, T, Hv, E], d [H, L], the state rho
    [B, H, L, E] and norm [B, H, L], all fp32 or all fp64; starts bool [B, T] (None: no
    document starts). Returns (y, rho_out, norm_out, snapshots of rho, snapshots of norm)."""
    ins = [x.contiguous() for x in (q, v, d, rho, norm)]
    starts = None if starts is None else starts.contiguous()
    outs = _rwkv8_fwd_fake(q, v, d, rho, norm)
    fn = KERNEL.forward(q)
    fn(*map(ptr, ins), optional_ptr(starts), *map(ptr, outs), *_dims(q, v), CHUNK, torch.get_num_threads())
    return outs


@rwkv8_cpu_fwd.register_fake
def _rwkv8_fwd_fake(q, v, d, rho, norm, starts=None):
    B, T, H, _, L, E = _dims(q, v)
    n_chunks = (T + CHUNK - 1) // CHUNK
    return (
        q.new_empty(B, T, H, E),
        rho.new_empty(B, H, L, E),
        norm.new_empty(B, H, L),
        q.new_empty(B, H, n_chunks, L, E),
        q.new_empty(B, H, n_chunks, L),
    )


@cpu_kernel_op("rwkvx::rwkv8_cpu_bwd")
def rwkv8_cpu_bwd(
    q: Tensor,
    v: Tensor,
    d: Tensor,
    snaps: Tensor,
    nsnaps: Tensor,
    dy: Tensor,
    drho: Tensor,
    dnorm: Tensor,
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs and snapshots, the cotangents of y,
    rho_out and norm_out, and the forward's starts. Returns (dq, dv per head [B, T, H, E],
    dd per batch row [B, H, L], drho, dnorm)."""
    ins = [x.contiguous() for x in (q, v, d, snaps, nsnaps)]
    douts = [x.contiguous() for x in (dy, drho, dnorm)]
    starts = None if starts is None else starts.contiguous()
    grads = _rwkv8_bwd_fake(q, v, d, snaps, nsnaps, dy, drho, dnorm)
    fn = KERNEL.backward(q)
    fn(
        *map(ptr, ins),
        optional_ptr(starts),
        *map(ptr, (*douts, *grads)),
        *_dims(q, v),
        CHUNK,
        torch.get_num_threads(),
    )
    return grads


@rwkv8_cpu_bwd.register_fake
def _rwkv8_bwd_fake(q, v, d, snaps, nsnaps, dy, drho, dnorm, starts=None):
    B, T, H, _, L, E = _dims(q, v)
    return (
        q.new_empty(B, T, H, L),
        q.new_empty(B, T, H, E),
        q.new_empty(B, H, L),
        drho.new_empty(B, H, L, E),
        dnorm.new_empty(B, H, L),
    )


class _RWKV8CPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, v, d, rho, norm, starts):
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        ins = [x.detach().to(cdt).contiguous() for x in (q, v, d)]
        s0 = [s.detach().to(cdt).contiguous() for s in (rho, norm)]
        y, rho_out, norm_out, snaps, nsnaps = rwkv8_cpu_fwd(*ins, *s0, starts)
        ctx.save_for_backward(*ins, snaps, nsnaps, starts)
        ctx.dtypes = (q.dtype, v.dtype, d.dtype, rho.dtype, norm.dtype)
        return y.to(q.dtype), rho_out, norm_out

    @staticmethod
    def backward(ctx, dy, drho, dnorm):
        q, v, d, snaps, nsnaps, starts = ctx.saved_tensors
        H, Hv = q.shape[2], v.shape[2]
        douts = [g.to(q.dtype).contiguous() for g in (dy, drho, dnorm)]
        dq, dv_heads, dd_rows, drho0, dnorm0 = rwkv8_cpu_bwd(q, v, d, snaps, nsnaps, *douts, starts)
        dv = dv_heads.sum(2, keepdim=True) if Hv == 1 and H > 1 else dv_heads
        grads = (dq, dv, dd_rows.sum(0), drho0, dnorm0)
        return (*(g.to(dt) for g, dt in zip(grads, ctx.dtypes, strict=True)), None)


def rwkv8_cpu(q, v, d, state, *, starts=None):
    """starts: bool [B, T] or None (docs/operators.md#document-starts)."""
    y, rho, norm = _RWKV8CPU.apply(q, v, d, *state, starts)
    return y, (rho, norm)
