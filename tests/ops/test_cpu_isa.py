"""Every op's `cpu` backend in each build of the native kernels this CPU can run
(RWKVX_CPU_ISA, native.py): both gradient-check gates, and the model's head size,
whose compile-time vector paths the gates' small cases do not all reach. Plus the
refusal of a build the CPU cannot run, and the cache key's dependence on csrc/simd.h."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli import native as _native
from rwkvx_cli.cli import app
from rwkvx_cli.ops import get_op, op_names
from rwkvx_cli.ops.registry import Case
from rwkvx_cli.tools.gradcheck import gate_a, run_gradcheck

CPU_OPS = [op for op in op_names() if "cpu" in get_op(op).backends]  # wkv7, wkv4, rwkv8, gdn, kda, the block ops
SOURCES = sorted((_native.HEADER_DIR.parent).glob("*/csrc/*.cpp"))


def _cpu_flags() -> set[str]:
    """The CPU's feature flags, read here independently of _native's detection."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
RUNNABLE = [isa for isa in _native.ISAS if isa in _native.supported_isas()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("native-cache")


# One worker builds this module's libraries (`make test` runs xdist with --dist loadgroup): split
# over two, each would compile every ISA's build of every kernel for itself.
pytestmark = pytest.mark.xdist_group("native-builds")


@pytest.fixture
def build(monkeypatch, request):
    """Selects the build `request.param` (an ISA). The library cache is the suite's own: a library's
    name hashes its source, headers, ISA flags and compiler, so another ISA's build is another file,
    and the build this CPU runs by default is the one the rest of the suite already compiled."""
    monkeypatch.setenv(_native.ENV, request.param)
    return request.param


def test_the_ops_with_a_cpu_kernel():
    ops = {"wkv7", "wkv4", "rwkv8", "gdn", "kda", "rwkv7_prep", "rwkv7_out", "shift_mix", "channel_mix"}
    assert set(CPU_OPS) >= ops
    kernels = ("wkv7", "wkv4", "rwkv8", "delta", "rwkv7_prep", "rwkv7_out", "shift_mix", "channel_mix")
    assert {s.stem for s in SOURCES} >= {f"{k}_cpu" for k in kernels}


@pytest.mark.skipif(not IS_X86 or not _cpu_flags(), reason="x86 Linux: /proc/cpuinfo flags")
def test_detection_matches_the_cpu_flags():
    """Never a build the CPU lacks (that would be SIGILL), and AVX2 wherever x86-64-v3 is there."""
    flags = _cpu_flags()
    assert ("avx512" in RUNNABLE) <= ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags)
    assert ("avx2" in RUNNABLE) <= ({"avx2", "fma"} <= flags)
    if {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "popcnt"} <= flags:
        assert "avx2" in RUNNABLE
    assert RUNNABLE[-1] == "generic"


@pytest.mark.parametrize("build", RUNNABLE, indirect=True)
def test_each_build_has_its_vector_width(build):
    assert _native.cpu_isa() == build
    for source in SOURCES:
        assert _native.load_library(source).rwkvx_simd_bytes() == _native.SIMD_BYTES[build], source.name


def test_each_precision_is_a_library_of_its_own():
    """fp32 and fp64 entry points come from separate builds (training's fp32 compiles half the
    code), each exporting only its own, cached under different names."""
    for source in SOURCES:
        stem = source.stem.removesuffix("_cpu")
        f32, f64 = _native.load_library(source, "f32"), _native.load_library(source, "f64")
        assert hasattr(f32, f"{stem}_forward_f32") and not hasattr(f32, f"{stem}_forward_f64"), source.name
        assert hasattr(f64, f"{stem}_backward_f64") and not hasattr(f64, f"{stem}_backward_f32"), source.name
        isa = _native.cpu_isa()
        assert _native.build_path(source, isa, "g++", "f32") != _native.build_path(source, isa, "g++", "f64")


@pytest.mark.parametrize("op", CPU_OPS)
@pytest.mark.parametrize("build", RUNNABLE, indirect=True)
def test_both_gates_pass_in_every_build(build, op):
    spec = get_op(op)
    report = run_gradcheck(spec, [spec.backends["cpu"]])
    failing = [(r.gate, r.case, [c.name for c in r.columns if not c.passed]) for r in report.results if not r.passed]
    assert not failing, f"{op} cpu, {build} build: {failing}"


def _run(spec, bk, tensors, case, dtype, cot):
    leaves = {n: t.detach().to(dtype).requires_grad_(True) for n, t in tensors.items()}
    y, states = spec.call(bk, leaves, case)
    sum(((o.double() * c).sum() for o, c in zip((*y, *states), cot, strict=True))).backward()
    return [o.double() for o in (*y, *states)], {n: leaves[n].grad.double() for n in spec.checked(case)}


@pytest.mark.parametrize("op", CPU_OPS)
@pytest.mark.parametrize("build", RUNNABLE, indirect=True)
def test_model_head_size_matches_the_reference_in_every_build(build, op):
    _check_model_head_size(op)


def _check_model_head_size(op):
    """N = 64 over several snapshot chunks: fp64 to rounding, fp32 by the RMS ratio."""
    spec = get_op(op)
    dims = {"B": 1, "T": 70, "H": 2, "N": 64}
    case = Case("model_size", dims, nonzero_state=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: t.float().double() for n, t in spec.sample(case, gen).items()}
    ref, cpu = spec.backends["reference"], spec.backends["cpu"]
    with torch.no_grad():
        y0, s0 = spec.call(ref, tensors, case)
    cot = [torch.randn(o.shape, generator=gen, dtype=torch.float64).float().double() for o in (*y0, *s0)]
    outs_ref, g_ref = _run(spec, ref, tensors, case, torch.float64, cot)
    outs64, g64 = _run(spec, cpu, tensors, case, torch.float64, cot)
    outs32, g32 = _run(spec, cpu, tensors, case, torch.float32, cot)

    def rms_ratio(got, want):
        return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()

    for i, (a64, a32, want) in enumerate(zip(outs64, outs32, outs_ref, strict=True)):
        torch.testing.assert_close(a64, want, rtol=1e-8, atol=1e-10, msg=f"output {i}")
        assert rms_ratio(a32, want) < 1e-5, f"output {i}"
    for name, want in g_ref.items():
        torch.testing.assert_close(g64[name], want, rtol=1e-7, atol=1e-9, msg=f"d{name}")
        assert rms_ratio(g32[name], want) < 1e-5, f"d{name}"


@pytest.mark.slow  # every kernel source compiled for each ISA this CPU lacks: about a minute per ISA
@pytest.mark.skipif(not IS_X86, reason="the x86 builds")
@pytest.mark.parametrize("isa", [isa for isa in _native.ISAS if isa not in RUNNABLE])
def test_a_build_this_cpu_cannot_run_still_compiles(tmp_path, isa):
    """Compiled only, never loaded: the code for an ISA the CPU lacks stays buildable."""
    for source in SOURCES:
        target = tmp_path / f"{source.stem}.so"
        _native.compile_library(source, isa, target)
        assert target.stat().st_size > 0


@pytest.mark.slow  # every kernel compiled again at -O3 in the AVX-512 layout: ~90 s of compiles on 2-core Zen 3
@pytest.mark.skipif("avx2" not in RUNNABLE or "avx512" in RUNNABLE, reason="an AVX2 CPU without AVX-512")
@pytest.mark.parametrize("op", CPU_OPS)
def test_the_avx512_layout_is_right_on_an_avx2_cpu(monkeypatch, cache, op):
    """The AVX-512 build's 16-lane vectors and 32-register blocks, compiled with AVX2
    instructions (each vector is two ymm registers): the same code paths as the real
    build, checked where it cannot run."""
    monkeypatch.setitem(
        _native.ISA_FLAGS, "avx2", (*_native.ISA_FLAGS["avx2"], "-DRWKVX_SIMD_BYTES=64", "-DRWKVX_SIMD_REGS=32")
    )
    monkeypatch.setitem(_native.SIMD_BYTES, "avx2", 64)
    monkeypatch.setattr(_native, "_LOADED", {})
    monkeypatch.setenv("RWKVX_CACHE", str(cache / "avx512-layout"))
    monkeypatch.setenv(_native.ENV, "avx2")
    spec = get_op(op)
    for i, case in enumerate(spec.cases):  # gate A (gate B's finite differences add nothing layout-specific)
        assert gate_a(spec, spec.backends["cpu"], case, seed=i).passed, case.name
    _check_model_head_size(op)


def _missing_isas() -> list[str]:
    """Builds this CPU cannot run, by its own flags (an AVX-512 machine has none)."""
    if not IS_X86:
        return ["avx512", "avx2"]
    flags = _cpu_flags()
    if not flags:
        return []
    missing = []
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        missing.append("avx512")
    if not {"avx2", "fma"} <= flags:
        missing.append("avx2")
    return missing


@pytest.mark.parametrize("isa", [*_missing_isas(), "sse9"])
def test_a_build_the_cpu_cannot_run_is_refused_in_one_line(monkeypatch, tmp_path, isa):
    monkeypatch.setenv("RWKVX_CACHE", str(tmp_path))
    monkeypatch.setenv(_native.ENV, isa)
    with pytest.raises(_native.NativeBuildError, match=f"{_native.ENV}={isa!r}|{_native.ENV}={isa}:"):
        _native.cpu_isa()
    for op in CPU_OPS:
        reason = get_op(op).backends["cpu"].unavailable()
        assert reason and "\n" not in reason and isa in reason
    assert not (tmp_path / "native").exists()  # refused before anything was compiled


def test_the_refusal_reaches_the_cli_as_one_line(tmp_path):
    isa = (_missing_isas() or ["sse9"])[0]
    env = {**os.environ, "RWKVX_CACHE": str(tmp_path), _native.ENV: isa}
    proc = subprocess.run(
        [sys.executable, "-m", "rwkvx_cli", "gradcheck", "--op", "wkv7", "--backend", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode != 0 and proc.returncode > 0  # an error exit, not a signal (no SIGILL)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and _native.ENV in lines[0], proc.stderr


def test_the_cache_key_follows_the_shared_header_and_the_isa(monkeypatch, tmp_path):
    monkeypatch.setenv("RWKVX_CACHE", str(tmp_path / "cache"))
    headers = tmp_path / "csrc"
    headers.mkdir()
    (headers / "simd.h").write_text("// v1\n")
    monkeypatch.setattr(_native, "HEADER_DIR", headers)
    source = tmp_path / "k.cpp"
    source.write_text('extern "C" int one() { return 1; }\n')
    first = _native.build_path(source, "generic", "g++")
    assert _native.build_path(source, "generic", "g++") == first
    (headers / "simd.h").write_text("// v2\n")
    second = _native.build_path(source, "generic", "g++")
    assert second != first
    assert _native.build_path(source, "avx2", "g++") != second
    assert "generic" in second.name


def test_the_real_kernels_are_keyed_on_simd_h():
    assert (_native.HEADER_DIR / "simd.h").is_file()
    for source in SOURCES:
        assert '#include "../../csrc/simd.h"' in source.read_text(), source.name


@pytest.mark.parametrize("isa", [RUNNABLE[-1], *(_missing_isas()[:1])])
def test_bench_names_the_build_in_its_header_and_json(monkeypatch, cache, tmp_path, isa):
    monkeypatch.setenv("RWKVX_CACHE", str(cache))
    monkeypatch.setenv(_native.ENV, isa)
    path = tmp_path / "bench.json"
    args = ["bench", "--op", "wkv7", "--backend", "cpu", "--shape", "1,8,1,16", "--mode", "fwd", "--json", str(path)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    if isa in RUNNABLE:
        assert data["cpu_isa"] == isa and f"{isa} kernels" in result.output
        assert data["rows"][0]["error"] is None
    else:  # refused: no build, and the row says why
        assert data["cpu_isa"] is None and "no cpu kernels" in result.output
        assert isa in data["rows"][0]["error"]
