"""Crash safety: kill -9 at random points and resume to the uninterrupted run's exact losses;
damaged newest checkpoints are skipped with a warning; non-finite steps follow train.nonfinite."""

import json
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from tests.train.helpers import REPO, cli_command, env, losses, one_thread, rows, tiny_args

# One worker runs this module (`make test`: xdist --dist loadgroup), so its module fixture `reference`
# (the uninterrupted reference run) is built once, not on each worker taking a test.
pytestmark = pytest.mark.xdist_group("crash")

runner = CliRunner()

# 16 steps, a checkpoint after every one (so kills land in checkpoint writes too), keep 3.
KILL_RUN = ("train.tokens=2048", "train.ckpt_interval=1", "train.keep_last=3", "train.eval_interval=4")


def train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    run = tmp_path_factory.mktemp("reference") / "run"
    with one_thread():
        train(*tiny_args(run, corpus, *KILL_RUN))
    return run, rows(run)


def _line_count(path) -> int:
    return len(path.read_bytes().split(b"\n")) - 1 if path.exists() else 0


def _kill_at_random(args, run, rng) -> str:
    """Start `rwkvx train`, SIGKILL it at a random point, and describe where it died."""
    metrics = run / "metrics.jsonl"
    before = _line_count(metrics)
    proc = subprocess.Popen(
        cli_command("train", *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=REPO
    )
    start = time.time()
    if rng.random() < 0.3:  # anywhere: imports, data preparation, the first steps
        time.sleep(rng.uniform(0.3, 1.5))
        trigger = f"{time.time() - start:.2f}s after start"
    else:  # a few steps in, at a random moment inside a step or its checkpoint
        target = min(before + rng.randint(1, 6), 12)  # 16 steps: it is still running
        while _line_count(metrics) < target and proc.poll() is None and time.time() - start < 120:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.15))
        trigger = f"after metrics line {target} + delay"
    proc.send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=60)
    assert rc == -signal.SIGKILL, f"the run ended (rc {rc}) before it was killed; make it longer"
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").exists() else []
    torn = metrics.exists() and not metrics.read_bytes().endswith(b"\n") and metrics.stat().st_size > 0
    return f"{trigger}: {_line_count(metrics)} metric lines{' + a torn one' if torn else ''}, on disk {ckpts}"


# How the killed run writes its checkpoints; every way computes the reference's losses bit for bit.
SAVES = {
    "full": (),
    "sharded-async": ("train.checkpoint_format=sharded", "train.async_checkpoint=true"),
    "full-async": ("train.async_checkpoint=true",),
}


@pytest.mark.parametrize("saves", list(SAVES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_at_random_points_then_resume_gives_the_exact_losses(tmp_path, corpus, reference, seed, saves):
    """A checkpoint is written after every step: with async ones, while the next step runs."""
    _, want = reference
    rng = random.Random(seed)
    run = tmp_path / "run"
    args = tiny_args(run, corpus, *KILL_RUN, *SAVES[saves])
    kills = [_kill_at_random(args, run, rng)]
    kills += [_kill_at_random([*args, "--resume"], run, rng) for _ in range(seed % 2)]
    print(f"seed {seed}:", *kills, sep="\n  ")
    with one_thread():
        train(*args, "--resume")
    got = rows(run)
    assert [r["step"] for r in got] == list(range(1, 17))  # none missing, none twice
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bit for bit
    assert [r["val_loss"] for r in got] == [r["val_loss"] for r in want]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000014", "step_00000015", "step_00000016"]  # keep_last, no temporary left


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 7] ^= 0x40
    path.write_bytes(bytes(raw))


def _edit_lr(path):
    meta = json.loads(path.read_text())
    meta["optimizer"]["param_groups"][0]["lr"] *= 10  # still valid JSON
    path.write_text(json.dumps(meta))


DAMAGE = {
    "truncated weights": (lambda c: _truncate(c / "model.safetensors"), "truncated"),
    "flipped byte in the optimizer": (lambda c: _flip_byte(c / "optimizer.safetensors"), "SHA-256"),
    "torn meta.json": (lambda c: _truncate(c / "meta.json"), "meta.json is unreadable"),
    "missing weights": (lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing"),
    "edited meta.json": (lambda c: _edit_lr(c / "meta.json"), "does not match its own checksum"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, corpus, reference, damage):
    ref_run, want = reference
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step_00000016")  # died after step 15's checkpoint ...
    DAMAGE[damage][0](ckpts / "step_00000015")  # ... which was damaged on disk
    (ckpts / "step_00000017").mkdir()  # and an incomplete one (no meta.json) does not count
    (ckpts / ".tmp-step_00000018").mkdir()  # nor a temporary one
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 17, "tokens": 21')  # a line torn by the crash
    with one_thread():
        result = train(*tiny_args(run, corpus, *KILL_RUN), "--resume")
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "skipping damaged checkpoint step_00000015" in warning[0], result.stderr
    assert DAMAGE[damage][1] in warning[0]
    assert "resumed from step 14" in result.stderr
    assert losses(run) == [r["loss"] for r in want]
    names = sorted(p.name for p in ckpts.iterdir())
    assert "corrupt-step_00000015" in names and not any(n.startswith(".tmp") for n in names)


def test_eval_falls_back_past_a_damaged_newest_checkpoint(tmp_path, reference):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    _truncate(run / "checkpoints" / "step_00000016" / "model.safetensors")
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
    assert result.exit_code == 0, result.output
    assert "warning: skipping damaged checkpoint step_00000016" in result.stderr
    assert json.loads(result.stdout)["step"] == 15
    result = runner.invoke(app, ["eval", "--checkpoint", str(run / "checkpoints" / "step_00000016")])
    assert result.exit_code == 1 and "is truncated" not in result.stdout and "meta.json says" in result.stderr


def test_non_finite_loss_stops_with_a_clear_message(tmp_path, corpus):
    # lr 1e30 throws the weights so far in step 1 that step 2's loss is NaN.
    args = tiny_args(tmp_path / "run", corpus, "train.lr=1e30", "train.lr_final=1e30", "train.warmup_tokens=0")
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 1
    assert "error: non-finite loss at step 2 (loss nan, gradient norm nan); the model was not updated" in result.stderr
    assert "train.nonfinite=skip" in result.stderr and "Traceback" not in result.output

    result = runner.invoke(app, ["train", *args, "train.nonfinite=skip", "train.nonfinite_limit=3"])
    assert result.exit_code == 1
    assert "3 non-finite steps in a row (train.nonfinite_limit=3)" in result.stderr
    logged = rows(tmp_path / "run")
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in logged] == [
        (1, False, 0),
        (2, True, 1),
        (3, True, 2),
    ]
    assert logged[1]["loss"] is None  # written as JSON null, not NaN


def test_a_transient_non_finite_step_is_skipped_and_counted(tmp_path, corpus):
    from rwkvx_cli.config import load_config
    from rwkvx_cli.models import build_model
    from rwkvx_cli.runs.data import ensure_data
    from rwkvx_cli.train.loop import Trainer

    cfg = load_config(None, tiny_args(tmp_path / "run", corpus, "train.nonfinite=skip", "train.tbptt=true"))
    data = ensure_data(cfg, tmp_path / "run")
    model = build_model(cfg.model, cfg.train.seed)
    trainer = Trainer(cfg, tmp_path / "run", model, data.train.tokens, data.val.tokens, data.tokenizer)
    forward = trainer.forward

    def poisoned(x, state, *targets, **options):  # step 3's loss (or logits) is NaN
        out, new_state = forward(x, state, *targets, **options)
        return (out * float("nan") if trainer.step == 2 else out), new_state

    trainer.forward = poisoned
    events = []
    for _ in range(2):
        trainer.train_step()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    loss, _, _, applied = trainer.train_step()
    assert not applied and loss != loss and trainer.skipped_steps == 1 and trainer.step == 3
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # not updated
    assert trainer.carry == [None]  # the TBPTT carry from the bad step is dropped
    trainer.run(lambda kind, m: events.append((kind, m if kind == "checkpoint" else m.step)))
    assert ("checkpoint", 10) in events and trainer.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000010" / "meta.json").read_text())
    assert meta["skipped_steps"] == 1
