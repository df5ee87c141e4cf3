"""Peak memory of converting a checkpoint, measured: `run_benchmark(workdir)` (or
`python -m rwkvx_cli.tools.bench_convert WORKDIR [--dtype fp32|bf16]`).

It writes a randomly initialised checkpoint of the released 0.4B shape (24 x 1024, vocab 65536,
0.45B parameters; fp32 1.8 GB) as an rwkvx model.safetensors, tensor by tensor, then runs each
conversion in a fresh Python process and reads that process's peak resident set (VmHWM), its
resident set right after the imports, and the peaks of its anonymous and file-backed parts
(sampled every 20 ms from /proc/self/status). WORKDIR (made if missing) may hold anything: it writes
only into a new directory it makes there (bench-convert-XXXXXXXX) and deletes that one at the end (unless
--keep). Linux only (/proc).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from rwkvx_cli.entry import ArgumentParser, run_main
from rwkvx_cli.errors import RwkvxError, UsageError
from rwkvx_cli.formats import sizes as sz
from rwkvx_cli.formats.tensors import TensorSource
from rwkvx_cli.formats.write import write_shards

SHAPE_04B = dict(vocab_size=65536, n_embd=1024, head_size=64, kinds=["rwkv7"] * 24, lora=sz.LoraRanks(64, 64, 32, 128))


class RandomSource(TensorSource):
    """rwkvx-named random tensors made on request (so generating the checkpoint holds one at a time)."""

    def __init__(self, sizes: sz.Sizes, dtype: torch.dtype):
        self._shapes, self._dtype = sz.expected_shapes(sizes), dtype
        self._gen = torch.Generator().manual_seed(0)

    def names(self):
        return list(self._shapes)

    def shape(self, name):
        return self._shapes[name]

    def dtype(self, name):
        return self._dtype

    def get(self, name):
        return (0.02 * torch.randn(self._shapes[name], generator=self._gen)).to(self._dtype)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _child(kind: str, src: str, out: str) -> None:
    """One conversion, in its own process; prints its memory figures as JSON (the parent reads them)."""
    from rwkvx_cli.formats import export_hf, export_rwkv_x, open_hf, open_tensors

    base = _status()
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            s = _status()
            for k in peaks:
                peaks[k] = max(peaks[k], s[k])
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    if kind == "rwkvx->hf":
        export_hf(open_tensors(src), out)
    elif kind == "hf->rwkvx":
        source, _ = open_hf(src)
        Path(out).mkdir()
        write_shards(source, Path(out))
    elif kind == "rwkvx->rwkv-x":
        export_rwkv_x(open_tensors(src), out)
    else:
        raise ValueError(kind)
    seconds = time.perf_counter() - start
    done.set()
    t.join()
    end = _status()
    result = {"baseline_rss": base["VmRSS"], "peak_rss": end["VmHWM"], "seconds": round(seconds, 1), **peaks}
    sys.stdout.write(json.dumps(result) + "\n")


def run_benchmark(
    workdir: str | os.PathLike, dtype: str = "fp32", keep: bool = False, sizes: sz.Sizes | None = None
) -> dict:
    """Write the checkpoint (`sizes`, default the 0.4B shape) under `workdir`, time and measure the
    three conversions, delete it all (unless `keep`: then "kept" names where it is). Returns
    {"checkpoint_bytes", "parameters", "cpu", "runs": {kind: {"baseline_rss", "peak_rss", "RssAnon",
    "RssFile", "seconds", ratios}}}."""
    from rwkvx_cli.formats.hf import DTYPES

    if Path(workdir).exists() and not Path(workdir).is_dir():
        raise UsageError(f"WORKDIR {workdir} is not a directory")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=workdir))
    try:
        sizes = sizes or sz.Sizes("rwkvx", ffn_size=4 * 1024, **SHAPE_04B)
        ckpt = work / "rwkvx"
        ckpt.mkdir()
        src = RandomSource(sizes, DTYPES[dtype])
        write_shards(src, ckpt)
        nbytes = (ckpt / "model.safetensors").stat().st_size
        runs = {}
        for kind, source, target in (
            ("rwkvx->hf", ckpt / "model.safetensors", work / "hf"),
            ("hf->rwkvx", work / "hf", work / "back"),
            ("rwkvx->rwkv-x", ckpt / "model.safetensors", work / "rwkv-x.pth"),
        ):
            call = f"_child({kind!r}, {str(source)!r}, {str(target)!r})"
            code = f"from rwkvx_cli.tools.bench_convert import _child; {call}"
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if proc.returncode:
                last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
                raise RwkvxError(f"the {kind} conversion failed: {last}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["peak_over_checkpoint"] = round(r["peak_rss"] / nbytes, 3)
            r["peak_above_baseline_over_checkpoint"] = round((r["peak_rss"] - r["baseline_rss"]) / nbytes, 3)
            runs[kind] = r
        params = sum(torch.Size(s).numel() for s in src._shapes.values())
        kept = {"kept": str(work)} if keep else {}
        return {"checkpoint_bytes": nbytes, "parameters": params, "dtype": dtype, "cpu": _cpu(), "runs": runs, **kept}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python -m rwkvx_cli.tools.bench_convert", description=__doc__.splitlines()[0])
    p.add_argument("workdir", help="a directory; the benchmark writes only into a new one it makes there")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--keep", action="store_true", help="keep what it wrote")
    a = p.parse_args(argv)
    sys.stdout.write(json.dumps(run_benchmark(a.workdir, a.dtype, a.keep), indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
