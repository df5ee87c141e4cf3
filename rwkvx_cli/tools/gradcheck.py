"""The two gradient-check gates of docs/gradcheck.md, for any registered op.

Gate A (parity): the backend in fp32 against the fp64 `reference` backend
differentiated by autograd, on the op's fixed-seed cases; compares the output,
the final state and every gradient (inputs and initial state).

Gate B (finite differences): central differences of an fp64 reference loss,
step h = 1e-3 (1 + |x|), for every element of every input and of the initial
state, against the backend's hand-written gradient (computed in fp64 when the
backend supports it, else fp32).

Both use the loss L = Σ c ⊙ y + Σ c_s ⊙ state_out with fixed random c, and the
metric max |g - ref| / (|ref| + 1e-6) < 1e-3. Non-vacuity: a gradient whose
reference has max |g| <= 1e-4 fails, since it would pass whatever the backend did.

Gate A-bf16 (`bf16=True`): gate A with bf16 inputs (states and cotangents fp32), against the
fp64 oracle on the same bf16-rounded values, gated on the RMS ratio ‖got − ref‖/‖ref‖ <=
BF16_RMS_TOLERANCE per column: bf16 keeps 8 mantissa bits, so an elementwise relative metric
would only measure rounding (docs/gradcheck.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from rwkvx_cli.errors import UsageError
from rwkvx_cli.ops import get_op, op_names, resolve_backend
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, Tensors
from rwkvx_cli.runs.memory import check_op_shape

THRESHOLD = 1e-3
REL_FLOOR = 1e-6
VACUOUS_BELOW = 1e-4
FD_STEP = 1e-3
# Gate A-bf16's bound on ‖got − ref‖/‖ref‖: the kernels round their bf16 outputs and
# gradients (relative step 2^-8 = 3.9e-3) and accumulate in fp32 (tests/ops/test_bf16.py).
BF16_RMS_TOLERANCE = 2e-2


@dataclass
class Column:
    """One compared quantity (an output or a gradient) of one case."""

    name: str
    max_rel: float
    rms_ratio: float
    ref_max: float
    is_grad: bool
    rms_gate: float | None = None  # gate on rms_ratio <= this (bf16) instead of max_rel < THRESHOLD

    @property
    def vacuous(self) -> bool:
        return self.is_grad and not self.ref_max > VACUOUS_BELOW

    @property
    def passed(self) -> bool:
        ok = self.rms_ratio <= self.rms_gate if self.rms_gate is not None else self.max_rel < THRESHOLD
        return ok and not self.vacuous


@dataclass
class CaseResult:
    gate: str
    case: str
    dims: dict[str, int]
    backend: str
    dtype: str
    columns: list[Column]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.columns)


@dataclass
class Report:
    op: str
    seed: int
    size: int
    results: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "seed": self.seed,
            "size": self.size,
            "threshold": THRESHOLD,
            "vacuous_below": VACUOUS_BELOW,
            "passed": self.passed,
            "results": [
                {
                    **{k: v for k, v in asdict(r).items() if k != "columns"},
                    "passed": r.passed,
                    "columns": [{**asdict(c), "vacuous": c.vacuous, "passed": c.passed} for c in r.columns],
                }
                for r in self.results
            ],
        }


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, is_grad: bool, rms_gate: float | None = None) -> Column:
    got, ref = got.detach().double(), ref.detach().double()
    diff = (got - ref).abs()
    max_rel = (diff / (ref.abs() + REL_FLOOR)).max().item()
    ref_rms = ref.pow(2).mean().sqrt().item()
    diff_rms = diff.pow(2).mean().sqrt().item()
    rms_ratio = diff_rms / ref_rms if ref_rms > 0 else (0.0 if diff_rms == 0 else float("inf"))
    return Column(name, max_rel, rms_ratio, ref.abs().max().item(), is_grad, rms_gate)


def _loss(y, states_out, cot: list[torch.Tensor]) -> torch.Tensor:
    outs = (*y, *states_out)
    return sum((o.to(c.dtype) * c).sum() for o, c in zip(outs, cot, strict=True))


def _cotangents(spec: OpSpec, y, states_out, gen: torch.Generator) -> list[torch.Tensor]:
    """Fixed random c, uniform in ±scale/2 per output, exactly representable in fp32."""
    outs = (*y, *states_out)
    scales = spec.cotangent_scales or (1.0,) * len(outs)
    return [
        (scale * (torch.rand(o.shape, generator=gen, dtype=torch.float64) - 0.5)).float().double()
        for o, scale in zip(outs, scales, strict=True)
    ]


def _grads(
    spec: OpSpec, tensors: Tensors, backend: Backend, case: Case, dtype: torch.dtype, cot, device=None
) -> tuple:
    """The backend's output, final states and gradients, run on `device` (default: where the
    tensors are), returned on the CPU."""
    # bf16 runs keep the states and the loss in fp32, as a model does (the inputs are bf16)
    wide = torch.float32 if dtype == torch.bfloat16 else dtype
    leaves = {
        n: t.detach().to(device=device, dtype=wide if n in spec.states else dtype).requires_grad_(True)
        for n, t in tensors.items()
    }
    y, states_out = spec.call(backend, leaves, case)
    _loss(y, states_out, [c.to(device=y[0].device, dtype=wide) for c in cot]).backward()
    grads = {n: leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n]) for n in leaves}
    return (
        tuple(o.detach().cpu() for o in y),
        tuple(s.detach().cpu() for s in states_out),
        {n: g.cpu() for n, g in grads.items()},
    )


def _names(spec: OpSpec, tensors: Tensors, case: Case) -> list[str]:
    """The inputs and states whose gradients are checked: those the case passes (not absent) with
    elements (an op's state may be empty, as moba's key-value cache before any token)."""
    return [n for n in spec.checked(case) if tensors[n].numel()]


def _output_columns(spec: OpSpec, y, y_ref, rms_gate: float | None = None) -> list[Column]:
    names = spec.output_names(len(y))
    return [compare(name, a, b, False, rms_gate) for name, a, b in zip(names, y, y_ref, strict=True)]


def gate_a(spec: OpSpec, bk: Backend, case: Case, seed: int, device=None) -> CaseResult:
    start = time.perf_counter()
    ref = spec.backends[spec.reference]
    gen = torch.Generator().manual_seed(seed)
    # Round the sample to fp32 first, so both sides see identical inputs.
    tensors = {n: t.float().double() for n, t in spec.sample(case, gen).items()}
    with torch.no_grad():
        y0, s0 = spec.call(ref, tensors, case)
    cot = _cotangents(spec, y0, s0, gen)
    y_ref, s_ref, g_ref = _grads(spec, tensors, ref, case, torch.float64, cot)
    y, s, g = _grads(spec, tensors, bk, case, torch.float32, cot, device)
    cols = _output_columns(spec, y, y_ref)
    cols += [compare(f"{n}_out", a, b, is_grad=False) for n, a, b in zip(spec.states, s, s_ref, strict=True)]
    cols += [compare(f"d{n}", g[n], g_ref[n], is_grad=True) for n in _names(spec, tensors, case)]
    cols += [compare(name, fn(tensors, g), fn(tensors, g_ref), is_grad=True) for name, fn in spec.derived.items()]
    return CaseResult("A", case.name, dict(case.dims), bk.name, "float32", cols, time.perf_counter() - start)


def gate_a_bf16(spec: OpSpec, bk: Backend, case: Case, seed: int, device=None) -> CaseResult:
    """Gate A with bf16 inputs, on the RMS ratio (BF16_RMS_TOLERANCE)."""
    start = time.perf_counter()
    ref = spec.backends[spec.reference]
    gen = torch.Generator().manual_seed(seed)
    # Round the inputs to bf16 (states to fp32) first, so both sides see identical values.
    sample = spec.sample(case, gen)
    tensors = {n: (t.bfloat16() if n in spec.inputs else t.float()).double() for n, t in sample.items()}
    with torch.no_grad():
        y0, s0 = spec.call(ref, tensors, case)
    cot = _cotangents(spec, y0, s0, gen)
    y_ref, s_ref, g_ref = _grads(spec, tensors, ref, case, torch.float64, cot)
    y, s, g = _grads(spec, tensors, bk, case, torch.bfloat16, cot, device)
    tol = BF16_RMS_TOLERANCE
    cols = _output_columns(spec, y, y_ref, tol)
    cols += [compare(f"{n}_out", a, b, False, tol) for n, a, b in zip(spec.states, s, s_ref, strict=True)]
    cols += [compare(f"d{n}", g[n], g_ref[n], True, tol) for n in _names(spec, tensors, case)]
    cols += [compare(name, fn(tensors, g), fn(tensors, g_ref), True, tol) for name, fn in spec.derived.items()]
    return CaseResult("A-bf16", case.name, dict(case.dims), bk.name, "bfloat16", cols, time.perf_counter() - start)


def gate_b(spec: OpSpec, bk: Backend, case: Case, seed: int, device=None) -> CaseResult:
    start = time.perf_counter()
    tensors, cot, fd = _finite_differences(spec, case, seed)
    dtype = torch.float64 if bk.supports_fp64 else torch.float32
    _, _, g = _grads(spec, tensors, bk, case, dtype, cot, device)
    cols = [compare(f"d{name}", g[name], fd[name], is_grad=True) for name in fd]
    return CaseResult(
        "B", case.name, dict(case.dims), bk.name, str(dtype).removeprefix("torch."), cols, time.perf_counter() - start
    )


# Gate B's central differences are of the fp64 reference, so they are the same for every backend of an op: each
# (spec, case, seed) is differenced once in a process (the minutes of `gradcheck --op all` were mostly this loop, once
# per backend). Keyed by the spec object (frozen; the entry keeps it alive, so its id is never reused) and its
# reference's function (the one mutable part the loop reads), so another spec (a test's `replace`) starts afresh.
_FD_CACHE: dict[tuple, tuple[OpSpec, Tensors, list[torch.Tensor], dict[str, torch.Tensor]]] = {}


def _finite_differences(spec: OpSpec, case: Case, seed: int) -> tuple[Tensors, list[torch.Tensor], dict]:
    """The sampled fp64 inputs, the cotangents and d(loss)/d(input) by central differences of the reference
    (a step of FD_STEP (1 + |x|)), for each input and state that the case checks. Copies: callers may write."""
    ref = spec.backends[spec.reference]
    key = (id(spec), ref.fn, repr(case), seed, FD_STEP)
    if key not in _FD_CACHE:
        gen = torch.Generator().manual_seed(seed)
        tensors = {n: t.float().double() for n, t in spec.sample(case, gen).items()}
        with torch.no_grad():
            y0, s0 = spec.call(ref, tensors, case)
        cot = _cotangents(spec, y0, s0, gen)

        def loss() -> float:
            y, states_out = spec.call(ref, tensors, case)
            return _loss(y, states_out, cot).item()

        fds = {}
        with torch.no_grad():
            for name in _names(spec, tensors, case):
                x = tensors[name].view(-1)
                fd = torch.empty_like(x)
                for e in range(x.numel()):
                    orig = x[e].item()
                    h = FD_STEP * (1.0 + abs(orig))
                    x[e] = orig + h
                    lp = loss()
                    x[e] = orig - h
                    lm = loss()
                    x[e] = orig
                    fd[e] = (lp - lm) / (2.0 * h)
                fds[name] = fd.view_as(tensors[name])
        _FD_CACHE[key] = spec, tensors, cot, fds
    _, tensors, cot, fds = _FD_CACHE[key]
    return {n: t.clone() for n, t in tensors.items()}, [c.clone() for c in cot], {n: f.clone() for n, f in fds.items()}


def run_gradcheck(
    spec: OpSpec,
    backends: list[Backend],
    seed: int = 0,
    size: int = 1,
    on_case: Callable[[str], None] | None = None,
    device: torch.device | None = None,
    bf16: bool = False,
) -> Report:
    """Both gates for each backend, run on `device` (default CPU; the fp64 oracle and the finite
    differences always run on the CPU); with `bf16`, gate A-bf16 too. `on_case(label)` is
    called before each case."""
    report = Report(spec.name, seed, size)
    for bk in backends:
        for i, case in enumerate(spec.cases):
            if on_case:
                on_case(f"{bk.name}: gate A, {case.name}")
            report.results.append(gate_a(spec, bk, case.scaled(size), seed * 1000 + i, device))
            if bf16:
                report.results.append(gate_a_bf16(spec, bk, case.scaled(size), seed * 1000 + i, device))
        if on_case:
            on_case(f"{bk.name}: gate B, {spec.fd_case.name}")
        report.results.append(gate_b(spec, bk, spec.fd_case, seed * 1000 + len(spec.cases), device))
    return report


def plan_gradcheck(
    op: str, names: list[str] | None, size: int, on_skip: Callable[[str, str], None] | None = None
) -> list[tuple[OpSpec, list[Backend]]]:
    """What `rwkvx gradcheck --op OP|all [--backend NAME ...]` checks: each op with the named backends
    (with `all`, those it has: moba has no `cpu`), or its production backends that run on the CPU
    (`on_skip(backend, reason)` hears of the others). Every name and size is checked before any run."""
    try:
        specs = [get_op(name) for name in (op_names() if op == "all" else [op])]
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    if op == "all" and names:
        picked = {spec.name: [n for n in names if n == "auto" or n in spec.backends] for spec in specs}
        specs = [spec for spec in specs if picked[spec.name]]
        if not specs:
            raise UsageError(f"--backend {', '.join(names)}: no op has such a backend")
        chosen = [(spec, _backends(spec, picked[spec.name], on_skip)) for spec in specs]
    else:
        chosen = [(spec, _backends(spec, names, on_skip)) for spec in specs]
    for spec in specs:  # fp64: at least three inputs and the output of each case
        for case in spec.cases:
            check_op_shape(case.scaled(size).dims, 8, 4, f"gradcheck {spec.name} --size {size} ({case.name})", "cpu")
    return chosen


def _backends(spec: OpSpec, names: list[str] | None, on_skip) -> list[Backend]:
    cpu = torch.device("cpu")
    if names:
        try:
            return [resolve_backend(spec, name, cpu) for name in names]
        except ValueError as e:
            raise UsageError(str(e)) from None
    backends = []
    for bk in spec.production_backends():
        reason = bk.unavailable() if "cpu" in bk.devices else "does not run on cpu"
        if reason is None:
            backends.append(bk)
        elif on_skip:
            on_skip(bk.name, reason)
    return backends
