"""Gated delta rule `cpu` backend: the fused C++ kernel of csrc/delta_cpu.cpp behind a
torch.autograd.Function. fp32 (or fp64) state and math, parallel over batch x heads
with OpenMP, SIMD over a state row. Saved for backward: q, k, the gates, β, w = v - Pᵀk
per step and a state snapshot every `chunk_size` steps (64 at N <= 64) that the
backward recomputes from (never dividing by the gate): O(B·T·H·N + B·H·(T/chunk)·N²)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from rwkvx_cli.ops._native import load_library, native_unavailable, ptr

SCRATCH_BYTES = 1 << 20  # the backward's per-thread states buffer: about half a core's L2
SOURCE = Path(__file__).parent / "csrc" / "delta_cpu.cpp"


def _library() -> ctypes.CDLL:
    lib = load_library(SOURCE)
    for name in ("delta_forward_f32", "delta_forward_f64", "delta_backward_f32", "delta_backward_f64"):
        fn = getattr(lib, name)
        n_ptrs = 10 if "forward" in name else 14
        fn.argtypes = [ctypes.c_void_p] * n_ptrs + [ctypes.c_int] * 5 + [ctypes.c_double, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


def unavailable() -> str | None:
    """None when the kernel builds and loads here, else the reason."""
    return native_unavailable(_library)


def chunk_size(N: int, itemsize: int) -> int:
    """Steps between state snapshots: the most (up to 64) whose recomputed states
    (N rows padded to 64 bytes each) fit SCRATCH_BYTES, at least 8. Longer chunks
    save snapshot memory and the forward's transposed snapshot copies."""
    row = -(-N * itemsize // 64) * 64
    chunk = 64
    while chunk > 8 and chunk * N * row > SCRATCH_BYTES:
        chunk //= 2
    return chunk


def _threads(tasks: int) -> int:
    """torch's thread count, but no more threads than (batch, head) tasks."""
    return max(1, min(torch.get_num_threads(), tasks))


def _check(rc: int, N: int) -> None:
    if rc != 0:
        raise ValueError(f"the cpu backend supports head sizes up to 512 (fp32) / 256 (fp64), got N = {N}")


class _DeltaCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, scale):
        B, T, H, N = q.shape
        G = g.shape[-1]
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        q_, k_, v_, g_, beta_ = (x.detach().to(cdt).contiguous() for x in (q, k, v, g, beta))
        A = torch.exp(g_)  # the kernel takes the gate itself
        s0 = state.detach().to(cdt).contiguous()
        y = torch.empty_like(q_)
        s_out = torch.empty_like(s0)
        chunk = chunk_size(N, q_.element_size())
        snaps = q_.new_empty(B, H, -(-T // chunk), N, N)
        w = torch.empty_like(q_)  # v - Pᵀk per step: the backward's recomputation and dβ need it
        lib = _library()
        fn = lib.delta_forward_f64 if cdt == torch.float64 else lib.delta_forward_f32
        args = (q_, k_, v_, A, beta_, s0, y, s_out, snaps, w)
        _check(fn(*map(ptr, args), B, T, H, N, G, scale, chunk, _threads(B * H)), N)
        ctx.save_for_backward(q_, k_, A, beta_, snaps, w)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.dtypes = (q.dtype, g.dtype, beta.dtype, state.dtype)
        return y.to(q.dtype), s_out

    @staticmethod
    def backward(ctx, dy, ds_out):
        q_, k_, A, beta_, snaps, w = ctx.saved_tensors
        B, T, H, N = q_.shape
        G = A.shape[-1]
        cdt = q_.dtype
        dy = dy.to(cdt).contiguous()
        ds_out = ds_out.to(cdt).contiguous()
        dq, dk, dv = (torch.empty_like(q_) for _ in range(3))
        dg, dbeta, ds0 = torch.empty_like(A), torch.empty_like(beta_), torch.empty_like(ds_out)
        lib = _library()
        fn = lib.delta_backward_f64 if cdt == torch.float64 else lib.delta_backward_f32
        args = (q_, k_, A, beta_, snaps, w, dy, ds_out, dq, dk, dv, dg, dbeta, ds0)
        _check(fn(*map(ptr, args), B, T, H, N, G, ctx.scale, ctx.chunk, _threads(B * H)), N)
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
