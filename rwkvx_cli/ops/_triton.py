"""Triton, when installed, and whether its kernels can run here: on CUDA, or on
CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, the test suite);
plus what every Triton backend's autograd wrapper does around its kernels, and how
their launches become torch ops (`triton_op`, `wrap_triton`;
docs/operators.md#the-triton-kernels-as-torch-ops).

Every Triton backend module starts with the same two lines, then its kernels:

    from rwkvx_cli.ops import _triton as tr
    from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton

the names its kernels and op definitions use bare (`unavailable` is the backend's, for its
spec), and the wrapper helpers as `tr.prepare`, `tr.CHUNK`, ..."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a test/CUDA dependency
    triton = tl = None

__all__ = [
    "CHUNK",
    "INTERPRETED",
    "cast_back",
    "check_offsets",
    "compute_dtype",
    "compute_empty",
    "prepare",
    "row_chunks",
    "state_blocks",
    "tl",
    "triton",
    "triton_op",
    "unavailable",
    "wrap_triton",
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


# About how many programs a kernel that sums over rows (a parameter's gradient over B·T tokens)
# is launched with: enough to fill a GPU several times over, few enough that the per-program
# partials (rows of C values, summed by torch) stay small beside the tensors themselves.
PARTIAL_PROGRAMS = 1024


def row_chunks(rows: int, tile: int, width: int) -> tuple[int, int]:
    """How such a kernel splits `rows` when `width` programs (column blocks, heads) share each run
    of them: (programs along the rows, rows per program, a multiple of `tile`)."""
    tiles = triton.cdiv(rows, tile)
    per = triton.cdiv(tiles, max(1, min(tiles, PARTIAL_PROGRAMS // width))) * tile
    return triton.cdiv(rows, per), per


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


# -- the kernel launches as torch ops -----------------------------------------------------------

if triton is not None:

    @triton.jit
    def _probe():
        pass

    # Whether @triton.jit made interpreted functions here (TRITON_INTERPRET=1 when the kernel
    # modules were imported): what the decorator did, not what the environment says now.
    INTERPRETED = type(_probe).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False

# torch.library.triton_op (torch >= 2.6) makes an op whose kernels torch.compile sees: Inductor
# traces the op's body and launches the Triton kernels itself. With compiled kernels (CUDA) every
# op is one. Under Triton's interpreter a triton_op still runs in eager mode (torch 2.13 hands the
# interpreted kernel back from wrap_triton; earlier releases may refuse it), but its fake
# implementation, the body run on fake tensors, hands them to the interpreter, which reads their
# data: opcheck, Dynamo and torch.compile fail ("Cannot access data pointer of Tensor"); and its
# functional decomposition would trace the body into a graph without the launches. There, and
# without triton_op or without triton, each op is an opaque torch.library.custom_op instead, like
# the C++ kernels': the same body, run as is on real tensors, and with every launch skipped as
# the fake implementation (the outputs' shapes come from the body's own allocations).
USE_TRITON_OP = (
    triton is not None
    and not INTERPRETED
    and hasattr(torch.library, "triton_op")
    and hasattr(torch.library, "wrap_triton")
)

_no_launch = threading.local()


@contextlib.contextmanager
def _shapes_only():
    """Run an op's body for its output shapes: every launch in it is skipped."""
    prev = getattr(_no_launch, "on", False)
    _no_launch.on = True
    try:
        yield
    finally:
        _no_launch.on = prev


class _Launcher:
    """`kernel[grid](*args)`, skipped inside `_shapes_only` (the opaque op's fake implementation:
    the body allocates the outputs on fake tensors, and the kernel must not see them)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if not getattr(_no_launch, "on", False):
                self.kernel[grid](*args, **kwargs)

        return launch


def wrap_triton(kernel):
    """The kernel as an op body launches it, `wrap_triton(kernel)[grid](*args)`:
    torch.library.wrap_triton(kernel) in a triton_op (a traceable launch under torch.compile, the
    plain launch in eager mode), else the plain launch, skipped in the fake implementation (see
    USE_TRITON_OP). Under the interpreter that is `kernel[grid](*args)` itself, the call the
    compile gate (compile_gate.py) records."""
    if USE_TRITON_OP:
        return torch.library.wrap_triton(kernel)
    return _Launcher(kernel)


def triton_op(name: str) -> Callable:
    """Decorator: the function, which allocates its outputs (fresh tensors, never its inputs)
    and launches its kernels through `wrap_triton`, as the torch op `name` ("rwkvx::...")
    mutating none of its arguments: a torch.library.triton_op where that works, else an opaque
    custom op whose fake implementation is the same body with no launch (see USE_TRITON_OP).
    Type annotations on every argument and the return give the op's schema."""

    def register(fn: Callable) -> Callable:
        if USE_TRITON_OP:
            return torch.library.triton_op(name, mutates_args=())(fn)
        op = torch.library.custom_op(name, mutates_args=())(fn)

        @op.register_fake
        def _fake(*args, **kwargs):
            with _shapes_only():
                return fn(*args, **kwargs)

        return op

    return register
