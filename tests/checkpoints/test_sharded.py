"""Sharded checkpoints (checkpoints/sharded.py, issue 35): a tiny RWKV-7 under FSDP2 on 2 gloo ranks
(CPU) writes one; it reads back on 2 and 4 ranks (FSDP2) and in one plain process, its weights and
AdamW state equal bit for bit to what the full-state path (full.full_state, full.save_checkpoint,
full.load_full_state) gives; a rank failing or dying mid-write leaves no checkpoint; damaged
or forged files are refused in one line and nothing is ever unpickled.

The ranks are processes spawned here (torch.multiprocessing), one thread each; rank 0 checks what
it can and writes what the test asserts to a JSON file."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rwkvx_cli.checkpoints import find, full, ranks, sharded, store
from rwkvx_cli.config import ModelConfig
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.models import LM, parameter_groups
from rwkvx_cli.models.optimizer import IMPLEMENTATION, adamw

# One worker runs this module (`make test`: xdist --dist loadgroup), so its module fixture `written`
# (two gloo ranks writing a sharded checkpoint, 12 s) is built once, not on each worker taking a test.
pytestmark = pytest.mark.xdist_group("sharded")

# vocab 77 and the [1, 1, C] mixing vectors: rows that split unevenly, and ranks that hold none.
CFG = ModelConfig(n_layer=2, n_embd=64, head_size=32, vocab_size=77)
META = {"config": {"model": {"n_layer": 2}}, "world_size": 2}
STEP = 2


# -- in every rank ---------------------------------------------------------------------------------------
def tiny(seed: int, cfg: ModelConfig = CFG) -> LM:
    """The model with seeded small random weights (RWKV-LM's init runs QR decompositions, seconds on a
    busy 2-core machine; what these tests compare does not depend on the init)."""
    model = LM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def make(seed: int):
    """The model and optimizer as the trainer builds them (train/loop.py): FSDP2 when a process group exists."""
    from rwkvx_cli.train import distributed

    model = tiny(seed)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in parameter_groups(model, 1e-2, 0.1)]
    distributed.wrap(model, "fsdp", torch.device("cpu"))
    params = dict(model.named_parameters())
    opt = adamw(
        [{**g, "params": [params[n] for n in g["params"]]} for g in groups],
        1e-2,
        (0.9, 0.99),
        1e-8,
        sharded=ranks.sharded(model),
    )
    return model, opt


def train_step(model, opt, seed: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    idx = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(100 * seed + rank))
    loss, _ = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()


def same(a: tuple, b: tuple) -> None:
    """Two (weights, optimizer state_dict with integer keys) are equal bit for bit."""
    (wa, oa), (wb, ob) = a, b
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]), k
    assert sorted(oa["state"]) == sorted(ob["state"])
    for i, st in oa["state"].items():
        assert sorted(st) == sorted(ob["state"][i]), i
        for key, v in st.items():
            w = ob["state"][i][key]
            assert torch.equal(torch.as_tensor(v).float(), torch.as_tensor(w).float()), (i, key)

    def settings(groups):  # the implementation flags say how AdamW computes, not what (models/optimizer.py)
        return [
            {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k not in IMPLEMENTATION} for g in groups
        ]

    assert settings(oa["param_groups"]) == settings(ob["param_groups"])


def reference(tmp: Path):
    ckpt = tmp / "full" / f"step_{STEP:08d}"
    meta = find.verify(ckpt)
    return full.load_weights(ckpt), full.load_optimizer_state(ckpt, meta)


def check_read(tmp: Path, rank: int) -> None:
    """Load the sharded checkpoint into a fresh model on this process group; it equals the full checkpoint
    exactly, and a step after it equals a step after loading the full checkpoint (the full-state path)."""
    model, opt = make(seed=7)
    meta = sharded.load_sharded(tmp / "sharded" / f"step_{STEP:08d}", model, opt)
    assert meta["step"] == STEP
    got = full.full_state(model, opt)
    weights, optim = reference(tmp)
    if rank == 0:
        same(got, (weights, optim))
    other, other_opt = make(seed=8)
    full.load_full_state(other, other_opt, weights, optim)
    train_step(model, opt, 3)
    train_step(other, other_opt, 3)
    a, b = full.full_state(model, opt), full.full_state(other, other_opt)
    if rank == 0:
        same(a, b)


def _write_job(rank: int, world: int, tmp: Path) -> None:
    out: dict = {}
    model, opt = make(seed=0)
    for s in range(STEP):
        train_step(model, opt, s)
    weights, optim = full.full_state(model, opt)
    if rank == 0:
        full.save_checkpoint(tmp / "full", STEP, weights, optim, META, keep_last=5)
    extra = {"carry.0.att": torch.arange(12.0).reshape(4, 3)}
    path = sharded.save_sharded(tmp / "sharded", STEP, model, opt, META, keep_last=5, extra=extra)
    out["path"] = str(path)
    dist.barrier()
    check_read(tmp, rank)

    # The module DDP wraps (every rank holds it whole): each rank writes its rows of every tensor.
    plain = tiny(3)
    plain_opt = adamw(parameter_groups(plain, 1e-2, 0.1), 1e-2, (0.9, 0.99), 1e-8)
    w, o = reference(tmp)
    full.load_full_state(plain, plain_opt, w, o)
    sharded.save_sharded(tmp / "plain2", STEP, plain, plain_opt, META, keep_last=5)

    # Rank 1 fails half way through its file: every rank stops with one line, nothing is committed.
    from rwkvx_cli.formats import write  # every checkpoint file of tensors (store.write_tensors)

    real = write.write_safetensors

    def half_then_full_disk(source, path, names, metadata, digest=None, dir_fd=None):
        real(source, path, names[: len(names) // 2], metadata, digest, dir_fd)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    if rank == 1:
        write.write_safetensors = half_then_full_disk
    try:
        sharded.save_sharded(tmp / "sharded", 3, model, opt, META, keep_last=5)
        out["fail"] = None
    except CheckpointError as e:
        out["fail"] = str(e)
    write.write_safetensors = real
    root = tmp / "sharded"
    out["after_fail"] = sorted(p.name for p in root.iterdir())

    # Rank 1 dies half way through its file (as kill -9 would): rank 0's collective fails, and the
    # directory left is a temporary one without meta.json.
    def half_then_die(source, path, names, metadata, digest=None, dir_fd=None):
        real(source, path, names[: len(names) // 2], metadata, digest, dir_fd)
        os._exit(0)

    if rank == 1:
        write.write_safetensors = half_then_die
    try:
        sharded.save_sharded(tmp / "sharded", 4, model, opt, META, keep_last=5)
        out["died"] = None
    except Exception as e:  # gloo: the peer closed its connection
        out["died"] = type(e).__name__
    out["after_death"] = sorted(p.name for p in root.iterdir())
    out["complete_after_death"] = [p.name for p in store.list_checkpoints(root)]
    if rank == 0:
        (tmp / "write.json").write_text(json.dumps(out))
    os._exit(0)  # the process group is broken: no clean shutdown to wait for


def _read_job(rank: int, world: int, tmp: Path) -> None:
    check_read(tmp, rank)
    if rank == 0:
        (tmp / f"read{world}.json").write_text(json.dumps({"ok": True}))


JOBS = {"write": _write_job, "read": _read_job}


def _worker(rank: int, world: int, port: int, job: str, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    JOBS[job](rank, world, Path(tmp))
    dist.destroy_process_group()


def launch(job: str, world: int, tmp: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, job, str(tmp)), nprocs=world, join=True)


# -- the tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    launch("write", 2, tmp)
    return tmp, json.loads((tmp / "write.json").read_text())


def ckpt_of(tmp: Path) -> Path:
    return tmp / "sharded" / f"step_{STEP:08d}"


def plain_model(seed: int):
    model = tiny(seed)
    return model, adamw(parameter_groups(model, 1e-2, 0.1), 1e-2, (0.9, 0.99), 1e-8)


def test_two_ranks_write_one_file_each_and_read_back(written):
    """(The 2-rank read-back and its comparison with the full-state path ran in the ranks.)"""
    tmp, out = written
    ckpt = ckpt_of(tmp)
    assert out["path"] == str(ckpt)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [
        "extra.safetensors",
        "index.json",
        "meta.json",
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    ]
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["checkpoint_format"] == "sharded" and sorted(meta["files"]) == [n for n in names if n != "meta.json"]
    index = json.loads((ckpt / "index.json").read_text())
    assert index["tensors"]["model/emb.weight"]["chunks"] == [[0, 0, 39], [1, 39, 77]]
    assert index["tensors"]["optim/emb.weight/step"]["chunks"] == [[0, 0, 1]]
    # Each rank wrote about half of the bytes.
    a, b = ((ckpt / f"shard-0000{r}-of-00002.safetensors").stat().st_size for r in (0, 1))
    assert abs(a - b) < 0.1 * (a + b)
    assert store.load_extra(ckpt)["carry.0.att"].equal(torch.arange(12.0).reshape(4, 3))


@pytest.mark.slow  # four spawned ranks: ~20 s on 2 CPU cores (the 2-rank and 1-process reads stay in make test)
def test_four_ranks_read_what_two_wrote(written):
    tmp, _ = written
    launch("read", 4, tmp)
    assert json.loads((tmp / "read4.json").read_text()) == {"ok": True}


def test_one_plain_process_reads_what_two_wrote(written):
    """Into a plain model and its fused AdamW (the trainer's single-process optimizer), equal to
    loading the full checkpoint with full.load_full_state, state and groups."""

    tmp, _ = written
    model, opt = plain_model(5)
    sharded.load_sharded(ckpt_of(tmp), model, opt)
    other, other_opt = plain_model(6)
    full.load_full_state(other, other_opt, *reference(tmp))
    same((model.state_dict(), opt.state_dict()), (other.state_dict(), other_opt.state_dict()))
    assert opt.param_groups[0]["fused"] is True  # its own implementation flags kept
    same((model.state_dict(), opt.state_dict()), reference(tmp))


def test_consolidated_equals_the_full_checkpoint(written, tmp_path):
    tmp, _ = written
    want = reference(tmp)
    for ckpt in (ckpt_of(tmp), tmp / "plain2" / f"step_{STEP:08d}"):  # written from FSDP2, from replicas
        meta, weights, optim = sharded.consolidate(ckpt)
        same((weights, optim), want)
    out = sharded.write_full(ckpt_of(tmp), tmp_path / "full")
    meta = find.verify(out)
    same((full.load_weights(out), full.load_optimizer_state(out, meta)), want)
    assert store.load_extra(out)["carry.0.att"].shape == (4, 3)
    one = sharded.consolidate_to_file(ckpt_of(tmp), tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    got = load_file(one)
    assert sorted(got) == sorted(want[0]) and all(torch.equal(got[k], want[0][k]) for k in got)


def test_a_rank_failing_mid_write_leaves_no_checkpoint(written):
    _, out = written
    assert out["fail"] is not None and "\n" not in out["fail"]
    assert out["fail"].startswith("cannot write the checkpoint of step 3 in ")
    assert "rank 1: " in out["fail"] and "No space left on device" in out["fail"]
    assert out["fail"].endswith("the earlier checkpoints are intact")
    assert out["after_fail"] == [f"step_{STEP:08d}"]  # the temporary directory removed


def test_a_rank_dying_mid_write_leaves_no_complete_checkpoint(written):
    tmp, out = written
    assert out["died"] is not None
    assert out["complete_after_death"] == [f"step_{STEP:08d}"]
    assert [n for n in out["after_death"] if n.startswith("step_")] == [f"step_{STEP:08d}"]
    # What is left is a temporary directory without meta.json, removed by the next save.
    left = [tmp / "sharded" / n for n in out["after_death"] if n.startswith(".tmp-")]
    assert all(not (p / "meta.json").exists() for p in left)
    model, opt = plain_model(0)
    sharded.save_sharded(tmp / "sharded", 9, model, opt, META, keep_last=5)
    assert not list((tmp / "sharded").glob(".tmp-*"))
    shutil.rmtree(tmp / "sharded" / "step_00000009")


def rehash(ckpt: Path) -> None:
    """Make meta.json list the files as they are now, as a forger would."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for name in meta["files"]:
        data = (ckpt / name).read_bytes()
        meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta["meta_sha256"] = store.meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))


class Boom:
    """Creates `marker` when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _index(ckpt: Path) -> dict:
    return json.loads((ckpt / "index.json").read_text())


def forge_index(ckpt: Path, fn) -> None:
    index = _index(ckpt)
    fn(index)
    (ckpt / "index.json").write_text(json.dumps(index))
    rehash(ckpt)


def _shift_rows(index):
    chunks = index["tensors"]["model/emb.weight"]["chunks"]
    chunks[0][2] -= 1
    chunks[1][1] -= 1


def _swap_files(index):
    chunks = index["tensors"]["model/head.weight"]["chunks"]
    chunks[0][0], chunks[1][0] = chunks[1][0], chunks[0][0]


def _flip_byte(ckpt):
    path = ckpt / "shard-00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))


FORGERIES = {
    "a flipped byte in a shard": (_flip_byte, "does not match its SHA-256"),
    "a truncated shard": (
        lambda c: os.truncate(c / "shard-00000-of-00002.safetensors", 1000),
        "bytes, but meta.json says",
    ),
    "a missing shard": (lambda c: (c / "shard-00001-of-00002.safetensors").unlink(), "is missing"),
    "a torn meta.json": (lambda c: os.truncate(c / "meta.json", 50), "meta.json is unreadable"),
    "rows moved in index.json": (lambda c: forge_index(c, _shift_rows), "does not hold the rows"),
    "files swapped in index.json": (lambda c: forge_index(c, _swap_files), "does not hold the rows"),
    "a row gap in index.json": (
        lambda c: forge_index(c, lambda i: i["tensors"]["model/emb.weight"]["chunks"].pop()),
        "the shards hold rows 0..39 of 77",
    ),
    "a pickle for index.json": (None, "is not JSON"),
    "a pickle for a shard": (None, "is not a safetensors file"),
    "a shard of another checkpoint": (None, "is not shard 0 of 2"),
    "NaN weights in a shard": (None, "emb.weight holds non-finite values"),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_damaged_or_forged_files_are_refused_in_one_line_and_never_unpickled(written, tmp_path, monkeypatch, case):
    tmp, _ = written
    ckpt = tmp_path / f"step_{STEP:08d}"
    shutil.copytree(ckpt_of(tmp), ckpt)
    marker = tmp_path / "unpickled"
    forge, expect = FORGERIES[case]
    if case == "a pickle for index.json":
        (ckpt / "index.json").write_bytes(pickle.dumps(Boom(marker)))
        rehash(ckpt)
    elif case == "a pickle for a shard":
        torch.save({"x": Boom(marker)}, ckpt / "shard-00000-of-00002.safetensors")
        rehash(ckpt)
    elif case == "a shard of another checkpoint":  # shard 0's tensors, labelled as another rank's
        from safetensors.torch import load_file, save_file

        path = ckpt / "shard-00000-of-00002.safetensors"
        save_file(load_file(path), path, metadata={"format": "pt", "rwkvx_shard": "1/2", "step": str(STEP)})
        rehash(ckpt)
    elif case == "NaN weights in a shard":
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        path = ckpt / "shard-00001-of-00002.safetensors"
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
        tensors = load_file(path)
        tensors["model/emb.weight"][3, 5] = float("nan")
        save_file(tensors, path, metadata=metadata)
        rehash(ckpt)
    else:
        forge(ckpt)

    def never(*args, **kwargs):
        raise AssertionError("unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, never)
    monkeypatch.setattr(torch, "load", never)
    model, opt = plain_model(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        sharded.load_sharded(ckpt, model, opt)
    message = str(e.value)
    assert "\n" not in message and expect in message, message
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded
    assert not opt.state
    if case != "NaN weights in a shard":  # consolidate, as full.load_weights, leaves values to its caller
        with pytest.raises(CheckpointError):
            sharded.consolidate(ckpt)


def test_meta_json_naming_a_file_outside_the_checkpoint_is_refused(written, tmp_path):
    tmp, _ = written
    ckpt = tmp_path / f"step_{STEP:08d}"
    shutil.copytree(ckpt_of(tmp), ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"]["../outside"] = meta["files"]["index.json"]
    meta["meta_sha256"] = store.meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="unexpected file '../outside'"):
        sharded.verify(ckpt)


def test_a_planted_dcp_metadata_pickle_is_never_read(written, tmp_path):
    """torch's DCP reader unpickles `.metadata`; rwkvx reads only what meta.json lists."""
    tmp, _ = written
    ckpt = tmp_path / f"step_{STEP:08d}"
    shutil.copytree(ckpt_of(tmp), ckpt)
    marker = tmp_path / "unpickled"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Boom(marker)))
    (ckpt / "model-00001-of-00001.safetensors").write_bytes(b"junk")
    model, opt = plain_model(5)
    sharded.load_sharded(ckpt, model, opt)
    assert not marker.exists()


def test_a_model_of_another_shape_is_refused_before_loading(written):
    tmp, _ = written
    model = tiny(0, ModelConfig(n_layer=2, n_embd=64, head_size=32, vocab_size=78))
    with pytest.raises(CheckpointError, match="does not match the model: shape mismatch emb.weight"):
        sharded.load_sharded(ckpt_of(tmp), model)


def test_a_checkpoint_without_meta_json_is_not_complete(written, tmp_path):
    """A write killed before its commit leaves `.tmp-step_N` (not listed) or, never by rwkvx, a
    `step_N` without meta.json, which the store counts as damaged and skips."""
    tmp, _ = written
    root = tmp_path / "checkpoints"
    shutil.copytree(ckpt_of(tmp), root / ".tmp-step_00000004")
    (root / ".tmp-step_00000004" / "meta.json").unlink()
    assert store.list_checkpoints(root) == []
    shutil.copytree(ckpt_of(tmp), root / "step_00000003")
    (root / "step_00000003" / "meta.json").unlink()
    assert store.list_checkpoints(root) == []
    assert find.latest_good(root) is None


def test_weights_only_and_a_forged_group_setting(written, tmp_path):
    """A checkpoint without an optimizer (rwkvx init's step 0) loads weights and leaves the optimizer
    as it is; a group setting that is not a plain value is refused."""
    model, opt = plain_model(1)
    path = sharded.save_sharded(tmp_path / "w", 0, model, None, META, keep_last=1)
    assert _index(path)["optimizer"] is None
    other, other_opt = plain_model(2)
    sharded.load_sharded(path, other, other_opt)
    want, got = model.state_dict(), other.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert not other_opt.state
    tmp, _ = written
    ckpt = tmp_path / f"step_{STEP:08d}"
    shutil.copytree(ckpt_of(tmp), ckpt)
    forge_index(ckpt, lambda i: i["optimizer"]["param_groups"][0].update(lr={"__class__": "os.system"}))
    with pytest.raises(CheckpointError, match="optimizer group setting 'lr' is"):
        sharded.verify(ckpt)


def test_chunk_rows_is_torch_chunk():
    for n in (0, 1, 2, 5, 7, 77, 64):
        for parts in (1, 2, 3, 4, 8):
            chunks = torch.arange(n).chunk(parts) if n else ()
            got = [sharded.chunk_rows(n, parts, r) for r in range(parts)]
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
            assert [g for g in got if g[1] > g[0]] == want


def test_a_checkpoint_given_directly_names_what_it_lacks(written, tmp_path):
    """`eval --checkpoint RUN/checkpoints/step_N` of a damaged one names the missing file, not "no checkpoint"."""
    tmp, _ = written
    ckpt = tmp_path / "checkpoints" / f"step_{STEP:08d}"
    shutil.copytree(ckpt_of(tmp), ckpt)
    (ckpt / "index.json").unlink()
    with pytest.raises(CheckpointError, match=rf"^{ckpt / 'index.json'} is missing$"):
        find.resolve_checkpoint(ckpt)
    (ckpt / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=rf"^{ckpt / 'meta.json'} is missing$"):
        find.resolve_checkpoint(ckpt)
