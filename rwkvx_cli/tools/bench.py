"""Benchmarks of registered ops, and of a model's training step.

Every number is measured in the same run as its baseline: times are the median
of repeats after a warm-up, FLOP rates use each op's stated useful-FLOP count
(`OpSpec.flops`), and "% of peak" divides by this device's fp32 (or bf16) matmul
throughput measured here and now.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from rwkvx_cli.errors import UsageError
from rwkvx_cli.native import NativeBuildError, cpu_isa
from rwkvx_cli.ops import get_op, op_names
from rwkvx_cli.ops.registry import Backend, Case, OpSpec
from rwkvx_cli.runs.memory import check_op_shape
from rwkvx_cli.runs.runtime import keep_freed_memory, matmul_peak_gflops, timed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


@dataclass
class BenchRow:
    op: str
    backend: str
    dims: dict[str, int]
    dtype: str
    mode: str
    median_ms: float
    spread_pct: float  # (p90 - p10) / median
    repeats: int
    tokens_per_s: float
    gflops: float
    pct_of_peak: float  # gflops / matmul_gflops
    memory_mb: float  # CUDA: peak allocated; CPU: bytes saved for backward plus outputs
    speedup: float | None = None  # baseline time / this time, same dims/dtype/mode
    error: str | None = None
    # The matmul rate measured right before and right after this row (their mean): the
    # denominator of pct_of_peak, so that a machine whose speed drifts during the run (a
    # shared VM) divides each row by the rate it ran at.
    matmul_gflops: float | None = None


@dataclass
class BenchReport:
    device: str
    threads: int
    matmul_gflops: float
    rows: list[BenchRow] = field(default_factory=list)
    # The instruction set the fused CPU kernels are built for (native.py), on CPU
    # runs; None where no build can run (a forced RWKVX_CPU_ISA this CPU lacks).
    cpu_isa: str | None = None

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "rows"}, "rows": [asdict(r) for r in self.rows]}


def _saved_bytes(fn: Callable[[], tuple]) -> tuple[object, int]:
    """Run fn under saved-tensor hooks; bytes of distinct storages saved for backward."""
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _leaves(outputs) -> list[torch.Tensor]:
    """The tensors of an op's (y, state) output, however the state nests them."""
    return [x for x in torch.utils._pytree.tree_leaves(outputs) if isinstance(x, torch.Tensor)]


def bench_op(
    spec: OpSpec, bk: Backend, dims: dict[str, int], dtype: str, mode: str, device: torch.device, peak: float, seed=0
) -> BenchRow:
    shape = {d: dims[d] for d in "BTHN"}
    every = dims.get("starts_every", 0)  # a document start every that many tokens, from t = 0 (0: none)
    starts = (tuple(range(0, shape["T"], every)),) if every else ()
    options = {k: v for k, v in dims.items() if k not in shape and k != "starts_every"}
    case = Case("bench", shape, nonzero_state=True, options=options, starts=starts)
    tensors = {
        n: t.to(device=device, dtype=DTYPES[dtype])
        for n, t in spec.sample(case, torch.Generator().manual_seed(seed)).items()
    }
    for name in spec.states:  # states stay fp32 (fp64 for fp64 runs)
        tensors[name] = tensors[name].to(torch.float64 if dtype == "fp64" else torch.float32)
    grad = mode == "fwdbwd"
    leaves = {n: t.detach().requires_grad_(grad) for n, t in tensors.items()}

    def call():
        return spec.call(bk, leaves, case)

    # The backward gets dense cotangents, drawn once, as a layer's backward does in training
    # (a loss `.sum()` would hand it stride-0 ones, which the kernels first copy to dense).
    cotangents = None
    if grad:
        with torch.no_grad():
            y, s = call()
        gen = torch.Generator().manual_seed(seed + 1)
        cotangents = [torch.randn(x.shape, generator=gen).to(device=device, dtype=x.dtype) for x in _leaves((y, s))]

    def step():
        for t in leaves.values():
            t.grad = None
        if not grad:
            with torch.no_grad():
                return call()
        outs = _leaves(call())
        pairs = [(x, g) for x, g in zip(outs, cotangents, strict=True) if x.requires_grad]
        torch.autograd.backward(*zip(*pairs, strict=True))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = timed(step, device)
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        (y, s), saved = _saved_bytes(call) if grad else (call(), 0)
        memory = (saved + sum(x.nbytes for x in (*y, *s))) / 2**20
    med = statistics.median(times)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [med] * 9
    flops = spec.flops(dims, mode)
    return BenchRow(
        op=spec.name,
        backend=bk.name,
        dims=dict(dims),
        dtype=dtype,
        mode=mode,
        median_ms=med * 1e3,
        spread_pct=(q[-1] - q[0]) / med * 100,
        repeats=len(times),
        tokens_per_s=dims["B"] * dims["T"] / med,
        gflops=flops / med / 1e9,
        pct_of_peak=flops / med / 1e9 / peak * 100,
        memory_mb=memory,
    )


def run_bench(
    specs: list[OpSpec],
    backends: list[str] | None,
    shapes: list[dict[str, int]] | None,
    dtype: str,
    modes: list[str],
    baseline: str,
    device: torch.device,
    on_row: Callable[[str], None] | None = None,
    starts_every: int = 0,
) -> BenchReport:
    """Every op, backend, shape and mode; with `starts_every` each row twice, the second with a
    document start every that many tokens (docs/operators.md#document-starts), for the ops that
    take them (the others' second row says so)."""
    mm_dtype = torch.float32 if dtype in ("fp32", "fp64") else DTYPES[dtype]
    if device.type == "cpu":
        keep_freed_memory()  # as training does (runs/runtime.py): no page faults per call for any backend
    peak = matmul_peak_gflops(device, mm_dtype)
    report = BenchReport(str(device), torch.get_num_threads(), peak)
    rate_before = peak  # the matmul rate measured last: before the next row
    if device.type == "cpu":
        try:
            report.cpu_isa = cpu_isa()
        except NativeBuildError:
            pass  # each native row says why it did not run
    for spec in specs:
        peers = [bk.name for bk in spec.peer_backends() if device.type in bk.devices and bk.unavailable() is None]
        names = backends or [bk.name for bk in spec.production_backends()] + peers + [baseline]
        chosen = [spec.backends[n] for n in dict.fromkeys(names) if n in spec.backends]
        for shape in shapes or spec.bench_shapes:
            variants = [{**spec.bench_options, **shape}]
            if starts_every:
                variants.append({**variants[0], "starts_every": starts_every})
            for dims, mode in ((d, m) for d in variants for m in modes):
                rows = []
                for bk in chosen:
                    if on_row:
                        on_row(f"{spec.name} {bk.name} {dims} {mode}")
                    reason = bk.unavailable() if device.type in bk.devices else f"does not run on {device.type}"
                    if reason is None and dtype == "fp64" and not bk.supports_fp64:
                        reason = "no fp64 support"
                    if reason is None and dims.get("starts_every") and not spec.resets_with(bk):
                        reason = "takes no document starts"  # a per-token op (rwkv7_prep, rwkv7_out)
                    if reason is not None:
                        rows.append(_skipped(spec, bk, dims, dtype, mode, reason))
                        continue
                    row = bench_op(spec, bk, dims, dtype, mode, device, rate_before)
                    rate_after = matmul_peak_gflops(device, mm_dtype, min_time=0.1)
                    row.matmul_gflops = (rate_before + rate_after) / 2
                    row.pct_of_peak = row.gflops / row.matmul_gflops * 100
                    rows.append(row)
                    rate_before = rate_after
                base = next((r for r in rows if r.backend == baseline and r.error is None), None)
                for r in rows:
                    if base is not None and r.error is None:
                        r.speedup = base.median_ms / r.median_ms
                report.rows.extend(rows)
    return report


def _skipped(spec, bk, dims, dtype, mode, reason) -> BenchRow:
    nan = float("nan")
    return BenchRow(spec.name, bk.name, dict(dims), dtype, mode, nan, nan, 0, nan, nan, nan, nan, error=reason)


def parse_shape(text: str) -> dict[str, int]:
    """`--shape B,T,H,N` as dims."""
    try:
        B, T, H, N = (int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--shape {text!r} must be B,T,H,N (four integers)") from None
    if min(B, T, H, N) < 1:
        raise UsageError(f"--shape {text!r}: every dimension must be >= 1")
    return {"B": B, "T": T, "H": H, "N": N}


def plan_bench(
    ops: list[str] | None,
    backends: list[str] | None,
    shapes: list[str] | None,
    dtype: str,
    baseline: str,
    device: torch.device,
) -> tuple[list[OpSpec], list[dict[str, int]] | None]:
    """The op specs and shapes `rwkvx bench` runs (every op, each at its own shapes, by default),
    every name checked, and each shape checked to fit the device (at least three inputs and the
    output; gradients and workspaces come on top)."""
    try:
        specs = [get_op(name) for name in (ops or op_names())]
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    for spec in specs:
        for name in [*(backends or []), baseline]:
            if name not in spec.backends:
                flag = "--baseline: " if name == baseline else ""
                raise UsageError(f"{flag}unknown backend {name!r} for {spec.name}; valid: {', '.join(spec.backends)}")
    dims = [parse_shape(s) for s in shapes] if shapes else None
    for spec in specs:
        for shape in dims or spec.bench_shapes:
            label = ",".join(str(shape[k]) for k in "BTHN")
            check_op_shape(shape, DTYPES[dtype].itemsize, 4, f"bench {spec.name} --shape {label}", device)
    return specs, dims
