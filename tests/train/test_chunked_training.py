"""`rwkvx train` with chunked full BPTT (train.chunk_len): the losses are full BPTT's, a resume
is bit-exact, and it goes with the hybrid, truncated BPTT and gradient accumulation."""

import pytest
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from tests.train.helpers import losses, rollback_to, tiny_args

runner = CliRunner()


def train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


def test_chunked_training_follows_full_bptt_and_resumes_exactly(tmp_path, corpus):
    full = tmp_path / "full"
    train(*tiny_args(full, corpus))
    chunked = tmp_path / "chunked"
    train(*tiny_args(chunked, corpus, "train.chunk_len=12"))  # windows of 32: chunks of 12, 12, 8
    want, got = losses(full), losses(chunked)
    assert len(got) == 10 and got[-1] < got[0]
    # The same gradients up to fp32 rounding, so the same run: the first step's loss agrees to
    # rounding, and ten AdamW steps later the losses still agree to 1e-4.
    assert abs(got[0] - want[0]) <= 1e-6
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
    rollback_to(chunked, 4)
    result = train(*tiny_args(chunked, corpus, "train.chunk_len=12"), "--resume")
    assert "resumed from step 4" in result.output
    assert losses(chunked) == got  # bit-identical


def test_the_hybrid_trains_chunked_with_tbptt_and_accumulation(tmp_path, corpus):
    args = ("model.n_attn=1", "model.moba_chunk=8", "train.tbptt=true", "train.grad_accum=2", "train.micro_batch=2")
    full = tmp_path / "full"
    train(*tiny_args(full, corpus, *args))
    run = tmp_path / "run"
    train(*tiny_args(run, corpus, *args, "train.chunk_len=10"))  # MoBA chunks of 8 straddle the BPTT chunks
    want, got = losses(full), losses(run)
    assert abs(got[0] - want[0]) <= 1e-6
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
    rollback_to(run, 4)
    train(*tiny_args(run, corpus, *args, "train.chunk_len=10"), "--resume")
    assert losses(run) == got


def test_a_negative_chunk_len_is_one_line_exit_2(tmp_path, corpus):
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "r", corpus, "train.chunk_len=-1")])
    assert result.exit_code == 2 and "train.chunk_len: must be >= 0" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # DDP, then FSDP2, on 2 gloo ranks: ~45 s on 2 CPU cores
def test_ddp_and_fsdp_train_chunked_like_one_process(tmp_path, corpus):
    """Two gloo ranks, DDP and FSDP2, on the hybrid with chunked BPTT: the chunks run inside one
    forward, so each parameter's gradient is summed over them before the ranks reduce it."""
    from tests.train.helpers import run_cli

    prepared = tmp_path / "prepared"
    assert runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(prepared)]).exit_code == 0
    args = ("model.n_attn=1", "model.moba_chunk=8", "train.chunk_len=12", "train.micro_batch=2", "train.grad_accum=4")
    args += ("train.tokens=2560",)
    train(*tiny_args(tmp_path / "one", prepared, *args))
    want = losses(tmp_path / "one")
    for mode in ("ddp", "fsdp"):
        result = run_cli("train", *tiny_args(tmp_path / mode, prepared, *args, f"train.distributed={mode}"), nproc=2)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert f"x 2 ranks ({mode})" in result.stdout
        got = losses(tmp_path / mode)
        assert len(got) == 10 and max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
