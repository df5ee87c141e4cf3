"""Memory, time and bytes of a checkpoint save and load under FSDP2: full, sharded and async (issue 35):
`python -m rwkvx_cli.tools.bench_sharded WORKDIR [--ranks 2] [--layers 12 --embd 768 --vocab 65536]`.

An RWKV-7 model is built on the meta device, sharded with FSDP2 (each block, then the root, as
train/distributed.py's `wrap` does) over `--ranks` gloo processes on the CPU, and only then
materialised: each rank allocates just its own shard, filled with random values, and AdamW state
(exp_avg, exp_avg_sq, step) of the same shapes. Then, in each rank:

- full save: the whole state gathered onto rank 0 (`get_model_state_dict` and
  `get_optimizer_state_dict` with full_state_dict and cpu_offload: checkpoints/full.py's
  `full_state`), which writes it with `full.save_checkpoint`;
- sharded save: `checkpoints/sharded.save_sharded`, every rank its own rows;
- async save (train.async_checkpoint, sharded): what the trainer's `save_async` does, through the
  same functions: the state staged into CPU buffers (`checkpoints/background.Staging`,
  `sharded.stage_sharded`), then `sharded.write_sharded` on a `checkpoints/background.Writer` thread over
  its own gloo group. The stall is the staging; while the thread writes, the rank runs a stand-in
  for training (1024² fp32 matmuls), whose rate is compared with its rate before the save. The
  first staging allocates the buffers, later ones reuse them: `--saves 2` times both;
- full load: what a resume does today on every rank (`full.verify`, reading model.safetensors,
  `load_optimizer_state` and their finiteness checks, then `set_model_state_dict` /
  `set_optimizer_state_dict` of full tensors, as `full.load_full_state`);
- sharded load: `checkpoints/sharded.load_sharded`.

Each format runs in fresh processes (so that memory freed by one does not hide the other's peak).
Per rank: the resident set before the operation, the extra peak during it (VmHWM after resetting
it through /proc/self/clear_refs, minus the resident set before), the wall time (the stall: until
the rank may train on) and the bytes it wrote. Before each format the page cache is flushed.
`--formats` picks some (a 1.5B model's full save does not fit in 24 GiB),
`--no-load` leaves out the loads. Linux only (/proc). WORKDIR (made if missing) may hold anything:
the benchmark writes only into a new directory it makes there (bench-sharded-XXXXXXXX) and deletes that
one at the end, nothing else.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from rwkvx_cli.entry import ArgumentParser, at_least, run_main
from rwkvx_cli.errors import UsageError

MB = 1 << 20
FORMATS = ("full", "sharded", "async")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


class _Measure:
    """Resident set before, extra peak during, and wall time of the `with` block."""

    def __enter__(self):
        gc.collect()
        _reset_peak()
        self.before = _status("VmRSS")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.extra = max(0, _status("VmHWM") - self.before)

    def row(self) -> dict:
        return {"rss_before_mb": self.before / MB, "extra_peak_mb": self.extra / MB, "seconds": self.seconds}


def _build(args):
    """(model, optimizer): FSDP2-sharded, materialised shard by shard, with AdamW state."""
    from torch.distributed.fsdp import fully_shard

    from rwkvx_cli.config import ModelConfig
    from rwkvx_cli.models import LM, parameter_groups
    from rwkvx_cli.models.optimizer import adamw

    cfg = ModelConfig(n_layer=args.layers, n_embd=args.embd, head_size=64, vocab_size=args.vocab)
    with torch.device("meta"):
        model = LM(cfg)
    names = {id(p): n for n, p in model.named_parameters()}  # groups by name, before sharding (as the trainer)
    groups = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in parameter_groups(model, 1e-3, 0.1)]
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.copy_(torch.randn(local.shape, generator=gen) * 0.02)
    params = dict(model.named_parameters())
    groups = [{**g, "params": [params[n] for n in g["params"]]} for g in groups]
    optimizer = adamw(groups, 1e-3, (0.9, 0.99), 1e-8, sharded=True)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:  # layer 0's frozen value-residual weights get no state, as in training
                continue
            moments = []
            for _ in range(2):
                m = p.detach().clone()
                m.to_local().copy_(torch.rand(m.to_local().shape, generator=gen))
                moments.append(m)
            optimizer.state[p] = {"step": torch.tensor(3.0), "exp_avg": moments[0], "exp_avg_sq": moments[1]}
    return model, optimizer


def _load_full(ckpt: Path, model, optimizer) -> None:
    """What a resume does on every rank today (manager.load_latest, full.load_full_state)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from rwkvx_cli.checkpoints import full, store
    from rwkvx_cli.checkpoints.fit import check_finite

    meta = full.verify(ckpt)
    weights = store.read_safetensors(ckpt / "model.safetensors")  # full.load_weights
    check_finite(weights, str(ckpt))
    optim = full.load_optimizer_state(ckpt, meta)
    for st in optim["state"].values():  # manager.check_optimizer_state's costly part
        for t in st.values():
            if not torch.isfinite(t).all():
                raise ValueError("non-finite optimizer state")
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    names = [n for n, _ in _named_in_order(model, optimizer)]
    osd = {
        "state": {names[int(i)]: st for i, st in optim["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in optim["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True, strict=False))


def _named_in_order(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for g in optimizer.param_groups for p in g["params"]]


def _files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir())} if path.is_dir() else {}


def _matmul_rate(seconds: float, until=None) -> float:
    """GFLOP/s of back-to-back 1024² fp32 matmuls (a stand-in for training) for `seconds`, or while
    `until()` is false."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    t0, n = time.perf_counter(), 0
    while (until is None and time.perf_counter() - t0 < seconds) or (until is not None and not until()):
        a @ b
        n += 1
    return n * 2 * 1024**3 / max(time.perf_counter() - t0, 1e-9) / 1e9


def _save_async(root: Path, step: int, model, optimizer, meta, staging, group) -> dict:
    """The trainer's save_async for the sharded format (checkpoints/manager.py), timed."""
    from rwkvx_cli.checkpoints import ranks, sharded
    from rwkvx_cli.checkpoints.background import Writer

    before = _matmul_rate(2.0)
    with _Measure() as stall:
        staging.begin()
        fail = sharded.save_failure(root, step)
        staged = ranks.together(lambda: sharded.stage_sharded(model, optimizer, staging.copy), fail)
        staging.finish()
        writer = Writer(step, lambda: sharded.write_sharded(root, step, staged, meta, 1, None, group))
    with _Measure() as written:
        during = _matmul_rate(0.0, until=lambda: not writer.writing)
        writer.wait()
    return {
        **stall.row(),
        "write_seconds": stall.seconds + written.seconds,
        "write_extra_peak_mb": written.extra / MB,
        "staged_mb": staging.bytes / MB,
        "compute_rate_while_writing": during / before,
    }


def _worker(rank: int, world: int, port: int, fmt: str, args, root: str, out: str) -> None:
    """One rank of one format: its checkpoints under `root`, its rows appended to `out` (rank 0)."""
    import torch.distributed as dist

    from rwkvx_cli.checkpoints import full, sharded
    from rwkvx_cli.checkpoints.background import Staging, writer_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    model, optimizer = _build(args)
    root = Path(root)
    meta = {"config": {}}
    dist.barrier()
    saves = []
    if fmt == "async":
        staging, group = Staging(), writer_group()
        for step in range(1, args.saves + 1):
            saves.append(_save_async(root, step, model, optimizer, meta, staging, group))
            dist.barrier()
        ckpt = root / f"step_{args.saves:08d}"
    else:
        with _Measure() as save:
            if fmt == "full":
                weights, optim = full.full_state(model, optimizer)
                gathered = time.perf_counter() - save.t0
                if rank == 0:
                    full.save_checkpoint(root, 1, weights, optim, meta, keep_last=1)
                del weights, optim
            else:
                sharded.save_sharded(root, 1, model, optimizer, meta, keep_last=1)
                gathered = 0.0
            dist.barrier()  # the step loop goes on when every rank is done
        saves.append({**save.row(), "gather_seconds": gathered})
        ckpt = root / "step_00000001"
    files = _files(ckpt)
    mine = (
        sum(files.values())
        if fmt == "full" and rank == 0
        else files.get(sharded.shard_name(rank, world), 0)
        + (sum(v for k, v in files.items() if not k.startswith("shard-")) if rank == 0 and fmt != "full" else 0)
    )
    for row in saves:
        row["bytes_written_mb"] = mine / MB
    dist.barrier()
    load = None
    if fmt != "async" and not getattr(args, "no_load", False):  # an async checkpoint is a sharded one
        with _Measure() as measured:
            if fmt == "full":
                _load_full(ckpt, model, optimizer)
            else:
                sharded.load_sharded(ckpt, model, optimizer)
            dist.barrier()
        load = measured.row()
    row = {"format": fmt, "rank": rank, "saves": saves, "load": load}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _settle() -> None:
    """Start each format with the previous one's written pages flushed, so that its writeback does not
    slow the next one. (Not dropped: in a VM, pages handed back to the host are slow to fault in again,
    which times the host rather than the save.)"""
    os.sync()


def run_benchmark(args) -> list[dict]:
    """Every format of `args.formats` measured (the rows of all ranks), in a new directory made inside
    args.workdir and deleted at the end: nothing else there is read, replaced or deleted."""
    import torch.multiprocessing as mp

    work = Path(args.workdir)
    if work.exists() and not work.is_dir():
        raise UsageError(f"WORKDIR {work} is not a directory")
    work.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-sharded-", dir=work))
    out = scratch / "rows.jsonl"
    try:
        for i, fmt in enumerate(args.formats, 1):
            line = f"[{i}/{len(args.formats)}] {fmt}: {args.ranks} ranks saving and loading ..."
            print(line, file=sys.stderr, flush=True)  # progress: a format takes minutes at 0.4B
            _settle()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            root = scratch / fmt
            mp.spawn(_worker, args=(args.ranks, port, fmt, args, str(root), str(out)), nprocs=args.ranks, join=True)
            shutil.rmtree(root, ignore_errors=True)
        return [json.loads(line) for line in out.read_text().splitlines()]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _width(text: str) -> int:
    """--embd: a positive multiple of the head size, 64."""
    value = at_least(64)(text)
    if value % 64:
        raise argparse.ArgumentTypeError(f"must be a multiple of 64 (the head size), not {text}")
    return value


def main(argv=None) -> None:
    ap = ArgumentParser(prog="python -m rwkvx_cli.tools.bench_sharded", description=__doc__.splitlines()[0])
    ap.add_argument("workdir", help="a directory; the benchmark writes only into a new one it makes there")
    ap.add_argument("--ranks", type=at_least(1), default=2)
    ap.add_argument("--layers", type=at_least(1), default=12)
    ap.add_argument("--embd", type=_width, default=768)
    ap.add_argument("--vocab", type=at_least(1), default=65536)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument(
        "--saves", type=at_least(1), default=2, help="async saves in a row (the first allocates the buffers)"
    )
    ap.add_argument("--no-load", action="store_true", help="time the saves only (a load holds a second share)")
    args = ap.parse_args(argv)
    rows = run_benchmark(args)
    print(json.dumps(rows, indent=1))
    print(
        f"{'format':8} {'rank':>4} {'save':>4} | {'rss MB':>7} {'extra peak':>10} {'stall s':>7} {'written MB':>10} "
        f"{'write s':>7} {'compute':>7} | {'load: extra peak':>16} {'s':>6}"
    )
    for r in rows:
        for i, s in enumerate(r["saves"], 1):
            ld = r["load"] or {}
            load = f"{ld['extra_peak_mb']:16.0f} {ld['seconds']:6.2f}" if ld and i == 1 else f"{'':16} {'':6}"
            write = " " * 15
            if "write_seconds" in s:
                write = f"{s['write_seconds']:7.2f} {s['compute_rate_while_writing']:7.2f}"
            print(
                f"{r['format']:8} {r['rank']:>4} {i:>4} | {s['rss_before_mb']:7.0f} {s['extra_peak_mb']:10.0f} "
                f"{s['seconds']:7.2f} {s['bytes_written_mb']:10.0f} {write} | {load}"
            )


if __name__ == "__main__":
    run_main(main)
