"""Compile a C++ file into a shared library once per CPU ISA and precision, cache it, load it
with ctypes: the fused CPU kernels (ops/*/csrc) and the World tokenizer (data/csrc). Importing
this module does not import torch (tokenizer workers load it).

Plain C ABI, no torch headers. One library per precision (fp32 or fp64 entry points), so
that the first fp32 use, training's, compiles only the fp32 code: 1-6 s per kernel with g++
12 on the 2-core development machines, once per cache (docs/operators.md). The kernels include
csrc/simd.h, whose vector width and register blocking follow the instruction set
they are compiled for (see there). That is the best one this CPU runs (avx512,
avx2 or generic), or the one RWKVX_CPU_ISA names, so that every build can be
tested and timed on one machine; a forced ISA the CPU cannot run is refused
before anything is compiled or run. The library is cached under $RWKVX_CACHE
(default ~/.cache/rwkvx/native), keyed by the source, the shared headers, the
flags and the compiler, and written atomically, so concurrent processes never
load a half-written file. A machine without a compiler gets a NativeBuildError
naming the problem; callers fall back (an op's NativeKernel, ops/_cpu_op.py, makes it the
reason its `cpu` backend is unavailable).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


ENV = "RWKVX_CPU_ISA"
ISAS = ("avx512", "avx2", "generic")  # best first
PRECISIONS = {"f32": "-DRWKVX_FP32", "f64": "-DRWKVX_FP64"}  # which entry points a library exports
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
HEADER_DIR = Path(__file__).parent / "ops" / "csrc"  # simd.h: part of every build's cache key

# The x86-64-v3 and -v4 instruction sets, spelled as feature flags (GCC < 11 has no
# -march=x86-64-v3), and the /proc/cpuinfo flags a CPU needs to run each build.
_V3_FLAGS = ("-mavx2", "-mfma", "-mbmi", "-mbmi2", "-mf16c", "-mlzcnt", "-mmovbe", "-mpopcnt")
_V4_FLAGS = (*_V3_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq", "-mavx512vl")
ISA_FLAGS = {"avx512": _V4_FLAGS, "avx2": _V3_FLAGS, "generic": ()}
_V3_CPU = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe", "popcnt"}
_CPU_NEEDS = {"avx512": _V3_CPU | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}, "avx2": _V3_CPU}
SIMD_BYTES = {"avx512": 64, "avx2": 32, "generic": 16}  # what csrc/simd.h picks for each build


class NativeBuildError(RuntimeError):
    pass


@functools.cache
def supported_isas() -> tuple[str, ...]:
    """The builds this CPU can run, best first ("generic" always)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("generic",)
    flags: set[str] | None = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    if flags is None:  # no /proc (macOS, Windows): torch's own dispatch knows the CPU
        import torch

        capability = torch.backends.cpu.get_cpu_capability().lower()
        best = "avx512" if capability.startswith("avx512") else "avx2" if capability == "avx2" else "generic"
        return ISAS[ISAS.index(best) :]
    return tuple(isa for isa in ISAS if _CPU_NEEDS.get(isa, set()) <= flags)


def cpu_isa() -> str:
    """The ISA the kernels are built for: $RWKVX_CPU_ISA, else the best this CPU runs.
    A value that is not an ISA, or one this CPU cannot run, is a NativeBuildError."""
    forced = os.environ.get(ENV, "").strip().lower()
    supported = supported_isas()
    if not forced:
        return supported[0]
    if forced not in ISAS:
        raise NativeBuildError(f"{ENV}={forced!r} is not one of {', '.join(ISAS)}")
    if forced not in supported:
        raise NativeBuildError(f"{ENV}={forced}: this CPU cannot run {forced} code; it runs {', '.join(supported)}")
    return forced


# By (source path, $RWKVX_CPU_ISA as set, precision): every kernel call looks its library up here, so
# the key is what is cheap to read (pathlib and the CPU's flags are not: microseconds a call).
_LOADED: dict[tuple[str, str, str | None], ctypes.CDLL | NativeBuildError] = {}


def load_library(source: Path, precision: str | None = "f32") -> ctypes.CDLL:
    """The library of `source`'s `precision` ("f32" or "f64") entry points, or of a source without
    precisions (None), compiled for cpu_isa(); a failure is remembered, so it costs one attempt per
    process."""
    key = (os.fspath(source), os.environ.get(ENV, ""), precision)
    result = _LOADED.get(key)
    if result is None:
        isa = cpu_isa()  # an unusable $RWKVX_CPU_ISA raises here, every time
        try:
            result = _build_and_load(Path(source), isa, precision)
        except NativeBuildError as e:
            result = e
        _LOADED[key] = result
    if isinstance(result, NativeBuildError):
        raise result
    return result


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not compiler:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")
    return compiler


def _flags(isa: str, precision: str | None) -> tuple[str, ...]:
    return (*BASE_FLAGS, *ISA_FLAGS[isa], *([PRECISIONS[precision]] if precision else []))


def cache_root() -> Path:
    """rwkvx's cache directory: $RWKVX_CACHE, else ~/.cache/rwkvx (the libraries go in native/)."""
    return Path(os.environ.get("RWKVX_CACHE", Path.home() / ".cache" / "rwkvx"))


def build_path(source: Path, isa: str, compiler: str, precision: str | None = "f32") -> Path:
    """Where the library for (source, isa, precision) is cached: named by a hash of everything the build reads."""
    parts = [Path(source).read_bytes(), *(h.read_bytes() for h in sorted(HEADER_DIR.glob("*.h")))]
    flags = _flags(isa, precision)
    key = hashlib.sha256(b"\0".join([*parts, " ".join(flags).encode(), compiler.encode()]))
    cache_dir = cache_root() / "native"
    return cache_dir / f"{Path(source).stem}-{isa}-{precision or 'all'}-{key.hexdigest()[:16]}.so"


def compile_library(
    source: Path, isa: str, target: Path, compiler: str | None = None, precision: str | None = None
) -> None:
    """Compile `source` for `isa` into `target`, written atomically, with the `precision` entry
    points, or both when None; running it is the caller's business (the tests compile every
    ISA, even one this CPU cannot run)."""
    compiler = compiler or _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [compiler, *_flags(isa, precision), str(source), "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise NativeBuildError(f"cannot run the compiler {compiler}: {e.strerror}") from None
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["unknown error"])[0]
            raise NativeBuildError(f"compiling {Path(source).name} failed ({isa} build): {first}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_and_load(source: Path, isa: str, precision: str | None) -> ctypes.CDLL:
    compiler = _compiler()
    target = build_path(source, isa, compiler, precision)
    if not target.exists():
        compile_library(source, isa, target, compiler, precision)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise NativeBuildError(f"cannot load {target}: {e}") from None
    if hasattr(lib, "rwkvx_simd_bytes") and lib.rwkvx_simd_bytes() != SIMD_BYTES[isa]:
        raise NativeBuildError(f"{target.name} has {lib.rwkvx_simd_bytes()}-byte vectors, not {isa}'s")
    return lib


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    """A tensor's data pointer for a C call. The pointer holds no reference: the caller keeps the
    tensor alive, under a name, until the call returns. `ptr(x.contiguous())` frees the copy it
    makes before the kernel reads it (a strided or expanded x: a gradient of `.sum()`)."""
    return ctypes.c_void_p(t.data_ptr())


def optional_ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    """`ptr` of an optional argument: a null pointer for None."""
    return None if t is None else ptr(t)


def ptr_array(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    """A C array of the tensors' data pointers, None a null pointer (the caller keeps them alive)."""
    return (ctypes.c_void_p * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))
