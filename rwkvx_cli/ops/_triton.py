"""Triton, when installed, and whether its kernels can run here: on CUDA, or on
CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, the test suite);
plus what every Triton backend's autograd wrapper does around its kernels."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a test/CUDA dependency
    triton = tl = None

__all__ = [
    "CHUNK",
    "cast_back",
    "check_offsets",
    "compute_dtype",
    "compute_empty",
    "prepare",
    "state_blocks",
    "tl",
    "triton",
    "unavailable",
]

# Steps per chunk of time in every Triton kernel: the fused kernels' state snapshot
# interval (the backward recomputes a chunk from its snapshot), the chunked kernels'
# chunk length (a power of two >= 16, the smallest tl.dot tile).
CHUNK = 16


# How the kernels index memory: every buffer's base offset (batch, head, chunk, time) in
# int64 (at B=32, H=32, T=4096, N=128 a wkv7 snapshot buffer has 2^32 elements), and the
# offsets inside one program's tile (rows * N + cols, chunk-local scratch) in int32.
I64_LIMIT = 2**63
I32_LIMIT = 2**31


def max_offset(shape: Iterable[int]) -> int:
    """The largest element offset into a contiguous buffer of this shape."""
    n = 1
    for d in shape:
        n *= int(d)
    return max(n - 1, 0)


def check_offsets(kernel: str, buffers: dict[str, tuple[int, ...]], tile: int = 0) -> dict[str, int]:
    """Refuse (one-line ValueError) a launch a kernel cannot index: a buffer whose largest
    offset passes int64, or a per-program tile offset (`tile`, computed in int32) passing
    int32. Returns each buffer's largest offset (for the tests)."""
    offsets = {name: max_offset(shape) for name, shape in buffers.items()}
    for name, off in offsets.items():
        if off >= I64_LIMIT:
            raise ValueError(f"{kernel}: {name} {tuple(buffers[name])} has more elements than int64 offsets reach")
    if tile >= I32_LIMIT:
        raise ValueError(f"{kernel}: a program's tile offsets reach {tile}, past the int32 the kernel uses")
    return offsets


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


def prepare(inputs: Iterable[torch.Tensor], states: Iterable[torch.Tensor], dtype: torch.dtype):
    """What a kernel launch reads: the inputs detached and contiguous (the kernels load and
    convert them), the states detached in the compute dtype of `dtype`, and that dtype as
    (torch, triton). Serves the backward too, with dy and the final state's gradient."""
    cdt, DT = compute_dtype(dtype)
    ins = [x.detach().contiguous() for x in inputs]
    states = [s.detach().to(cdt).contiguous() for s in states]
    return ins, states, cdt, DT


def compute_empty(dtype: torch.dtype, device: torch.device) -> Callable[..., torch.Tensor]:
    """torch.empty in the compute dtype on the kernels' device: outputs, partials, scratch."""
    return functools.partial(torch.empty, dtype=dtype, device=device)


def cast_back(grads: Iterable[torch.Tensor], dtypes: Iterable[torch.dtype]) -> tuple[torch.Tensor, ...]:
    """Each gradient, computed in the compute dtype, in the dtype of the tensor it belongs to."""
    return tuple(g.to(dt) for g, dt in zip(grads, dtypes, strict=True))


def fused_state_offsets(kernel: str, B: int, T: int, H: int, N: int) -> dict[str, int]:
    """`check_offsets` for the fused recurrent kernels that keep an N x N state per (batch, head)
    in row blocks (wkv7, gdn/kda): their inputs, snapshots, column partials and scratch."""
    BK, BV, NV = state_blocks(N)
    NC = triton.cdiv(T, CHUNK)
    buffers = {
        "inputs": (B, T, H, N),
        "state snapshots": (B, H, NC, N, N),
        "column partials": (NV, B, T, H, N),
        "scratch": (B * H * NV, CHUNK, BV, BK),
    }
    return check_offsets(kernel, buffers, tile=max(N * N, CHUNK * BV * BK))

