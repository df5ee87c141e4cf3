"""Memory, time and bytes of a checkpoint save and load under FSDP2, full against sharded (issue 35):
`python -m rwkvx_cli.tools.bench_sharded WORKDIR [--ranks 2] [--layers 12 --embd 768 --vocab 65536]`.

An RWKV-7 model is built on the meta device, sharded with FSDP2 (each block, then the root, as
train/distributed.py's `wrap` does) over `--ranks` gloo processes on the CPU, and only then
materialised: each rank allocates just its own shard, filled with random values, and AdamW state
(exp_avg, exp_avg_sq, step) of the same shapes. Then, in each rank:

- full save: the whole state gathered onto rank 0 (`get_model_state_dict` and
  `get_optimizer_state_dict` with full_state_dict and cpu_offload, the calls of
  train/distributed.py's `full_state`), which writes it with `store.save_checkpoint`;
- sharded save: `runs/sharded.save_sharded`, every rank its own rows;
- full load: what a resume does today on every rank (`store.verify`, reading model.safetensors,
  `load_optimizer_state` and their finiteness checks, then `set_model_state_dict` /
  `set_optimizer_state_dict` of full tensors, as `distributed.load_full_state`);
- sharded load: `runs/sharded.load_sharded`.

Each format runs in fresh processes (so that memory freed by one does not hide the other's peak).
Per rank: the resident set before the operation, the extra peak during it (VmHWM after resetting
it through /proc/self/clear_refs, minus the resident set before), the wall time and the bytes it
wrote. Linux only (/proc). Everything written under WORKDIR is deleted at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

MB = 1 << 20


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


def _full_state(model, optimizer):
    """train/distributed.py's full_state for a sharded model (tools may not import train)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not osd:
        return weights, {}
    names = {id(p): n for n, p in model.named_parameters()}
    order = {names[id(p)]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return weights, {
        "state": {order[n]: st for n, st in osd["state"].items()},
        "param_groups": [{**g, "params": [order[n] for n in g["params"]]} for g in osd["param_groups"]],
    }


def _load_full(ckpt: Path, model, optimizer) -> None:
    """What a resume does on every rank today (checkpointer.load_latest, distributed.load_full_state)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from rwkvx_cli.runs import store
    from rwkvx_cli.runs.weights import check_finite

    meta = store.verify(ckpt)
    weights = store.read_safetensors(ckpt / "model.safetensors")  # store.load_weights
    check_finite(weights, str(ckpt))
    optim = store.load_optimizer_state(ckpt, meta)
    for st in optim["state"].values():  # checkpointer.check_optimizer_state's costly part
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


def _worker(rank: int, world: int, port: int, fmt: str, args, out: str) -> None:
    import torch.distributed as dist

    from rwkvx_cli.runs import sharded, store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    model, optimizer = _build(args)
    root = Path(args.workdir) / fmt
    meta = {"config": {}}
    dist.barrier()
    with _Measure() as save:
        if fmt == "full":
            weights, optim = _full_state(model, optimizer)
            gathered = time.perf_counter() - save.t0
            if rank == 0:
                store.save_checkpoint(root, 1, weights, optim, meta, keep_last=1)
            del weights, optim
        else:
            sharded.save_sharded(root, 1, model, optimizer, meta, keep_last=1)
            gathered = 0.0
        dist.barrier()  # the step loop goes on when every rank is done
    ckpt = root / "step_00000001"
    files = _files(ckpt)
    mine = (
        sum(files.values())
        if fmt == "full" and rank == 0
        else files.get(sharded.shard_name(rank, world), 0)
        + (sum(v for k, v in files.items() if not k.startswith("shard-")) if rank == 0 and fmt == "sharded" else 0)
    )
    dist.barrier()
    with _Measure() as load:
        if fmt == "full":
            _load_full(ckpt, model, optimizer)
        else:
            sharded.load_sharded(ckpt, model, optimizer)
        dist.barrier()
    row = {
        "format": fmt,
        "rank": rank,
        "save": {**save.row(), "gather_seconds": gathered, "bytes_written_mb": mine / MB},
        "load": load.row(),
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def run_benchmark(args) -> list[dict]:
    import torch.multiprocessing as mp

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = work / "rows.jsonl"
    out.unlink(missing_ok=True)
    try:
        for fmt in ("full", "sharded"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_worker, args=(args.ranks, port, fmt, args, str(out)), nprocs=args.ranks, join=True)
            shutil.rmtree(work / fmt, ignore_errors=True)
        return [json.loads(line) for line in out.read_text().splitlines()]
    finally:
        shutil.rmtree(work / "full", ignore_errors=True)
        shutil.rmtree(work / "sharded", ignore_errors=True)
        out.unlink(missing_ok=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=65536)
    args = ap.parse_args(argv)
    rows = run_benchmark(args)
    print(json.dumps(rows, indent=1))
    print(
        f"{'format':8} {'rank':>4} | {'save: rss MB':>12} {'extra peak':>10} {'s':>6} {'written MB':>10} | "
        f"{'load: extra peak':>16} {'s':>6}"
    )
    for r in rows:
        s, ld = r["save"], r["load"]
        print(
            f"{r['format']:8} {r['rank']:>4} | {s['rss_before_mb']:12.0f} {s['extra_peak_mb']:10.0f} "
            f"{s['seconds']:6.2f} {s['bytes_written_mb']:10.0f} | {ld['extra_peak_mb']:16.0f} {ld['seconds']:6.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
