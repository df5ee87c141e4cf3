"""Logging and profiling of a training run: plain progress lines without a terminal, the metric sinks
of train.loggers (jsonl, tensorboard, wandb offline), MFU, and the trace of train.profile_steps."""

import io
import json
import math
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.render.train import TrainView
from rwkvx_cli.train.metrics import MetricsLog, StepMetrics
from rwkvx_cli.train.plot import plot_losses
from tests.train.helpers import rows, tiny_args

runner = CliRunner()


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, corpus):
    """One tiny run (10 steps) with every cheap sink and a profile of steps 2..3, stdout not a terminal."""
    run = tmp_path_factory.mktemp("logged") / "run"
    args = tiny_args(
        run, corpus, "train.log_interval=3", "train.loggers=[jsonl,tensorboard]", "train.profile_steps=[2,3]"
    )
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return run, result


def test_plain_progress_lines_without_a_terminal(logged_run):
    _, result = logged_run
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" · ")[0] for line in lines] == ["step 3/10", "step 6/10", "step 9/10", "step 10/10"]
    for field in ("loss ", "lr ", "grad norm ", "tokens/s", "MFU ", "ETA ", "peak mem ", "epoch "):
        assert all(field in line for line in lines), field
    assert "val loss" in lines[-1]  # the last step validates
    assert "done" in result.stdout


def test_mfu_is_a_positive_finite_number_in_metrics_jsonl(logged_run):
    run, _ = logged_run
    mfu = [r["mfu_pct"] for r in rows(run)]
    assert len(mfu) == 10
    assert all(isinstance(v, float) and math.isfinite(v) and 0 < v < 100 for v in mfu)


def test_tensorboard_event_files_hold_the_loss(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = logged_run
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 11))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows(run)], rel=1e-6)
    assert [e.step for e in events.Scalars("val/loss")] == [5, 10]
    assert all(e.value > 0 for e in events.Scalars("train/mfu_pct"))


def test_profile_steps_write_a_chrome_trace(logged_run):
    run, result = logged_run
    trace = run / "profile" / "trace-step2-3.json"
    assert f"profile trace written: {trace}" in result.stdout.splitlines()
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"train step 2", "train step 3"} <= names and "train step 4" not in names
    assert len(events) > 50  # the ops of two steps, not an empty profile


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "train.loggers=[jsonl,tensorbord]",
            "train.loggers: unknown logger 'tensorbord' (did you mean 'tensorboard'?)",
        ),
        ("train.profile_steps=[3,2]", "train.profile_steps: [3, 2] must be [a, b], two steps with 1 <= a <= b"),
        ("train.profile_steps=[0,2]", "train.profile_steps: [0, 2] must be [a, b], two steps with 1 <= a <= b"),
        ("train.profile_steps=[4]", "train.profile_steps: [4] must be [a, b], two steps with 1 <= a <= b"),
        ("train.profile_steps=[2,11]", "train.profile_steps: step 11 is past the run's last step (10)"),
        ("train.log_interval=0", "train.log_interval: must be >= 1"),
    ],
)
def test_bad_logging_config_is_one_line_exit_2(tmp_path, corpus, override, message):
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "r", corpus), override])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_missing_sink_package_names_the_pip_command(tmp_path, corpus, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import tensorboard` now raises ImportError
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "r", corpus), f"train.loggers=[jsonl,{package}]"])
    assert result.exit_code == 2, result.output
    assert f"pip install 'rwkvx[{package}]'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()  # refused before the run directory, the data or any step


def test_wandb_offline_run_writes_its_files(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    args = tiny_args(run, corpus, "train.tokens=384", "train.loggers=[wandb]", "train.wandb_name=tiny-test")
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = list(runs[0].glob("run-*.wandb"))
    assert data and data[0].stat().st_size > 0
    assert not (run / "metrics.jsonl").exists() and not (run / "loss.png").exists()  # jsonl was not asked for


def test_old_metrics_lines_without_mfu_still_load(tmp_path):
    path = tmp_path / "metrics.jsonl"
    old = {"step": 1, "tokens": 128, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
    old |= {"elapsed_s": 1.0, "peak_mem_mb": 1.0, "val_loss": None, "val_bpb": None}
    lines = [json.dumps({**old, "step": s, "loss": 5.0 - s / 10}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + "\n")
    log = MetricsLog(path)
    log.truncate(2)  # resume from a step-2 checkpoint
    with log:
        log.append(StepMetrics(3, 384, 4.0, 1e-3, 1.0, 10.0, 1.0, 1.0, mfu_pct=1.5))
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3] and "mfu_pct" not in got[0] and got[2]["mfu_pct"] == 1.5
    assert plot_losses(path, tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_the_live_view_shows_mfu():
    view = TrainView(10)
    view.update("step", StepMetrics(2, 256, 4.0, 1e-3, 0.5, 1000.0, 0.3, 12.0, mfu_pct=3.25))
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(view.render())
    row = next(line for line in console.export_text().splitlines() if line.startswith("MFU"))
    assert row.split()[:2] == ["MFU", "3.2%"]
