"""The fused CPU kernels built for aarch64 and run under qemu-user, on an x86 machine.

The aarch64 build is the `generic` one (no ISA flags): csrc/simd.h then gives 16-byte
NEON vectors and blocks for 32 registers, code no x86 build compiles. `CrossBuild`
compiles every kernel library (KERNEL_MODULES) with the cross compiler and kernel_driver.cpp next
to this file; `use_cross_build` points every op's `cpu` backend at them, so the ops'
own wrappers, custom ops and autograd glue run unchanged and only the kernel calls
cross over: each call's buffers go to the driver under qemu, and the buffers it hands
back are copied into the tensors the wrapper allocated.

Needs Debian's `g++-aarch64-linux-gnu` and `qemu-user` (`.ci/run` installs both).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rwkvx_cli import native as _native
from rwkvx_cli.ops.channel_mix import cpu as channel_mix_cpu
from rwkvx_cli.ops.delta import cpu as delta_cpu
from rwkvx_cli.ops.rwkv7_out import cpu as rwkv7_out_cpu
from rwkvx_cli.ops.rwkv7_prep import cpu as rwkv7_prep_cpu
from rwkvx_cli.ops.rwkv8 import cpu as rwkv8_cpu
from rwkvx_cli.ops.shift_mix import cpu as shift_mix_cpu
from rwkvx_cli.ops.wkv4 import cpu as wkv4_cpu
from rwkvx_cli.ops.wkv7 import cpu as wkv7_cpu

CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # the cross toolchain's libc, libstdc++ and libgomp
DRIVER = Path(__file__).with_name("kernel_driver.cpp")
KERNEL_MODULES = (
    wkv7_cpu,
    wkv4_cpu,
    rwkv8_cpu,
    delta_cpu,
    rwkv7_prep_cpu,
    rwkv7_out_cpu,
    shift_mix_cpu,
    channel_mix_cpu,
)
NEON_BYTES = 16


def tools_missing() -> str | None:
    """None when the cross compiler, qemu and the sysroot are here, else what is missing."""
    missing = [tool for tool in (CXX, QEMU) if shutil.which(tool) is None]
    if not SYSROOT.is_dir():
        missing.append(str(SYSROOT))
    if missing:
        return f"no {', '.join(missing)} (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)"
    return None


class Buffer:
    """What `ptr` returns for a cross call: the tensor itself, so the call can ship its bytes."""

    def __init__(self, tensor: torch.Tensor):
        if not tensor.is_contiguous():
            raise ValueError("the kernels take contiguous tensors")
        self.tensor = tensor


@dataclass
class CrossBuild:
    """The driver and the kernel libraries, compiled for aarch64 into `directory`."""

    directory: Path
    calls: list[tuple[str, int]] = field(default_factory=list)  # (entry point, vector bytes) of every call

    def __post_init__(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        self.driver = self.directory / "kernel_driver"
        subprocess.run([CXX, "-O2", "-std=c++17", str(DRIVER), "-o", str(self.driver), "-ldl"], check=True)
        self.libraries = {}
        for module in KERNEL_MODULES:
            target = self.directory / f"{module.KERNEL.source.stem}.so"
            _native.compile_library(module.KERNEL.source, "generic", target, compiler=CXX)
            self.libraries[module] = target

    def call(self, library: Path, symbol: str, args: tuple) -> int:
        """One kernel call under qemu: the buffers' contents before it go over, after it come back."""
        request = self.directory / "request.bin"
        reply = self.directory / "reply.bin"
        # a list is an array of pointers (ptr_array), a None a null pointer, alone or in a list
        flat = [e for a in args for e in (a if isinstance(a, list) else [a])]
        buffers = [a for a in flat if isinstance(a, Buffer)]

        def pointer(a) -> bytes:
            if a is None:
                return b"Z"
            data = a.tensor.detach().numpy().tobytes()
            return b"P" + struct.pack("<Q", len(data)) + data

        with request.open("wb") as f:
            f.write(struct.pack("<Q", len(symbol)) + symbol.encode())
            for a in args:
                if isinstance(a, Buffer) or a is None:
                    f.write(pointer(a))
                elif isinstance(a, list):
                    f.write(b"A" + struct.pack("<Q", len(a)) + b"".join(pointer(e) for e in a))
                elif isinstance(a, float):
                    f.write(b"D" + struct.pack("<d", a))
                elif isinstance(a, int):
                    f.write(b"I" + struct.pack("<q", a))
                else:
                    raise TypeError(f"{symbol}: cannot pass {type(a).__name__}")
        proc = subprocess.run(
            [QEMU, "-L", str(SYSROOT), str(self.driver), str(library), str(request), str(reply)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{symbol} under qemu: exit {proc.returncode}: {proc.stderr.strip()}")
        data = reply.read_bytes()
        rc, width = struct.unpack_from("<qq", data)
        offset = 16
        with torch.no_grad():
            for b in buffers:
                n = b.tensor.numel() * b.tensor.element_size()
                got = torch.frombuffer(bytearray(data[offset : offset + n]), dtype=b.tensor.dtype)
                b.tensor.copy_(got.view(b.tensor.shape))
                offset += n
        if offset != len(data):
            raise RuntimeError(f"{symbol} under qemu: the reply has {len(data) - offset} bytes too many")
        self.calls.append((symbol, width))
        return rc


def use_cross_build(monkeypatch, build: CrossBuild) -> None:
    """Every op's `cpu` kernel calls go to `build` for the rest of the test."""
    for module in KERNEL_MODULES:
        library = build.libraries[module]

        def entry(name, x, library=library, op=module.KERNEL.op):
            suffix = "f64" if x.dtype == torch.float64 else "f32"
            return lambda *args: build.call(library, f"{op}_{name}_{suffix}", args)

        monkeypatch.setattr(module, "ptr", Buffer)
        if hasattr(module, "ptr_array"):
            monkeypatch.setattr(module, "ptr_array", lambda ts: [None if t is None else Buffer(t) for t in ts])
        if hasattr(module, "optional_ptr"):
            monkeypatch.setattr(module, "optional_ptr", lambda t: None if t is None else Buffer(t))
        monkeypatch.setattr(module.KERNEL, "entry", entry)
