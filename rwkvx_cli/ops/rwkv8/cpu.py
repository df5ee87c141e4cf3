"""rwkv8 `cpu` backend: the fused C++ kernel of csrc/rwkv8_cpu.cpp behind a
torch.autograd.Function. fp32 state and math (fp64 for fp64 inputs), parallel
over batch x heads with OpenMP, SIMD over E (forward) and L (backward, on the
transposed state), a state snapshot every CHUNK steps for the backward."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from rwkvx_cli.ops._native import load_library, native_unavailable, ptr

CHUNK = 16
SOURCE = Path(__file__).parent / "csrc" / "rwkv8_cpu.cpp"


def _library() -> ctypes.CDLL:
    return load_library(SOURCE)


def unavailable() -> str | None:
    """None when the kernel builds and loads here, else the reason."""
    return native_unavailable(_library)


class _RWKV8CPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, v, d, rho, norm):
        B, T, H, L = q.shape
        Hv, E = v.shape[2], v.shape[3]
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        ins = [x.detach().to(cdt).contiguous() for x in (q, v, d)]
        s0 = [s.detach().to(cdt).contiguous() for s in (rho, norm)]
        y = ins[0].new_empty(B, T, H, E)
        rho_out, norm_out = torch.empty_like(s0[0]), torch.empty_like(s0[1])
        n_chunks = (T + CHUNK - 1) // CHUNK
        snaps = y.new_empty(B, H, n_chunks, L, E)
        nsnaps = y.new_empty(B, H, n_chunks, L)
        fn = _library().rwkv8_forward_f64 if cdt == torch.float64 else _library().rwkv8_forward_f32
        fn(
            *map(ptr, (*ins, *s0, y, rho_out, norm_out, snaps, nsnaps)),
            B,
            T,
            H,
            Hv,
            L,
            E,
            CHUNK,
            torch.get_num_threads(),
        )
        ctx.save_for_backward(*ins, snaps, nsnaps)
        ctx.dtypes = (q.dtype, v.dtype, d.dtype, rho.dtype, norm.dtype)
        return y.to(q.dtype), rho_out, norm_out

    @staticmethod
    def backward(ctx, dy, drho, dnorm):
        q, v, d, snaps, nsnaps = ctx.saved_tensors
        B, T, H, L = q.shape
        Hv, E = v.shape[2], v.shape[3]
        cdt = q.dtype
        douts = [g.to(cdt).contiguous() for g in (dy, drho, dnorm)]
        dq = torch.empty_like(q)
        dv_heads = q.new_empty(B, T, H, E)
        dd_rows = q.new_empty(B, H, L)
        drho0, dnorm0 = torch.empty_like(douts[1]), torch.empty_like(douts[2])
        fn = _library().rwkv8_backward_f64 if cdt == torch.float64 else _library().rwkv8_backward_f32
        fn(
            *map(ptr, (q, v, d, snaps, nsnaps, *douts, dq, dv_heads, dd_rows, drho0, dnorm0)),
            *(B, T, H, Hv, L, E, CHUNK, torch.get_num_threads()),
        )
        dv = dv_heads.sum(2, keepdim=True) if Hv == 1 and H > 1 else dv_heads
        grads = (dq, dv, dd_rows.sum(0), drho0, dnorm0)
        return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes, strict=True))


def rwkv8_cpu(q, v, d, state):
    y, rho, norm = _RWKV8CPU.apply(q, v, d, *state)
    return y, (rho, norm)
