"""Compile a C++ kernel file into a shared library once, cache it, load it with ctypes.

Plain C ABI, no torch headers: a build takes about a second. The library is
cached under $RWKVX_CACHE (default ~/.cache/rwkvx/native), keyed by the
source, the flags, the compiler and the CPU, and written atomically, so
concurrent processes never load a half-written file. A machine without a
compiler gets a NativeBuildError naming the problem; callers fall back.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


class NativeBuildError(RuntimeError):
    pass


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


_LOADED: dict[Path, ctypes.CDLL | NativeBuildError] = {}


def load_library(source: Path) -> ctypes.CDLL:
    """The compiled library; a failure is remembered, so it costs one attempt per process."""
    source = Path(source)
    if source not in _LOADED:
        try:
            _LOADED[source] = _build_and_load(source)
        except NativeBuildError as e:
            _LOADED[source] = e
    result = _LOADED[source]
    if isinstance(result, NativeBuildError):
        raise result
    return result


def _build_and_load(source: Path) -> ctypes.CDLL:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not compiler:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")
    text = Path(source).read_bytes()
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), compiler.encode(), _cpu_model().encode()]))
    cache_dir = Path(os.environ.get("RWKVX_CACHE", Path.home() / ".cache" / "rwkvx")) / "native"
    target = cache_dir / f"{Path(source).stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so.tmp")
        os.close(fd)
        try:
            try:
                proc = subprocess.run([compiler, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True)
            except OSError as e:
                raise NativeBuildError(f"cannot run the compiler {compiler}: {e.strerror}") from None
            if proc.returncode != 0:
                first = (proc.stderr.strip().splitlines() or ["unknown error"])[0]
                raise NativeBuildError(f"compiling {Path(source).name} failed: {first}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise NativeBuildError(f"cannot load {target}: {e}") from None


def native_unavailable(library: Callable[[], ctypes.CDLL]) -> str | None:
    """None when the kernel that `library()` loads builds and loads here, else the reason."""
    try:
        library()
    except NativeBuildError as e:
        return str(e)
    return None


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    """A tensor's data pointer for a C call (the caller keeps the tensor alive)."""
    return ctypes.c_void_p(t.data_ptr())
