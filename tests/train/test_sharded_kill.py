"""kill -9 during the checkpoint saves of a 2-rank FSDP2 run (issue 35): every rank killed at once while a
sharded checkpoint (synchronous or asynchronous), or an asynchronous full one, is being written; the run
then resumes on 1, 2 and 4 ranks. Each resume gives exactly the losses that the uninterrupted run's
checkpoint of the same step gives on as many ranks (the same state was restored), the steps before it
are the uninterrupted run's bit for bit, and every attempt is within 1e-5 of the uninterrupted run (the
ranks reduce in another order on another number of them, as tests/train/test_distributed.py).
Minutes: `make test-slow`."""

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from tests.train.helpers import REPO, cli_command, env, losses, one_thread, rollback_to, rows, run_cli, tiny_args

pytestmark = pytest.mark.slow
runner = CliRunner()

# 8 sequences per step (micro-batches of 2: 4 on one process, 2 on each of 2 ranks, 1 on each of 4),
# TBPTT (so the carry is checkpointed too), a checkpoint after every step. 10 steps.
RUN = (
    "train.micro_batch=2", "train.grad_accum=4", "train.tokens=2560", "train.tbptt=true", "train.ckpt_interval=1",
)
SAVES = {
    "sharded": ("train.checkpoint_format=sharded",),
    "sharded-async": ("train.checkpoint_format=sharded", "train.async_checkpoint=true"),
    "full-async": ("train.checkpoint_format=full", "train.async_checkpoint=true"),
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("prepared") / "data"  # a multi-process train does not prepare data
    assert runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(out)]).exit_code == 0
    return out


def args_for(run: Path, prepared: Path, *extra) -> list[str]:
    return tiny_args(run, prepared, *RUN, *extra)


def resume(run: Path, prepared: Path, ranks: int, *extra) -> int:
    """`rwkvx train --resume` on `ranks` processes (FSDP2 for more than one); the step it resumed from."""
    args = args_for(run, prepared, *extra)
    if ranks == 1:
        with one_thread():  # the thread count of the ranks (OMP_NUM_THREADS=1)
            result = runner.invoke(app, ["train", *args, "--resume"])
        assert result.exit_code == 0, result.output
        text = result.stderr
    else:
        done = run_cli("train", *args, "train.distributed=fsdp", "--resume", nproc=ranks, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        text = done.stderr
    line = next(ln for ln in text.splitlines() if "resumed from step" in ln or "no checkpoint to resume" in ln)
    return int(line.rsplit(" ", 1)[1]) if "resumed from step" in line else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prepared):
    """The uninterrupted 2-rank run, every checkpoint kept; (run dir, losses, {(step, ranks): losses of a resume
    from its checkpoint of that step on that many ranks}, filled as the tests need them)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    done = run_cli("train", *args_for(run, prepared, "train.keep_last=20", *SAVES["sharded"]), "train.distributed=fsdp",
                   nproc=2, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run, losses(run), {}


def resumed_reference(reference, tmp_path: Path, prepared: Path, step: int, ranks: int) -> list[float]:
    run, want, cache = reference
    if (step, ranks) not in cache:
        copy = tmp_path / f"reference-{step}-{ranks}"
        shutil.copytree(run, copy)
        rollback_to(copy, step)
        assert resume(copy, prepared, ranks, "train.keep_last=20", *SAVES["sharded"]) == step
        cache[step, ranks] = losses(copy)
    return cache[step, ranks]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _temporaries(ckpts: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(ckpts) if e.name.startswith(".tmp-step_"))
    except FileNotFoundError:
        return []


def kill_during_a_save(run: Path, args: list[str], rng: random.Random) -> tuple[str, bool]:
    """Start the 2-rank run (or resume it), SIGKILL every rank and torchrun at once as soon as a checkpoint
    of step >= a random target is being written; (what was on disk, whether a save was cut short)."""
    ckpts = run / "checkpoints"
    target = rng.randint(2, 7)
    proc = subprocess.Popen(
        cli_command("train", *args, "train.distributed=fsdp", nproc=2),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=REPO,
    )
    start = time.time()
    while proc.poll() is None and time.time() - start < 300:
        if any(int(name.split("_")[1]) >= target for name in _temporaries(ckpts)):
            break
        time.sleep(0.0005)
    ranks = _children(proc.pid)
    for pid in [*ranks, proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert len(ranks) == 2, f"torchrun had {ranks} as its workers"
    for pid in ranks:  # reaped by init once torchrun is gone; wait until they are
        while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            time.sleep(0.01)
    cut = _temporaries(ckpts)
    on_disk = sorted(p.name for p in ckpts.iterdir()) if ckpts.exists() else []
    return f"target step {target}: on disk {on_disk}", bool(cut)


@pytest.mark.parametrize("saves", list(SAVES))
def test_kill_9_during_a_save_then_resume_on_1_2_and_4_ranks(tmp_path, prepared, reference, saves):
    rng = random.Random(sum(map(ord, saves)))
    run = tmp_path / "killed"
    args = args_for(run, prepared, *SAVES[saves])
    kills, cut = [], False
    for attempt in range(3):  # until a kill lands inside a save (it nearly always does the first time)
        what, cut = kill_during_a_save(run, [*args, *(["--resume"] if attempt else [])], rng)
        kills.append(what)
        if cut:
            break
    print(saves, *kills, sep="\n  ")
    assert cut, f"no kill landed inside a save: {kills}"
    _, want, _ = reference
    for ranks in (1, 2, 4):
        attempt = tmp_path / f"resumed-on-{ranks}"
        shutil.copytree(run, attempt)
        step = resume(attempt, prepared, ranks, *SAVES[saves])
        got = losses(attempt)
        assert [r["step"] for r in rows(attempt)] == list(range(1, 11))  # none missing, none twice
        assert got[:step] == want[:step]  # the steps before the kill, as the uninterrupted run logged them
        assert got == resumed_reference(reference, tmp_path, prepared, step, ranks), (ranks, step)  # exact
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
        if ranks == 2:
            assert got == want  # on as many ranks as wrote it: the uninterrupted run, bit for bit
        names = sorted(p.name for p in (attempt / "checkpoints").iterdir())
        assert names == ["step_00000008", "step_00000009", "step_00000010"]  # keep_last, no temporary left
        meta = json.loads((attempt / "checkpoints" / "step_00000010" / "meta.json").read_text())
        assert meta["world_size"] == ranks
