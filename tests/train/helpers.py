"""Shared by the training tests: a tiny run's arguments, its metrics, and launching the CLI as
a separate process (plain or under torchrun), one thread per process."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import rwkvx_cli

REPO = Path(rwkvx_cli.__file__).resolve().parent.parent


def tiny_args(run_dir, corpus, *extra):
    return [
        f"run_dir={run_dir}",
        f"data.corpus=[{corpus}]",
        "model.n_layer=2",
        "model.n_embd=64",
        "model.head_size=32",
        "train.ctx_len=32",
        "train.micro_batch=4",
        "train.tokens=1280",  # 10 steps
        "train.eval_interval=5",
        "train.eval_tokens=512",
        "train.ckpt_interval=4",
        "train.warmup_tokens=256",
        "train.lr=3e-3",
        *extra,
    ]


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return [r["loss"] for r in rows(run_dir)]


def env():
    """One thread per process, and this checkout's package in every child."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def cli_command(*args, nproc: int = 0, logs: Path | None = None) -> list[str]:
    """`python -m rwkvx_cli ...`, or the same under `torchrun --standalone --nproc_per_node nproc`
    (with `logs`, torchrun writes each rank's stdout and stderr under it instead: `rank_stderr`)."""
    if nproc:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if logs is not None:
            launcher += ["--log-dir", str(logs), "--redirects", "3"]
        launcher += ["-m", "rwkvx_cli"]
    else:
        launcher = ["-m", "rwkvx_cli"]
    return [sys.executable, *launcher, *args]


def run_cli(*args, nproc: int = 0, timeout: float = 300, logs: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_command(*args, nproc=nproc, logs=logs),
        capture_output=True,
        text=True,
        env=env(),
        timeout=timeout,
        cwd=REPO,
    )


def rank_stderr(logs: Path, nproc: int) -> list[str]:
    """Each rank's stderr, in rank order, from the `logs` of one torchrun (run_cli(..., logs=))."""
    texts = []
    for rank in range(nproc):
        (path,) = Path(logs).glob(f"*/attempt_0/{rank}/stderr.log")
        texts.append(path.read_text())
    return texts


def rollback_to(run_dir, step):
    """Delete every checkpoint after `step`, as if the run had died right after it."""
    for ckpt in sorted((Path(run_dir) / "checkpoints").iterdir()):
        if ckpt.name.startswith("step_") and int(ckpt.name.split("_")[1]) > step:
            for f in ckpt.iterdir():
                f.unlink()
            ckpt.rmdir()


@contextlib.contextmanager
def one_thread():
    """Run in this process with the thread count of the child processes (OMP_NUM_THREADS=1), so
    that their losses can be compared bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_line_error(result, code: int) -> str:
    """The one `error: ...` line of a refused CliRunner call, after checking its exit code."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]
