"""WKV4 `cpu` backend: the fused C++ kernel of csrc/wkv4_cpu.cpp behind a
torch.autograd.Function. OpenMP over batch x groups of channels, SIMD over
channels (a channel's recurrence is independent of every other's), fp32 state
and math (fp64 for fp64 inputs), a state snapshot every CHUNK steps for the
backward. Document starts reach the kernel as one byte per (batch row, step).

The kernel's two entry points are torch custom ops, `torch.ops.rwkvx.wkv4_cpu_fwd`
and `torch.ops.rwkvx.wkv4_cpu_bwd` (docs/operators.md#the-cpu-kernels-as-torch-ops),
so torch.compile traces the autograd.Function around them with no graph break."""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.native import optional_ptr, ptr
from rwkvx_cli.ops._cpu_op import NativeKernel, cpu_kernel_op

CHUNK = 32
KERNEL = NativeKernel("wkv4")  # csrc/wkv4_cpu.cpp
unavailable = KERNEL.unavailable


@cpu_kernel_op("rwkvx::wkv4_cpu_fwd")
def wkv4_cpu_fwd(
    w: Tensor, u: Tensor, k: Tensor, v: Tensor, aa: Tensor, bb: Tensor, pp: Tensor, starts: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: w, u [H, N], k, v [B, T, H, N], the state aa, bb, pp [B, H, N],
    all fp32 or all fp64; starts bool [B, T] (None: no document starts). Returns (y, aa_out,
    bb_out, pp_out, snapshots)."""
    B, T, H, N = k.shape
    ins = [x.contiguous() for x in (w, u, k, v, aa, bb, pp)]
    starts = None if starts is None else starts.contiguous()
    outs = _wkv4_fwd_fake(w, u, k, v, aa, bb, pp)
    fn = KERNEL.forward(k)
    fn(*map(ptr, ins), optional_ptr(starts), *map(ptr, outs), B, T, H * N, CHUNK, torch.get_num_threads())
    return outs


@wkv4_cpu_fwd.register_fake
def _wkv4_fwd_fake(w, u, k, v, aa, bb, pp, starts=None):
    B, T, H, N = k.shape
    y = k.new_empty(B, T, H, N)
    return (y, *(aa.new_empty(B, H, N) for _ in range(3)), k.new_empty(B, (T + CHUNK - 1) // CHUNK, 3, H * N))


@cpu_kernel_op("rwkvx::wkv4_cpu_bwd")
def wkv4_cpu_bwd(
    w: Tensor,
    u: Tensor,
    k: Tensor,
    v: Tensor,
    aa_out: Tensor,
    bb_out: Tensor,
    snaps: Tensor,
    dy: Tensor,
    daa: Tensor,
    dbb: Tensor,
    dpp: Tensor,
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs, its final aa and bb, its snapshots, the
    cotangents of y, aa, bb, pp, and the forward's starts. Returns (dw, du) per batch row
    ([B, H, N]), then dk, dv, and the initial state's daa, dbb, dpp."""
    B, T, H, N = k.shape
    ins = [x.contiguous() for x in (w, u, k, v, aa_out, bb_out, snaps)]
    douts = [x.contiguous() for x in (dy, daa, dbb, dpp)]
    starts = None if starts is None else starts.contiguous()
    grads = _wkv4_bwd_fake(w, u, k, v, aa_out, bb_out, snaps, dy, daa, dbb, dpp)
    fn = KERNEL.backward(k)
    fn(
        *map(ptr, ins),
        optional_ptr(starts),
        *map(ptr, (*douts, *grads)),
        B,
        T,
        H * N,
        CHUNK,
        torch.get_num_threads(),
    )
    return grads


@wkv4_cpu_bwd.register_fake
def _wkv4_bwd_fake(w, u, k, v, aa_out, bb_out, snaps, dy, daa, dbb, dpp, starts=None):
    B, T, H, N = k.shape
    return (
        k.new_empty(B, H, N),
        k.new_empty(B, H, N),
        k.new_empty(B, T, H, N),
        k.new_empty(B, T, H, N),
        *(aa_out.new_empty(B, H, N) for _ in range(3)),
    )


class _WKV4CPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, u, k, v, aa, bb, pp, starts):
        cdt = torch.float64 if k.dtype == torch.float64 else torch.float32
        ins = [x.detach().to(cdt).contiguous() for x in (w, u, k, v)]
        s0 = [s.detach().to(cdt).contiguous() for s in (aa, bb, pp)]
        y, *s_out, snaps = wkv4_cpu_fwd(*ins, *s0, starts)
        ctx.save_for_backward(*ins, s_out[0], s_out[1], snaps, starts)
        ctx.dtypes = (w.dtype, u.dtype, k.dtype, v.dtype, aa.dtype, bb.dtype, pp.dtype)
        return (y.to(k.dtype), *s_out)

    @staticmethod
    def backward(ctx, dy, daa, dbb, dpp):
        w, u, k, v, aaT, bbT, snaps, starts = ctx.saved_tensors
        douts = [g.to(k.dtype).contiguous() for g in (dy, daa, dbb, dpp)]
        dw_rows, du_rows, *rest = wkv4_cpu_bwd(w, u, k, v, aaT, bbT, snaps, *douts, starts)
        grads = (dw_rows.sum(0), du_rows.sum(0), *rest)
        return (*(g.to(dt) for g, dt in zip(grads, ctx.dtypes, strict=True)), None)


def wkv4_cpu(w, u, k, v, state, *, starts=None):
    """starts: bool [B, T] or None (docs/operators.md#document-starts)."""
    y, aa, bb, pp = _WKV4CPU.apply(w, u, k, v, *state, starts)
    return y, (aa, bb, pp)
