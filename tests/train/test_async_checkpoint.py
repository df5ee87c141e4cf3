"""train.async_checkpoint (issue 35): a checkpoint written in the background holds exactly what a
synchronous one does, the state of its own step, while the loop goes on training; a stop request
and the run's end wait for it; a write that fails stops the run with one line and leaves the
earlier checkpoints intact. The staging buffers are reused and independent of the live tensors.
(kill -9 during background saves: tests/train/test_crash.py and tests/train/test_sharded_kill.py.)"""

import copy
import dataclasses
import errno
import functools
import json
import threading
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.checkpoints import find, full, sharded
from rwkvx_cli.checkpoints.background import Staging
from rwkvx_cli.cli import app
from rwkvx_cli.config import Config, ModelConfig, TrainConfig
from rwkvx_cli.data import ByteTokenizer
from rwkvx_cli.models import build_model
from rwkvx_cli.train.loop import Trainer
from tests.train.helpers import losses, tiny_args

runner = CliRunner()
FORMATS = ["full", "sharded"]


def settings(fmt: str, background: bool) -> tuple[str, ...]:
    return ("train.tbptt=true", f"train.checkpoint_format={fmt}", f"train.async_checkpoint={str(background).lower()}")


def train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


def tensor_files(ckpt) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir()) if p.name != "meta.json"}


def meta_without_files(ckpt) -> dict:
    meta = json.loads((ckpt / "meta.json").read_text())
    for key in ("files", "meta_sha256"):
        meta.pop(key)
    meta["config"]["train"].pop("async_checkpoint")
    meta["config"].pop("run_dir")
    return meta


@pytest.mark.parametrize("fmt", FORMATS)
def test_background_checkpoints_are_the_synchronous_ones_byte_for_byte(tmp_path, corpus, fmt):
    runs = {}
    for background in (False, True):
        runs[background] = tmp_path / str(background)
        torch.manual_seed(0)  # the process's RNG, which meta.json keeps, as the other run found it
        train(*tiny_args(runs[background], corpus, *settings(fmt, background)))
    assert losses(runs[True]) == losses(runs[False])
    for step in (4, 8, 10):
        sync, background = (runs[b] / "checkpoints" / f"step_{step:08d}" for b in (False, True))
        assert tensor_files(background) == tensor_files(sync)  # weights, optimizer state, carry, index
        assert meta_without_files(background) == meta_without_files(sync)  # RNG, counters, config
    assert sorted(p.name for p in (runs[True] / "checkpoints").iterdir()) == [
        "step_00000004", "step_00000008", "step_00000010"
    ]


# -- the loop goes on while a checkpoint is written ---------------------------------------------------
CFG = Config(
    model=ModelConfig(vocab_size=33, n_layer=2, n_embd=32, head_size=16),
    train=TrainConfig(
        ctx_len=8, micro_batch=2, grad_accum=2, tokens=192, tbptt=True, ckpt_interval=2, eval_interval=100
    ),
)
TOKENS = (np.arange(400) % 33).astype(np.uint16)


@functools.cache
def _initial_model():
    return build_model(CFG.model, 0)


def make_trainer(run_dir, fmt: str, background: bool) -> Trainer:
    cfg = dataclasses.replace(
        CFG, train=dataclasses.replace(CFG.train, checkpoint_format=fmt, async_checkpoint=background)
    )
    run_dir.mkdir(parents=True)
    return Trainer(cfg, run_dir, copy.deepcopy(_initial_model()), TOKENS, TOKENS, ByteTokenizer())


def held_back(monkeypatch, fmt: str, release):
    """Make the background write of the first checkpoint wait until `release()` is true (at most 60 s)."""
    module, name = (sharded, "write_sharded") if fmt == "sharded" else (full, "save_checkpoint")
    original = getattr(module, name)
    held = []

    def slow(*args, **kwargs):
        if not held:
            held.append(threading.current_thread().name)
            deadline = time.monotonic() + 60
            while not release() and time.monotonic() < deadline:
                time.sleep(0.002)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, slow)
    return held


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_loop_trains_on_while_a_checkpoint_is_written_and_it_holds_its_own_step(
    tmp_path, monkeypatch, fmt
):
    sync = make_trainer(tmp_path / "sync", fmt, False)
    sync.run()
    trainer = make_trainer(tmp_path / "async", fmt, True)
    # The checkpoint of step 2 is written only once the loop has trained step 3, changing every weight.
    held = held_back(monkeypatch, fmt, lambda: trainer.step >= 3)
    events = []
    trainer.run(lambda kind, m: events.append((kind, m if kind == "checkpoint" else m.step)))
    assert held == ["rwkvx-checkpoint-2"]  # written by the writer thread, not the loop
    assert events.index(("step", 3)) < events.index(("checkpoint", 2))  # on disk only after step 3
    assert [e for e in events if e[0] == "checkpoint"] == [("checkpoint", s) for s in (2, 4, 6)]
    for step in (2, 4, 6):
        name = f"step_{step:08d}"
        got, want = (t.run_dir / "checkpoints" / name for t in (trainer, sync))
        assert tensor_files(got) == tensor_files(want)  # step 2's state, not step 3's
    assert not trainer.checkpoints.writing


def test_a_stop_request_and_the_end_wait_for_the_write(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path / "run", "sharded", True)
    started = time.monotonic()
    held_back(monkeypatch, "sharded", lambda: time.monotonic() - started > 1.0)  # the write takes over a second
    trainer.run(should_stop=lambda: trainer.step == 1)  # the stop's checkpoint (step 1) is the held one
    assert trainer.step == 1 and not trainer.checkpoints.writing
    ckpt = trainer.run_dir / "checkpoints" / "step_00000001"
    assert sharded.verify(ckpt)[0]["step"] == 1  # complete when run() returned
    assert not list((trainer.run_dir / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_background_write_stops_the_run_in_one_line(tmp_path, corpus, monkeypatch, fmt):
    from rwkvx_cli.formats import write

    run = tmp_path / "run"
    original = write.write_safetensors  # every checkpoint file of tensors, in either format (store.write_tensors)

    def fail_at_step_8(tensors, path, *args, **kwargs):
        if "step_00000008" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return original(tensors, path, *args, **kwargs)

    monkeypatch.setattr(write, "write_safetensors", fail_at_step_8)
    result = runner.invoke(app, ["train", *tiny_args(run, corpus, *settings(fmt, True))])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]), result.output
    line = errors[0]
    assert "cannot write the checkpoint of step 8" in line and "No space left on device" in line, line
    assert "the earlier checkpoints are intact" in line
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000004"]  # no partial directory left, step 10 never begun
    assert find.verify(run / "checkpoints" / "step_00000004")["step"] == 4
    monkeypatch.undo()
    result = train(*tiny_args(run, corpus, *settings(fmt, True)), "--resume")
    assert "resumed from step 4" in result.stderr
    assert len(losses(run)) == 10


# -- staging ----------------------------------------------------------------------------------------------
def test_staging_copies_into_buffers_it_keeps_and_releases_the_unused():
    staging = Staging()
    live = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    staging.begin()
    first = staging.tree({"x": live, "n": 3, "t": (live["a"], "s")})
    staging.finish()
    assert first["n"] == 3 and first["t"][1] == "s"
    live["a"].add_(10)  # training goes on: the copy does not change
    assert torch.equal(first["x"]["a"], torch.arange(6.0).reshape(2, 3))
    assert first["x"]["a"].data_ptr() != live["a"].data_ptr()
    assert staging.bytes == 2 * 6 * 4 + 4 * 2
    staging.begin()
    second = staging.tree({"x": {"a": live["a"]}})  # "b" and "t" not staged this time
    staging.finish()
    assert second["x"]["a"].data_ptr() == first["x"]["a"].data_ptr()  # the same buffer, refilled
    assert torch.equal(second["x"]["a"], live["a"])
    assert staging.bytes == 6 * 4  # the others released
    staging.begin()
    staging.copy("k", live["a"])
    with pytest.raises(ValueError, match="twice"):
        staging.copy("k", live["a"])
