"""Data parallelism on CPU: torchrun with 2 gloo processes gives the losses of 1 process with
the same global batch (to 1e-5), with DDP and FSDP2, and resumes across process counts."""

import pytest
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import ConfigError
from rwkvx_cli.train.distributed import DistInfo, from_env
from rwkvx_cli.train.loop import micro_slices
from tests.train.helpers import losses, rollback_to, rows, run_cli, tiny_args

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
