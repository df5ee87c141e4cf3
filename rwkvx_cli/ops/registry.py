"""The op registry: what `gradcheck` and `bench` know about each operator.

An op is added with one package under `rwkvx_cli/ops/`: its `__init__.py` holds
the public function, its `spec.py` calls `register`, and `ops/__init__.py`
imports that spec. Commands iterate the registry and never special-case an op
by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Backend:
    """One implementation of an op.

    `fn` takes the op's inputs positionally, then the state (a tensor, or a
    tuple for ops with several state tensors), then the op's keyword options,
    and returns `(y, state_out)`. An op without state (attention, the fused
    block ops) takes no state argument and returns `y` alone. `y` is one tensor,
    or for an op with several outputs (`OpSpec.outputs`) a tuple of them. Inputs
    have already been validated by the op's public function.
    """

    name: str
    fn: Callable
    summary: str
    production: bool = True
    # A third-party implementation of the same math (not production): benched by
    # default as a comparison row wherever it can run, never picked by "auto".
    peer: bool = False
    devices: tuple[str, ...] = ("cpu", "cuda")
    # Devices where "auto" may pick it (default: all of `devices`); a backend can run
    # somewhere, for tests, without being the best choice there.
    auto_devices: tuple[str, ...] | None = None
    supports_fp64: bool = True
    # Takes state=None as the zero state without a tensor for it (the C++ kernels read a null
    # pointer as zeros and skip the initial state's gradient); the op's public function passes
    # None through to such a backend and allocates zeros for the others.
    optional_state: bool = False
    # Takes `starts=` (document starts, a bool [B, T] or None) itself. A backend that does not
    # resets through its op's `reset_inputs` (OpSpec), or not at all where the op has none.
    resets: bool = False
    # Returns None when usable here, else a one-line reason (missing compiler...).
    unavailable: Callable[[], str | None] = lambda: None


@dataclass(frozen=True)
class Case:
    """A fixed gradient-check case: sizes plus op-specific sampling options."""

    name: str
    dims: dict[str, int]
    nonzero_state: bool = False
    options: dict[str, object] = field(default_factory=dict)
    # Optional inputs this case leaves out: the op gets None for them, and no gradient of
    # theirs is checked (rwkv7_prep in the first layer, which has no value residual).
    absent: tuple[str, ...] = ()
    # Document starts (docs/operators.md#document-starts): for batch row i, the times in
    # starts[i % len(starts)] begin a document; () for none (the op gets starts=None).
    starts: tuple[tuple[int, ...], ...] = ()

    def starts_mask(self, device=None) -> torch.Tensor | None:
        """The case's document starts as the ops take them, a bool [B, T] (None without any)."""
        if not self.starts:
            return None
        B, T = self.dims["B"], self.dims["T"]
        mask = torch.zeros(B, T, dtype=torch.bool)
        for i in range(B):
            mask[i, list(self.starts[i % len(self.starts)])] = True
        return mask.to(device)

    def scaled(self, size: int) -> Case:
        """The same case with the time dimension multiplied by `size`."""
        return replace(self, dims={**self.dims, "T": self.dims["T"] * size})


@dataclass(frozen=True)
class OpSpec:
    name: str
    summary: str
    # Public function: fn(*inputs, state=None, backend="auto") -> (y, state_out).
    fn: Callable
    inputs: tuple[str, ...]
    states: tuple[str, ...]
    # sample(case, generator) -> inputs and states by name, in float64.
    sample: Callable[[Case, torch.Generator], Tensors]
    cases: tuple[Case, ...]
    fd_case: Case
    backends: dict[str, Backend]
    reference: str = "reference"
    # "sequence": a recurrence or attention, mixing over time; "block": a fused block op, the
    # elementwise work around the matmuls (docs/operators.md#fused-block-ops).
    family: str = "sequence"
    # The op's outputs, in the order it returns them: one (`y`, a tensor), several (a tuple of that
    # many), or None: a tuple of any length (shift_mix, one per lerp), named y0, y1, ...
    outputs: tuple[str, ...] | None = ("y",)
    # Scale of the gradient check's random cotangents, for y then each state.
    # With the sampler's input scales they keep every checked quantity where
    # the 1e-6 floor of the relative error sits above fp32 rounding.
    cotangent_scales: tuple[float, ...] = ()
    # Useful FLOPs of one call at dims ({"B", "T", "H", "N", ...}) for mode "fwd" or "fwdbwd"
    # (recomputation not counted), and the shapes `rwkvx bench` measures by default.
    flops: Callable[[dict[str, int], str], float] = lambda dims, mode: float("nan")
    bench_shapes: tuple[dict[str, int], ...] = ()
    # Options every benchmarked shape of this op carries besides B, T, H, N
    # (attention chunk size, top-k), for the default shapes and `--shape` alike.
    bench_options: dict[str, int] = field(default_factory=dict)
    # Keyword options a case passes to the backends (e.g. chunk size, top-k).
    kwargs: Callable[[Case], dict[str, object]] = lambda case: {}
    # Extra gradient columns derived from inputs and grads, e.g. dL/dw_eff.
    derived: dict[str, Callable[[Tensors, Tensors], torch.Tensor]] = field(default_factory=dict)
    # The sizes the GPU compile gate records this op's Triton kernels at, each a dict of dims
    # overriding the gradient-check case's, and of case options (default: H = 1 at each of its
    # head sizes N). The fused block ops, whose kernels tile the model width C = H·N, name
    # production widths.
    compile_dims: tuple[dict[str, int], ...] = ()
    # How a backend without its own reset (Backend.resets) sees document starts: its named inputs
    # rewritten so that its recurrence forgets the state at them, exactly (wkv7: decay 0 and a = 0
    # there). None: the op resets only in the backends that take `starts` themselves.
    reset_inputs: Callable[[Tensors, torch.Tensor], Tensors] | None = None

    def resets_with(self, bk: Backend) -> bool:
        """Whether backend `bk` of this op can take document starts."""
        return bk.resets or self.reset_inputs is not None

    def with_starts(self, bk: Backend, inputs: Tensors, starts: torch.Tensor | None) -> tuple[Tensors, dict]:
        """Backend `bk`'s named inputs and extra keyword arguments for document starts (None: none):
        `starts=` for a backend that takes them, the inputs rewritten by `reset_inputs` for the
        others; a ValueError where neither applies. The one routing of starts: the public
        functions and `call` both use it."""
        if starts is None:
            return inputs, {}
        if bk.resets:
            return inputs, {"starts": starts}
        if self.reset_inputs is None:
            raise ValueError(f"backend {bk.name!r} of {self.name} does not reset at document starts")
        return self.reset_inputs(inputs, starts), {}

    def call(
        self, bk: Backend, tensors: Tensors, case: Case
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Run backend `bk` on named tensors with the case's options: (outputs, states_out), each
        a tuple (one output `y` for most ops; `self.outputs` names them). Calls the backend
        itself, not the public function, so a spec may carry backends that are not registered
        (the tests' planted bugs). A case's absent inputs are passed as None; its document starts
        go to a backend that takes them, or through the op's `reset_inputs`."""
        named = {n: None if n in case.absent else tensors[n] for n in self.inputs}
        starts = case.starts_mask(next(iter(tensors.values())).device)
        named, extra = self.with_starts(bk, named, starts)
        kwargs = {**self.kwargs(case), **extra}
        inputs = list(named.values())
        if not self.states:
            return self._outputs(bk.fn(*inputs, **kwargs)), ()
        states = tuple(tensors[n] for n in self.states)
        y, state_out = bk.fn(*inputs, states if len(states) > 1 else states[0], **kwargs)
        return self._outputs(y), tuple(state_out) if isinstance(state_out, (tuple, list)) else (state_out,)

    def _outputs(self, y) -> tuple[torch.Tensor, ...]:
        if self.outputs is None:
            return tuple(y)
        outs = tuple(y) if len(self.outputs) > 1 else (y,)
        if len(outs) != len(self.outputs):
            raise ValueError(f"{self.name} returned {len(outs)} outputs, not {len(self.outputs)} ({self.outputs})")
        return outs

    def output_names(self, n: int) -> tuple[str, ...]:
        """The names of a call's `n` outputs (gradient-check columns)."""
        return self.outputs if self.outputs is not None else tuple(f"y{i}" for i in range(n))

    def checked(self, case: Case) -> list[str]:
        """The inputs and states whose gradients a case checks: all but its absent inputs."""
        return [n for n in (*self.inputs, *self.states) if n not in case.absent]

    def production_backends(self) -> list[Backend]:
        return [bk for bk in self.backends.values() if bk.production]

    def peer_backends(self) -> list[Backend]:
        return [bk for bk in self.backends.values() if bk.peer]


_OPS: dict[str, OpSpec] = {}
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _OPS:
        raise ValueError(f"op {spec.name!r} is already registered")
    if spec.reference not in spec.backends:
        raise ValueError(f"op {spec.name!r} has no {spec.reference!r} backend")
    _OPS[spec.name] = spec
    return spec


def op_names() -> list[str]:
    return sorted(_OPS)


def get_op(name: str) -> OpSpec:
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; valid ops: {', '.join(op_names())}") from None


def resolve_backend(spec: OpSpec, name: str, device: torch.device) -> Backend:
    """The backend called `name`, or for "auto" the first usable production one
    (backends are listed fastest first); skipping one that cannot run here
    (e.g. no compiler for a native kernel) warns once."""
    if name == "auto":
        skipped = []
        for bk in spec.production_backends():
            if device.type not in (bk.auto_devices or bk.devices):
                continue
            reason = bk.unavailable()
            if reason is None:
                for other, why in skipped:
                    _warn_once(f"{spec.name}: the {other!r} backend is unavailable ({why}); using {bk.name!r}")
                return bk
            skipped.append((bk.name, reason))
        return spec.backends[spec.reference]
    if name not in spec.backends:
        raise ValueError(f"unknown backend {name!r} for {spec.name}; valid: auto, {', '.join(spec.backends)}")
    bk = spec.backends[name]
    if device.type not in bk.devices:
        raise ValueError(f"backend {name!r} of {spec.name} does not run on {device.type}")
    reason = bk.unavailable()
    if reason is not None:
        raise ValueError(f"backend {name!r} of {spec.name} is unavailable: {reason}")
    return bk
