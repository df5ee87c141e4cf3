"""Where and how a command computes: the device and the numeric precision, resolved once per
command into a `Runtime` and handed down (docs/training.md#precision).

    fp32        every op in fp32 (matmuls at full fp32 precision)
    bf16-mixed  fp32 master weights and optimizer state; the forward runs under bf16 autocast
                (CUDA or CPU); the recurrent ops keep fp32 state and accumulation
    tf32        fp32 weights and activations, fp32 matmuls on the tensor cores' TF32 (CUDA only)
    auto        bf16-mixed on CUDA, fp32 on the CPU (what rwkvx did before the setting existed)

Training, validation and `rwkvx eval` run under the same mode. The names themselves are
checked by the config (`Config.validate`); what is checked here is what only the device can
say: whether CUDA is there, and whether the GPU can run the mode. Also here: the device's
measured matmul rate (the denominator of MFU and of `rwkvx bench`'s % of peak).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rwkvx_cli.config import ConfigError


@dataclass(frozen=True)
class Runtime:
    """A resolved device and precision mode ("fp32", "bf16-mixed" or "tf32"; never "auto")."""

    device: torch.device
    precision: str

    def autocast(self):
        """The context a forward pass (training, validation, evaluation) runs in."""
        return autocast(self.precision, self.device)

    def apply(self) -> None:
        """Make the process-wide settings this mode needs: the fp32 matmul precision, and on the CPU
        an allocator that keeps the memory it frees (`keep_freed_memory`)."""
        set_matmul_precision(self.precision)
        if self.device.type == "cpu":
            keep_freed_memory()


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the next allocation instead of handing it back to
    the kernel. A training step on the CPU allocates and frees the same tensors of 0.1-30 MB again and
    again; by default glibc maps each one fresh (above its mmap threshold) or trims the heap after
    it, so every step touches its activations' pages anew: 5,800 page faults and 15-20% of an eager
    tiny RWKV-7 step on the 2-core development VM (docs/benchmarks.md). Blocks up to 32 MB now come
    from the heap, which is never trimmed: the process keeps its peak footprint, as a caching
    allocator does. Returns whether the settings took (glibc only; elsewhere nothing changes)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def resolve_device(
    name: str, local_rank: int = 0, *, fallback: bool = False, setting: str = "train.device"
) -> torch.device:
    """`auto`, `cpu` or `cuda` as a device: CUDA (this rank's GPU) when asked for or, for `auto`,
    when there is one. `cuda` without a GPU is a one-line ConfigError naming `setting`, or with
    `fallback` (opening a checkpoint trained elsewhere) the CPU."""
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda and not fallback:
        raise ConfigError(f"{setting}=cuda: no CUDA device is available here")
    if cuda and name in ("cuda", "auto"):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # the precision check below asks the current device
        return device
    return torch.device("cpu")


def resolve_precision(name: str, device: torch.device, *, fallback: bool = False) -> str:
    """The mode `name` (a valid train.precision) runs as on `device` ("auto" resolved). A mode the
    device cannot run is a one-line ConfigError, or with `fallback` fp32."""
    cuda = device.type == "cuda"
    if name == "auto":
        return "bf16-mixed" if cuda and _bf16_supported() else "fp32"
    why = None
    if name == "bf16-mixed" and cuda and not _bf16_supported():
        why = f"bf16-mixed: {_gpu_name(device)} does not support bfloat16; use train.precision=fp32 (or tf32)"
    elif name == "tf32" and not cuda:
        why = "tf32 is a CUDA matmul mode; on the CPU use fp32 or bf16-mixed"
    elif name == "tf32" and torch.cuda.get_device_capability(device) < (8, 0):
        why = f"tf32: {_gpu_name(device)} has no TF32 tensor cores (compute capability 8.0+); use fp32"
    if why is None:
        return name
    if fallback:
        return "fp32"
    raise ConfigError(f"train.precision: {why}")


def resolve(device: str, precision: str, *, local_rank: int = 0, fallback: bool = False) -> Runtime:
    """The Runtime of train.device / train.precision settings. `fallback`: run what this machine
    can (the CPU for a missing GPU, fp32 for a mode the device lacks) instead of refusing: for a
    checkpoint evaluated elsewhere than it was trained."""
    dev = resolve_device(device, local_rank, fallback=fallback)
    return Runtime(dev, resolve_precision(precision, dev, fallback=fallback))


def _bf16_supported() -> bool:
    return torch.cuda.is_bf16_supported()  # of the current device (resolve_device sets it)


def _gpu_name(device: torch.device) -> str:
    try:
        return f"this GPU ({torch.cuda.get_device_name(device)})"
    except Exception:  # noqa: BLE001 - only for the message
        return "this GPU"


def set_matmul_precision(mode: str) -> None:
    """fp32 matmuls on TF32 under tf32, at full precision otherwise (a process-wide torch setting)."""
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")


def autocast(mode: str, device: torch.device):
    """The context a forward pass runs in under `mode` (a resolved one)."""
    if mode != "bf16-mixed":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


# -- timing on the device -------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, min_time: float = 0.5, max_reps: int = 50) -> list[float]:
    """One warm-up call, then repeats until `min_time` seconds (at least 3 repeats)."""
    fn()
    sync(device)
    times: list[float] = []
    while len(times) < 3 or (sum(times) < min_time and len(times) < max_reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def _operands(n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random n x n matrices from a generator of their own: a probe leaves torch's global RNG (which
    a checkpoint keeps) as it found it, whether or not an earlier probe in the process was cached."""
    gen = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(n, n, device=device, generator=gen).to(dtype) for _ in range(2))


def matmul_peak_gflops(device: torch.device, dtype: torch.dtype, n: int = 2048, min_time: float = 0.3) -> float:
    """This device's matmul rate: the best of repeated n³ products (at least `min_time` s)."""
    a, b = _operands(n, device, dtype)
    best = min(timed(lambda: a @ b, device, min_time=min_time))
    return 2 * n**3 / best / 1e9


_PEAKS: dict[tuple, float] = {}


def matmul_peak(device: torch.device, precision: str | None = None) -> float:
    """GFLOP/s of a short square-matmul probe on `device`, in the dtype training's matmuls run in (bf16
    under bf16-mixed, else fp32, on TF32 when torch's matmul precision says so; None: bf16 on CUDA,
    fp32 on the CPU): `matmul_peak_gflops`, shorter, and cached for the process."""
    if precision is None:
        precision = "bf16-mixed" if device.type == "cuda" else "fp32"
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    key = (device.type, device.index, dtype, torch.get_float32_matmul_precision())
    if key not in _PEAKS:
        n = 4096 if device.type == "cuda" else 1024
        try:
            a, b = _operands(n, device, dtype)
            best = min(timed(lambda: a @ b, device, min_time=0.1, max_reps=20))
            _PEAKS[key] = 2 * n**3 / best / 1e9
        except RuntimeError:  # a device the probe cannot run on: no MFU figure
            _PEAKS[key] = float("nan")
    return _PEAKS[key]


@contextlib.contextmanager
def profiler_quiet():
    """torch.profiler's C++ side (Kineto) writes `STAGE:` and `USDT:` lines straight to file descriptor
    2 as a profile starts and stops, whatever the log level; they are held back here, and anything
    else written to stderr meanwhile is passed on when the block ends."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode("utf-8", "replace").splitlines(keepends=True):
                if not line.startswith(("STAGE:", "USDT:")):
                    sys.stderr.write(line)
            sys.stderr.flush()
