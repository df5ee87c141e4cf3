"""Data parallelism on CPU: torchrun with 2 gloo processes gives the losses of 1 process with
the same global batch (to 1e-5), with DDP and FSDP2, and resumes across process counts."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import ConfigError
from rwkvx_cli.train import distributed
from rwkvx_cli.train.distributed import DistInfo, from_env
from rwkvx_cli.train.loop import micro_slices
from tests.train.helpers import REPO, env, losses, rank_stderr, rollback_to, rows, run_cli, tiny_args

runner = CliRunner()

# 8 sequences per step in micro-batches of 2: one process accumulates 4, each of 2 ranks 2
# (so the ranks skip the gradient reduction on their first micro-batch). 10 steps.
GLOBAL_BATCH = ("train.micro_batch=2", "train.grad_accum=4", "train.tokens=2560")


def single(run_dir, corpus, *extra):
    result = runner.invoke(app, ["train", *tiny_args(run_dir, corpus, *GLOBAL_BATCH, *extra)])
    assert result.exit_code == 0, result.output
    return losses(run_dir)


def torchrun(run_dir, corpus, *extra, resume=False):
    result = run_cli(
        "train", *tiny_args(run_dir, corpus, *GLOBAL_BATCH, *extra), *(["--resume"] if resume else []), nproc=2
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def assert_close(got, want, tol=1e-5):
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    print(f"largest loss difference {worst:.1e} over {len(got)} steps")
    assert worst <= tol, (worst, got, want)


def test_micro_slices_keep_the_global_batch():
    assert micro_slices(4, 1, 2) == [slice(0, 2), slice(2, 4)]
    assert micro_slices(4, 2, 2) == [slice(0, 2)]  # accumulation drops from 2 to 1
    assert micro_slices(8, 4, 8) == [slice(0, 2)]  # fewer rows per rank than a micro-batch
    assert micro_slices(8, 2, 3) == [slice(0, 3), slice(3, 4)]  # uneven: weighted by rows
    with pytest.raises(ConfigError, match="6 sequences per step do not split evenly over 4 processes"):
        micro_slices(6, 4, 2)


def test_rank_layout_from_torchrun_env():
    assert from_env({}) == DistInfo()
    info = from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (info.rank, info.world_size, info.local_rank, info.launched, info.is_main) == (3, 4, 1, True, False)
    with pytest.raises(ConfigError, match="RANK 4 is not in 0..3"):
        from_env({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.slow  # two torchrun launches and three resumes: ~40 s on 2 CPU cores
def test_two_gloo_processes_match_one_and_resume_across_modes(tmp_path, corpus):
    reference = single(tmp_path / "one", corpus)
    assert len(reference) == 10 and reference[-1] < reference[0]

    # A multi-process train does not prepare data: prepare it once first (the same tokens as above).
    prepared = tmp_path / "prepared"
    assert runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(prepared)]).exit_code == 0
    corpus = prepared
    ddp = tmp_path / "ddp"
    result = torchrun(ddp, corpus)
    assert "x 2 ranks (ddp)" in result.stdout and result.stdout.count("done") == 1  # rank 0 reports
    assert [r["step"] for r in rows(ddp)] == list(range(1, 11))  # one writer: no duplicated lines
    assert sorted(p.name for p in (ddp / "checkpoints").iterdir()) == [
        "step_00000004",
        "step_00000008",
        "step_00000010",
    ]
    assert_close(losses(ddp), reference)

    # The DDP checkpoint at step 4 resumes under FSDP2 (sharded), still matching.
    rollback_to(ddp, 4)
    result = torchrun(ddp, corpus, "train.distributed=fsdp", resume=True)
    assert "resumed from step 4" in result.stderr and "(fsdp)" in result.stdout
    assert [r["step"] for r in rows(ddp)] == list(range(1, 11))
    assert_close(losses(ddp), reference)

    # ... and the FSDP checkpoint at step 8 resumes on a single process.
    rollback_to(ddp, 8)
    result = runner.invoke(app, ["train", *tiny_args(ddp, corpus, *GLOBAL_BATCH), "--resume"])
    assert result.exit_code == 0 and "resumed from step 8" in result.stderr
    assert_close(losses(ddp), reference)


@pytest.mark.slow  # a torchrun launch between two single-process runs: ~22 s on 2 CPU cores
def test_tbptt_carry_is_split_over_ranks_and_gathered_again(tmp_path, corpus):
    run = tmp_path / "run"
    reference = single(run, corpus, "train.tbptt=true")
    # One process's carry (saved as global-batch rows) is split over 2 ranks, which gather it
    # again for their own checkpoints; a single process then finishes the run.
    rollback_to(run, 4)
    torchrun(run, corpus, "train.tbptt=true", resume=True)
    assert_close(losses(run), reference)
    rollback_to(run, 8)
    result = runner.invoke(app, ["train", *tiny_args(run, corpus, *GLOBAL_BATCH, "train.tbptt=true"), "--resume"])
    assert result.exit_code == 0 and "resumed from step 8" in result.stderr
    assert_close(losses(run), reference)


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path, corpus):
    import numpy as np

    from rwkvx_cli.config import load_config
    from rwkvx_cli.data import ByteTokenizer
    from rwkvx_cli.models import build_model
    from rwkvx_cli.train.loop import Trainer

    cfg = load_config(None, tiny_args(tmp_path, corpus, "train.micro_batch=3"))
    tokens = np.arange(1, 200, dtype=np.uint16)
    with pytest.raises(ConfigError, match="= 3 sequences per step do not split evenly over 2 processes"):
        Trainer(cfg, tmp_path, build_model(cfg.model, 0), tokens, tokens, ByteTokenizer(), dist=DistInfo(0, 2))


# -- a refusal on one rank is every rank's one line ---------------------------------------------------
def prepared_data(tmp_path, corpus, *options):
    out = tmp_path / "prepared"
    result = runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(out), *options])
    assert result.exit_code == 0, result.output
    return out


def refused_by_every_rank(tmp_path, run, corpus, *extra) -> str:
    """Train under torchrun with 2 ranks, expecting a start-up refusal: torchrun fails, and each rank's
    stderr is the same one `error:` line, without a traceback; returns that line."""
    logs = tmp_path / "logs"
    result = run_cli("train", *tiny_args(run, corpus, *GLOBAL_BATCH), *extra, nproc=2, logs=logs)
    assert result.returncode != 0, result.stdout[-2000:] + result.stderr[-2000:]
    said = []
    for rank, text in enumerate(rank_stderr(logs, 2)):
        lines = [line for line in text.splitlines() if line.strip()]
        assert "Traceback" not in text and len(lines) == 1 and lines[0].startswith("error:"), (rank, text)
        said.append(lines[0])
    assert said[0] == said[1], said
    return said[0]


def test_a_multi_rank_resume_of_a_run_in_use_stops_every_rank_in_one_line(tmp_path, corpus):
    data = prepared_data(tmp_path, corpus)
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom rwkvx_cli.runs.lock import hold_run\n"
            f"with hold_run({str(run)!r}):\n    print('held', flush=True)\n    time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        # Rank 0 finds the lock taken; rank 1 used to wait for it in a barrier and die of the closed connection.
        line = refused_by_every_rank(tmp_path, run, data, "--resume")
    finally:
        holder.kill()
        holder.wait()
    assert f"is in use by pid {holder.pid}" in line
    assert not (run / "config.yaml").exists()


def test_stale_prepared_data_stops_every_rank_in_one_line(tmp_path, corpus):
    # data.prepared_dir holds the corpus prepared with another seed: rank 0 refuses it while opening the data.
    data = prepared_data(tmp_path, corpus, "--seed", "7")
    line = refused_by_every_rank(tmp_path, tmp_path / "run", corpus, f"data.prepared_dir={data}")
    assert f"{data} was prepared with split seed 7, but the config asks for 0; set data.split_seed=7" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_directory_rwkvx_did_not_make_stops_every_rank_in_one_line(tmp_path, corpus):
    data = prepared_data(tmp_path, corpus)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own\n")
    line = refused_by_every_rank(tmp_path, mine, data)
    assert f"run_dir {mine} already holds files rwkvx did not write (notes.txt)" in line
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_a_metrics_sink_rank_0_cannot_open_stops_every_rank_in_one_line(tmp_path, corpus):
    data = prepared_data(tmp_path, corpus)
    run = tmp_path / "run"
    assert runner.invoke(app, ["init", *tiny_args(run, data, *GLOBAL_BATCH)]).exit_code == 0
    (run / "tensorboard").write_text("not a directory\n")  # only rank 0 opens the sinks, in the loop
    line = refused_by_every_rank(tmp_path, run, data, "train.loggers=[jsonl,tensorboard]")
    assert line == f"error: {run / 'tensorboard'}: File exists"


def _agreeing_rank(rank: int, store: str, out: str) -> None:
    """One of 2 gloo processes (test_one_ranks_failure_is_agreed_by_every_rank): each outcome of
    distributed.agreed as (error class, message, exit code), then rank 0 leaves while rank 1 waits."""
    import torch.distributed as dist

    from rwkvx_cli.errors import RwkvxError, UsageError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    def fail(error):
        raise error

    cases = {
        "fine": lambda: rank * 10,
        "usage on rank 0": lambda: fail(UsageError("bad option")) if rank == 0 else 1,
        "refusal on rank 1": lambda: fail(RwkvxError("stale data")) if rank == 1 else 0,
        "on both": lambda: fail(RwkvxError(f"mine {rank}")),
        "oserror on rank 0": lambda: fail(FileNotFoundError(2, "No such file or directory", "/x")) if rank == 0 else 1,
        "bug on rank 1": lambda: 1 // (1 - rank),
    }
    said = {}
    for name, fn in cases.items():
        try:
            said[name] = ["ok", distributed.agreed(fn), 0]
        except RwkvxError as e:
            said[name] = [type(e).__name__, str(e), e.exit_code]
        except Exception as e:
            said[name] = [type(e).__name__, str(e), None]
    if rank == 1:
        try:
            with distributed.peer_loss_in_one_line():
                dist.barrier()  # rank 0 is gone: gloo's connection closes under this rank
            said["lost"] = ["barrier returned"]
        except Exception as e:
            said["lost"] = [type(e).__name__, str(e)]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(said, f)
    if rank == 1:
        # As the trainer does (runner.train's finally): a gloo group left alive after its peer is gone
        # can abort this process at interpreter exit (std::terminate, ~1 exit in 30 under load).
        distributed.shutdown()
    if rank == 0:
        import os

        os._exit(0)  # without leaving the group: as a rank that stopped on its own error


def test_one_ranks_failure_is_agreed_by_every_rank(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_agreeing_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["fine"] == ["ok", 0, 0] and r1["fine"] == ["ok", 10, 0]
    # The failing rank raises its own error; the other the same line with the same exit code.
    assert r0["usage on rank 0"] == ["UsageError", "bad option", 2]
    assert r1["usage on rank 0"] == ["RankStopped", "bad option", 2]
    assert r0["refusal on rank 1"] == ["RankStopped", "rank 1: stale data", 1]
    assert r1["refusal on rank 1"] == ["RwkvxError", "stale data", 1]
    assert r0["on both"] == ["RwkvxError", "mine 0", 1] and r1["on both"] == ["RwkvxError", "mine 1", 1]
    assert r1["oserror on rank 0"] == ["RankStopped", "/x: No such file or directory", 1]
    # A bug keeps its traceback where it happened; the other rank says where to look.
    assert r1["bug on rank 1"][0] == "ZeroDivisionError"
    assert r0["bug on rank 1"] == [
        "RankStopped",
        "rank 1: ZeroDivisionError: integer division or modulo by zero (a bug: see that rank's traceback)",
        1,
    ]
    # A collective that finds the other rank gone is one line.
    kind, line = r1["lost"]
    assert kind == "RankStopped" and line.startswith("another rank of this run stopped ("), line
    assert "Connection" in line and "gloo" not in line and line.endswith("; its own message says why"), line
    assert not distributed.lost_peer(RuntimeError("a bug of ours")) and not distributed.lost_peer(ValueError("gloo"))
