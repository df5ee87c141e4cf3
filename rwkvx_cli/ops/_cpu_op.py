"""The C++ kernels' torch custom ops, with an eager fast path.

Each CPU kernel entry point (`wkv7_cpu_fwd`, `shift_mix_cpu_bwd`, ...) is a torch custom op,
`torch.ops.rwkvx.<name>`, so that torch.compile traces the autograd Functions around them with no
graph break, fake tensors get shapes from its fake implementation, and the profiler sees each call
as one op. Going through torch's dispatcher costs about 12 µs a call in eager mode (the custom op's
Python trampolines), against 1.5 µs for an aten op: 48 calls a step of the tiny RWKV-7 model, where
the whole fused block's fixed cost is a few milliseconds. So in plain eager mode, a call runs the
op's body, the function the dispatcher would run on CPU tensors, directly; it goes through the
dispatcher whenever anything could see the difference: torch.compile tracing, the profiler (the op
count and the bench's time split read its events), a dispatch or torch-function mode (fake tensors,
FlopCounterMode), or a tensor subclass among the arguments.

`NativeKernel` is an op's C++ library, declared once in its cpu.py: where the source is, which
entry points need ctypes argument types, what else must build for the backend to run; it builds
on first use (rwkvx_cli/native.py) and says why it cannot.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from rwkvx_cli.native import NativeBuildError, load_library

OPS_DIR = Path(__file__).parent


def assume_constant_result(fn: Callable) -> Callable:
    """`torch.compiler.assume_constant_result(fn)` (torch.compile calls `fn` once, at trace time,
    and bakes in its result) without what that costs at import: torch's decorator imports
    torch._dynamo (1.6 s of a 3.4 s `import rwkvx_cli.ops`, in every process, the CLI's included)
    to set one attribute. tests/ops/test_custom_ops.py holds this to torch's decorator."""
    fn._dynamo_marked_constant = True
    return fn


def _plain(args) -> bool:
    """Every tensor among `args` (and in lists among them) is a plain torch.Tensor."""
    for a in args:
        if isinstance(a, (list, tuple)):
            if not _plain(a):
                return False
        elif isinstance(a, torch.Tensor) and type(a) is not torch.Tensor:
            return False
    return True


def direct_call_allowed(args) -> bool:
    """Whether calling an op's body directly is indistinguishable from dispatching it (see above)."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._autograd._profiler_enabled()
        or _get_current_dispatch_mode() is not None
        or torch._C._is_torch_function_mode_enabled()
    ) and _plain(args)


class CpuKernelOp:
    """A CPU kernel as the torch custom op `name` (`torch.ops.rwkvx.<short name>`), callable like
    it: the body directly in plain eager mode, the dispatched op otherwise. `register_fake` is the
    custom op's."""

    def __init__(self, name: str, fn: Callable):
        self.fn = fn
        self.custom_op = torch.library.custom_op(name, mutates_args=(), device_types="cpu")(fn)
        self.register_fake = self.custom_op.register_fake
        namespace, short = name.split("::")
        self.op = getattr(getattr(torch.ops, namespace), short)
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__

    def __call__(self, *args):
        if direct_call_allowed(args):
            return self.fn(*args)
        return self.op(*args)


def cpu_kernel_op(name: str) -> Callable[[Callable], CpuKernelOp]:
    """Decorator: the function (which allocates its outputs, mutates none of its arguments, and has
    type annotations that give the op's schema) as the CPU custom op `name` ("rwkvx::...")."""
    return lambda fn: CpuKernelOp(name, fn)


class NativeKernel:
    """The fused C++ kernel of `op`: ops/<op>/csrc/<op>_cpu.cpp, whose entry points are
    `<op>_forward_f32` / `_f64` and `<op>_backward_f32` / `_f64` (one library per precision,
    rwkvx_cli/native.py). `forward` / `backward`: ctypes argument types of that entry point, for
    one that takes a double (ctypes converts ints and pointers by itself, not floats). `needs`:
    another kernel this backend calls too (channel_mix calls shift_mix's)."""

    def __init__(
        self,
        op: str,
        *,
        forward: Sequence | None = None,
        backward: Sequence | None = None,
        needs: NativeKernel | None = None,
    ):
        self.op = op
        self.source = OPS_DIR / op / "csrc" / f"{op}_cpu.cpp"
        self.argtypes = {"forward": forward, "backward": backward}

        @assume_constant_result  # torch.compile asks once, at trace time
        def unavailable() -> str | None:
            """None when the kernel builds and loads here, else the reason."""
            if needs is not None and (why := needs.unavailable()) is not None:
                return why
            try:
                self.library()
            except NativeBuildError as e:
                return str(e)
            return None

        self.unavailable = unavailable

    def library(self, precision: str = "f32") -> ctypes.CDLL:
        """The library of the `precision` ("f32" or "f64") entry points, built on first use; a
        NativeBuildError where it cannot be."""
        return load_library(self.source, precision)

    def entry(self, name: str, x: torch.Tensor):
        """The entry point `name` ("forward" or "backward") for `x`'s dtype: fp32 or fp64, the
        kernels take nothing else."""
        if x.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the {self.op} cpu kernel takes float32 or float64 tensors, got {x.dtype}")
        precision = "f64" if x.dtype == torch.float64 else "f32"
        fn = getattr(self.library(precision), f"{self.op}_{name}_{precision}")
        argtypes = self.argtypes[name]
        if argtypes is not None and fn.argtypes is None:  # ctypes keeps one function object per library
            fn.argtypes = argtypes
        return fn

    def forward(self, x: torch.Tensor):
        return self.entry("forward", x)

    def backward(self, x: torch.Tensor):
        return self.entry("backward", x)


def threads(tasks: int) -> int:
    """torch's thread count, but no more threads than a kernel has tasks (rows, batch x heads)."""
    return max(1, min(torch.get_num_threads(), tasks))
