"""Compile every Triton kernel for real GPUs, without a GPU.

Two steps, each in its own process because Triton's interpreter and its compiler
cannot share one import of the kernel modules:

1. `record_launches()` (under TRITON_INTERPRET=1) runs the forward and backward
   of every Triton backend of every registered op on CPU tensors, at the
   production head sizes and dtypes, and records each distinct kernel launch:
   the kernel, the type of every argument, the compile-time constants, the
   launch options. Nothing is written per kernel by hand: a new kernel is
   covered as soon as a backend launches it. The kernels are recorded, not run,
   and torch's matmuls around them are not computed either (`execute=True` runs
   both, the kernels through the interpreter: minutes).
2. `compile_launch()` (without the interpreter) compiles one recorded launch
   ahead of time for a target such as sm_90 (`triton.compile` with
   `GPUTarget`), and reads the shared memory from its metadata and the
   registers and spill bytes from `ptxas -v` on its PTX (the `ptxas` shipped in
   the triton wheel).

`python -m rwkvx_cli.tools.compile_gate` prints the table (kernel, target, N,
dtype, shared KiB, registers, spill bytes); the test suite asserts the limits.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass

from rwkvx_cli.entry import ArgumentParser, run_main
from rwkvx_cli.errors import RwkvxError

# Shared memory a block may use (the opt-in maximum per block).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
TARGETS = (80, 90)
HEAD_SIZES = (64, 128)
DTYPES = ("fp32", "bf16")

# Spill bytes (stores + loads per thread, worst of sm_80/sm_90 and fp32/bf16) a kernel may have at
# head size N; 0 unless listed. The listed ones are the measurements of 2026-12-01 (triton 3.9) plus 10%: a
# regression fails the gate, and each entry is work to drive to 0 (the chunked wkv7 backward at
# N = 128 above all).
SPILL_BUDGETS: dict[tuple[str, str, int], int] = {
    ("delta", "_bwd_kernel", 128): 1040,
    ("wkv7", "_bwd_intra_kernel", 64): 870,
    ("wkv7", "_bwd_intra_kernel", 128): 880,
    ("wkv7", "_bwd_kernel", 64): 220,
    ("wkv7", "_bwd_kernel", 128): 940,
    ("wkv7", "_bwd_state_kernel", 64): 40,
    ("wkv7", "_bwd_state_kernel", 128): 270,
    ("wkv7", "_fwd_state_kernel", 128): 740,
    ("wkv7", "_intra_kernel", 64): 430,
    ("wkv7", "_intra_kernel", 128): 1570,
}


# Ops whose value width is not the head size, recorded once more with it this many times N (a
# case option E): rwkv8's shared value head has the model width as its value width. Its kernels
# tile the value width, so every E >= 32 compiles to the same kernel (recorded at the smallest N
# only: the interpreter's time grows with E).
WIDE_VALUE: dict[str, int] = {"rwkv8": 4}


def spill_budget(launch: Launch) -> int:
    n = int(re.search(r"N=(\d+)", launch.origin).group(1))
    return SPILL_BUDGETS.get((launch.module.split(".")[-2], launch.kernel, n), 0)


_TORCH_TO_TRITON = {
    "torch.float32": "fp32",
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float64": "fp64",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.uint8": "u8",
    "torch.bool": "i1",
}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler needs it. `constants` holds the constexpr values
    (a Triton dtype as {"dtype": name}); `origin` says which op, backend, N and dtype made it."""

    module: str
    kernel: str
    signature: dict[str, str]
    constants: dict[str, object]
    num_warps: int
    num_stages: int
    origin: str

    def key(self) -> str:
        return json.dumps([self.module, self.kernel, self.signature, self.constants, self.num_warps], sort_keys=True)


@dataclass
class Compiled:
    launch: Launch
    target: int
    ok: bool
    error: str = ""
    shared_bytes: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


# -- 1. recording (TRITON_INTERPRET=1) ----------------------------------------------------------


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    return "constexpr" in (ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann)))


def _arg_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[str(value.dtype)]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument of {type(value).__name__}")


def _constant(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = getattr(value, "name", None) or str(value)  # a triton dtype, e.g. tl.float32
    return {"dtype": name}


def _recorder(seen: dict[str, Launch], origin: list[str], execute: bool, fill: float | None):
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = list(inspect.signature(self.fn).parameters.values())
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip([p.name for p in params], args, strict=False))
        bound.update(kwargs)
        signature, constants = {}, {}
        for p in params:
            value = bound.get(p.name, p.default)
            if _is_constexpr(p) or value is None:
                signature[p.name] = "constexpr"
                constants[p.name] = _constant(value)
            else:
                signature[p.name] = _arg_type(value)
        launch = Launch(
            self.fn.__module__,
            self.fn.__name__,
            signature,
            constants,
            options.get("num_warps", 4),
            options.get("num_stages", 3),
            origin[0],
        )
        seen.setdefault(launch.key(), launch)
        if execute:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)
        if fill is not None:  # what the kernel would write, as one value everywhere
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.fill_(fill)
        return None

    return original, run


def _skipped_matmuls(fill: float | None):
    """A dispatch mode under which torch's matmuls return their result's shape and dtype, set to
    `fill` (0 without), instead of computing it: at the widest compile sizes channel_mix's bf16
    matmuls alone took most of the recording (~10 s each on an AVX2 CPU, which has no bf16 matmul
    unit). Like a skipped kernel's output, no launch may depend on their values (the two-fill test)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    # op -> where its two factors are among the arguments (addmm and baddbmm take the summand first)
    factors = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1, aten.baddbmm.default: 1}

    class SkipMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in factors:
                return func(*args, **(kwargs or {}))
            a, b = args[factors[func]], args[factors[func] + 1]
            return torch.full((*a.shape[:-1], b.shape[-1]), 0.0 if fill is None else fill, dtype=a.dtype)

    return SkipMatmuls()


def record_launches(
    head_sizes=HEAD_SIZES,
    dtypes=DTYPES,
    T: int = 17,
    backends: list[str] | None = None,
    execute: bool = False,
    fill: float | None = None,
) -> list[Launch]:
    """Every distinct launch of every Triton backend's forward and backward at these head sizes
    and input dtypes (B = H = 1 and a short T: the constants depend on N and the dtype only), or
    of `backends` only ("op/backend" names, see `triton_backends`). Must run with
    TRITON_INTERPRET=1 set before triton is imported.

    A launch is recorded from its arguments; the kernel itself runs only with `execute` (through
    the interpreter: minutes at the production sizes, against seconds). Without it the tensors a
    kernel would write hold whatever they held (with `fill`, every floating tensor of a launch is
    set to that value instead), and torch's matmuls return `fill` (0 without) uncomputed, which
    changes no launch as long as no backend reads a tensor's value to choose a launch's arguments:
    tests/tools/test_compile_gate.py records every backend with two fills, and both ways were
    compared once at every size (the same 120 launches). Each op's inputs are sampled once per
    size and reused (copied) for each dtype."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from rwkvx_cli.ops import get_op, op_names

    seen: dict[str, Launch] = {}
    origin = [""]
    original, patched = _recorder(seen, origin, execute, fill)
    samples: dict[str, dict] = {}  # one op's inputs at one size, for each dtype
    InterpretedFunction.run = patched
    try:
        for name in op_names():
            spec = get_op(name)
            for bk in spec.backends.values():
                if not _recorded(bk) or (backends is not None and f"{name}/{bk.name}" not in backends):
                    continue
                if bk.unavailable() is not None:
                    continue
                for dims in _compile_dims(spec, head_sizes):
                    N = dims["N"]
                    wide = name in WIDE_VALUE and N == min(head_sizes)  # one N is enough: the same kernel
                    widths = [{}] + ([{"E": WIDE_VALUE[name] * N, "Hv": 1}] if wide else [])
                    width = f" C={dims['H'] * N}" if dims["H"] > 1 else ""
                    # with document starts too where the op takes them: their kernels' flag variants;
                    # the dtype inmost, so each case is sampled once (`samples`)
                    resets = ((), spec.fd_case.starts) if spec.fd_case.starts else ((),)
                    for extra, starts, dt in ((e, s, d) for e in widths for s in resets for d in dtypes):
                        tag = (f" E={extra['E']}" if extra else "") + (" starts" if starts else "")
                        origin[0] = f"{name}/{bk.name} N={N}{width}{tag} {dt}"
                        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
                        with contextlib.nullcontext() if execute else _skipped_matmuls(fill):
                            _run_backend(spec, bk, dims, T, dtype, extra, starts, samples)
    finally:
        InterpretedFunction.run = original
    return list(seen.values())


def _recorded(bk) -> bool:
    """Whether the gate records (and so compiles) backend `bk`: every production Triton backend."""
    return "triton" in bk.name and bk.production


def triton_backends() -> list[str]:
    """The backends `record_launches` runs where Triton runs, as "op/backend", in its order."""
    from rwkvx_cli.ops import get_op, op_names

    return [f"{name}/{bk.name}" for name in op_names() for bk in get_op(name).backends.values() if _recorded(bk)]


def _compile_dims(spec, head_sizes) -> list[dict[str, int]]:
    """The sizes an op's kernels are recorded at: its own `compile_dims` at these head sizes (an
    entry may also set case options, e.g. shift_mix's M), or one head (H = 1) of each head size."""
    if spec.compile_dims:
        return [{"H": 1, **d} for d in spec.compile_dims if d["N"] in head_sizes]
    return [{"H": 1, "N": N} for N in head_sizes]


def _run_backend(
    spec, bk, sizes: dict[str, int], T: int, dtype, options: dict | None = None, starts=(), samples=None
) -> None:
    """One forward and backward of backend `bk` at these sizes; `samples` (a dict) keeps the case's
    sampled inputs for the next call at the same case (the next dtype)."""
    import torch

    from rwkvx_cli.ops.registry import Case

    base = spec.fd_case
    N = sizes["N"]
    dims = {**base.dims, "B": 1, "T": T, **{k: v for k, v in sizes.items() if k in "BTHN"}}
    options = {**{k: v for k, v in sizes.items() if k not in "BTHN"}, **(options or {})}
    case = Case(f"compile_gate_N{N}", dims, True, {**base.options, **options}, starts=starts)
    key = repr((spec.name, case))
    samples = {} if samples is None else samples
    if key not in samples:
        samples.clear()  # the previous case's: at most one case's tensors (GBs at the widest) held
        samples[key] = spec.sample(case, torch.Generator().manual_seed(0))
    inputs = {  # copies: a recorded launch's tensors are filled, the kept samples must not be
        k: v.to(dtype if k in spec.inputs else torch.float32, copy=True).requires_grad_(v.is_floating_point())
        for k, v in samples[key].items()
    }
    y, states = spec.call(bk, inputs, case)
    loss = sum(o.float().square().sum() for o in (*y, *states))
    loss.backward()


# -- 2. compiling (no interpreter) --------------------------------------------------------------


def _resolve_constant(value):
    import triton.language as tl

    if isinstance(value, dict) and "dtype" in value:
        return getattr(tl, {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}.get(
            value["dtype"], value["dtype"]))
    return value


def compile_launch(launch: Launch, target: int) -> Compiled:
    """Compile one launch for sm_<target>; never raises (a failure is the result). Registers and
    spills come from the `ptxas -v` log of Triton's own ptxas run (same flags as a real launch)."""
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cached kernel would skip ptxas and its log
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # today's default, stated (silences a warning)
    log = io.StringIO()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        kernel = getattr(importlib.import_module(launch.module), launch.kernel)
        if not isinstance(kernel, triton.runtime.JITFunction):
            raise RuntimeError(
                f"{launch.kernel} was imported under TRITON_INTERPRET=1 ({type(kernel).__name__}); "
                "compile in a process without it (compile_all does)"
            )
        constants = {k: _resolve_constant(v) for k, v in launch.constants.items()}
        src = ASTSource(fn=kernel, signature=launch.signature, constexprs=constants)
        options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", target, 32), options=options)
        result = Compiled(launch, target, True, shared_bytes=int(compiled.metadata.shared))
    except Exception as e:  # noqa: BLE001 - report any compiler failure as the gate's finding
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return Compiled(launch, target, False, error=f"{type(e).__name__}: {first[:300]}")
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None:
        return Compiled(launch, target, False, error="no ptxas -v log (registers unknown)")
    result.registers = int(regs.group(1))
    if spills:
        result.spill_stores, result.spill_loads = int(spills.group(1)), int(spills.group(2))
    return result


def _compile_job(args) -> dict:
    launch, target = args
    return asdict(compile_launch(Launch(**launch), target))


@contextlib.contextmanager
def _without_interpreter():
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def compile_all(launches: list[Launch], targets=TARGETS, workers: int | None = None) -> list[Compiled]:
    """Every launch for every target, in parallel processes."""
    jobs = [(asdict(launch), t) for launch in launches for t in targets]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    # Fresh (spawned) workers without TRITON_INTERPRET: a forked worker of a process that imported
    # the kernels under the interpreter (the test suite does) holds interpreter objects, not kernels.
    with _without_interpreter(), ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = list(pool.map(_compile_job, jobs))
    return [Compiled(**{**r, "launch": Launch(**r["launch"])}) for r in rows]


def record_in_subprocess(
    head_sizes=HEAD_SIZES, dtypes=DTYPES, workers: int | None = None, execute: bool = False, fill: float | None = None
) -> list[Launch]:
    """`record_launches` with the interpreter on, in child processes: one per backend, `workers`
    at a time (default: one per core); the result is the list one process would record, in its
    order (each launch recorded where it is first launched). With `execute` the interpreter runs
    every kernel too: 13 minutes of a 2-core Zen 3's core at the production sizes."""
    backends = triton_backends()
    workers = max(1, min(len(backends), workers or os.cpu_count() or 1))
    code = (
        "import json, sys; from dataclasses import asdict; "
        "from rwkvx_cli.tools.compile_gate import record_launches; "
        "print(json.dumps([asdict(x) for x in record_launches(**json.loads(sys.argv[1]))]))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    settings = {"head_sizes": list(head_sizes), "dtypes": list(dtypes), "execute": execute, "fill": fill}

    def record(backend: str) -> list[Launch]:
        argv = [sys.executable, "-c", code, json.dumps({**settings, "backends": [backend]})]  # NaN survives json
        proc = subprocess.run(argv, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise RwkvxError(f"recording the launches of {backend} (under TRITON_INTERPRET=1) failed: {last}")
        return [Launch(**x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]

    with ThreadPoolExecutor(workers) as pool:
        per_backend = list(pool.map(record, backends))
    seen: dict[str, Launch] = {}
    for launches in per_backend:
        for launch in launches:
            seen.setdefault(launch.key(), launch)
    return list(seen.values())


def main(argv: list[str] | None = None) -> int:
    ArgumentParser(prog="python -m rwkvx_cli.tools.compile_gate", description=__doc__.splitlines()[0]).parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    launches = record_in_subprocess()
    results = compile_all(launches)
    table = Table(title=f"Triton kernels compiled ahead of time ({len(launches)} launches x {len(TARGETS)} targets)")
    for col in ("kernel", "origin", "target", "warps", "shared KiB", "registers", "spill st/ld B", "result"):
        table.add_column(col)
    failed = 0
    for r in sorted(results, key=lambda r: (r.launch.module, r.launch.kernel, r.launch.origin, r.target)):
        over = r.ok and r.shared_bytes > SHARED_LIMIT[r.target]
        failed += (not r.ok) or over
        table.add_row(
            f"{r.launch.module.split('.')[-2]}.{r.launch.kernel}",
            r.launch.origin,
            f"sm_{r.target}",
            str(r.launch.num_warps),
            f"{r.shared_bytes / 1024:.1f}",
            str(r.registers),
            f"{r.spill_stores}/{r.spill_loads}",
            "ok" if r.ok and not over else ("over shared" if over else r.error),
        )
    Console(width=200).print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
