"""WKV7 `cpu` backend: the fused C++ kernel of csrc/wkv7_cpu.cpp behind a
torch.autograd.Function. fp32 (or fp64) state and math, parallel over batch x
heads with OpenMP; the forward saves a state snapshot every CHUNK steps and
sa_t = S_{t-1} a_t for the backward (memory B*H*(T/CHUNK)*N² + B*T*H*N)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from rwkvx_cli.ops._native import load_library, native_unavailable, ptr

CHUNK = 16
SOURCE = Path(__file__).parent / "csrc" / "wkv7_cpu.cpp"


def _library() -> ctypes.CDLL:
    return load_library(SOURCE)


def unavailable() -> str | None:
    """None when the kernel builds and loads here, else the reason."""
    return native_unavailable(_library)


class _WKV7CPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, w, k, v, a, b, state):
        B, T, H, N = r.shape
        cdt = torch.float64 if r.dtype == torch.float64 else torch.float32
        ins = [x.detach().to(cdt).contiguous() for x in (r, w, k, v, a, b)]
        ins[1] = torch.exp(ins[1])  # the kernel takes the effective decay
        s0 = state.detach().to(cdt).contiguous()
        y = torch.empty_like(ins[0])
        s_out = torch.empty_like(s0)
        snaps = ins[0].new_empty(B, H, (T + CHUNK - 1) // CHUNK, N, N)
        sas = torch.empty_like(ins[0])
        fn = _library().wkv7_forward_f64 if cdt == torch.float64 else _library().wkv7_forward_f32
        fn(*map(ptr, (*ins, s0, y, s_out, snaps, sas)), B, T, H, N, CHUNK, torch.get_num_threads())
        ctx.save_for_backward(*ins, snaps, sas)
        ctx.dtypes = (r.dtype, state.dtype)
        return y.to(r.dtype), s_out

    @staticmethod
    def backward(ctx, dy, ds_out):
        *ins, snaps, sas = ctx.saved_tensors
        B, T, H, N = ins[0].shape
        cdt = ins[0].dtype
        dy = dy.to(cdt).contiguous()
        ds_out = ds_out.to(cdt).contiguous()
        grads = [torch.empty_like(ins[0]) for _ in range(6)]
        ds0 = torch.empty_like(ds_out)
        fn = _library().wkv7_backward_f64 if cdt == torch.float64 else _library().wkv7_backward_f32
        fn(*map(ptr, (*ins, snaps, sas, dy, ds_out, *grads, ds0)), B, T, H, N, CHUNK, torch.get_num_threads())
        in_dtype, state_dtype = ctx.dtypes
        return (*(g.to(in_dtype) for g in grads), ds0.to(state_dtype))


def wkv7_cpu(r, w, k, v, a, b, state):
    return _WKV7CPU.apply(r, w, k, v, a, b, state)
