"""Triton, when installed, and whether its kernels can run here: on CUDA, or on
CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, the test suite)."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a test/CUDA dependency
    triton = tl = None

__all__ = ["compute_dtype", "state_blocks", "tl", "triton", "unavailable"]


def unavailable() -> str | None:
    if triton is None:
        return "triton is not installed"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU tensors)"
    return None


def compute_dtype(dtype: torch.dtype):
    """(torch, triton) dtypes of the state and accumulation: fp32, or fp64 throughout for
    fp64 inputs (the gradient checks)."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


def state_blocks(N: int) -> tuple[int, int, int]:
    """How a fused kernel splits an N x N state: the full side padded to a power of two
    (>= N), the rows (or columns) one program keeps in registers (<= 32), and the number
    of such blocks."""
    full = triton.next_power_of_2(N)
    part = min(full, 32)
    return full, part, triton.cdiv(N, part)
