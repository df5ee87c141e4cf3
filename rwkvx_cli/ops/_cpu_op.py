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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


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
