"""WKV4 `cpu` backend: the fused C++ kernel of csrc/wkv4_cpu.cpp behind a
torch.autograd.Function. OpenMP over batch x groups of channels, SIMD over
channels (a channel's recurrence is independent of every other's), fp32 state
and math (fp64 for fp64 inputs), a state snapshot every CHUNK steps for the
backward."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from rwkvx_cli.ops._native import load_library, native_unavailable, ptr

CHUNK = 32
SOURCE = Path(__file__).parent / "csrc" / "wkv4_cpu.cpp"


def _library() -> ctypes.CDLL:
    return load_library(SOURCE)


def unavailable() -> str | None:
    """None when the kernel builds and loads here, else the reason."""
    return native_unavailable(_library)


class _WKV4CPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, u, k, v, aa, bb, pp):
        B, T, H, N = k.shape
        cdt = torch.float64 if k.dtype == torch.float64 else torch.float32
        ins = [x.detach().to(cdt).contiguous() for x in (w, u, k, v)]
        s0 = [s.detach().to(cdt).contiguous() for s in (aa, bb, pp)]
        y = torch.empty_like(ins[2])
        s_out = [torch.empty_like(s0[0]) for _ in range(3)]
        snaps = y.new_empty(B, (T + CHUNK - 1) // CHUNK, 3, H * N)
        fn = _library().wkv4_forward_f64 if cdt == torch.float64 else _library().wkv4_forward_f32
        fn(*map(ptr, (*ins, *s0, y, *s_out, snaps)), B, T, H * N, CHUNK, torch.get_num_threads())
        ctx.save_for_backward(*ins, s_out[0], s_out[1], snaps)
        ctx.dtypes = (w.dtype, u.dtype, k.dtype, v.dtype, aa.dtype, bb.dtype, pp.dtype)
        return (y.to(k.dtype), *s_out)

    @staticmethod
    def backward(ctx, dy, daa, dbb, dpp):
        w, u, k, v, aaT, bbT, snaps = ctx.saved_tensors
        B, T, H, N = k.shape
        cdt = k.dtype
        douts = [g.to(cdt).contiguous() for g in (dy, daa, dbb, dpp)]
        dw_rows = k.new_empty(B, H, N)
        du_rows = k.new_empty(B, H, N)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        ds0 = [torch.empty_like(aaT) for _ in range(3)]
        fn = _library().wkv4_backward_f64 if cdt == torch.float64 else _library().wkv4_backward_f32
        fn(
            *map(ptr, (w, u, k, v, aaT, bbT, snaps, *douts, dw_rows, du_rows, dk, dv, *ds0)),
            B,
            T,
            H * N,
            CHUNK,
            torch.get_num_threads(),
        )
        grads = (dw_rows.sum(0), du_rows.sum(0), dk, dv, *ds0)
        return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes, strict=True))


def wkv4_cpu(w, u, k, v, state):
    y, aa, bb, pp = _WKV4CPU.apply(w, u, k, v, *state)
    return y, (aa, bb, pp)
