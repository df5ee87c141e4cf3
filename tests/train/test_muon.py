"""train.optimizer=muon and train.lr_schedule=wsd through the trainer: every layer kind trains, a
resume is exact in both checkpoint formats, 2 gloo ranks under DDP and FSDP2 take one process's
steps (to 1e-5 per step over 20 steps), and a resume under another optimizer is refused in one line."""

import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.checkpoints import full
from rwkvx_cli.cli import app
from tests.train.helpers import REPO, env, losses, one_line_error, rollback_to, rows, run_cli, tiny_args

runner = CliRunner()
MUON = ("train.optimizer=muon", "train.lr_schedule=wsd", "train.decay_tokens=512")


def train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


def test_muon_with_wsd_trains_every_layer_kind(tmp_path, corpus):
    run = tmp_path / "run"
    kinds = ("model.layers=rwkv7,moba,rwkv4,gdn,kda,rwkv8", "model.n_layer=5")
    train(*tiny_args(run, corpus, *MUON, *kinds, "train.tokens=2560"))
    got = rows(run)
    assert len(got) == 20
    val = [r["val_loss"] for r in got if r.get("val_loss") is not None]
    assert val[-1] < val[0] - 0.5, val
    lrs = [r["lr"] for r in got]
    assert lrs[4:16] == [3e-3] * 12  # stable after the 256-token warmup until the last 512 tokens
    assert lrs[16:] == sorted(lrs[16:], reverse=True) and lrs[-1] < 1e-3


@pytest.mark.parametrize("fmt, background", [("full", False), ("sharded", False), ("sharded", True)])
def test_a_muon_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, corpus, fmt, background):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    args = (*MUON, f"train.checkpoint_format={fmt}", f"train.async_checkpoint={str(background).lower()}")
    train(*tiny_args(whole, corpus, *args))
    train(*tiny_args(cut, corpus, *args))
    rollback_to(cut, 4)
    result = train(*tiny_args(cut, corpus, *args), "--resume")
    assert "resumed from step 4" in result.output
    assert losses(cut) == losses(whole)  # bit for bit: the momentum buffers came back


def test_a_resume_under_another_optimizer_is_refused_in_one_line(tmp_path, corpus):
    run = tmp_path / "run"
    train(*tiny_args(run, corpus, "train.tokens=512"))
    for extra in ([], ["--allow-change", "train.optimizer"]):
        result = runner.invoke(app, ["train", *tiny_args(run, corpus, "train.optimizer=muon"), "--resume", *extra])
        line = one_line_error(result, 2)
        assert "train.optimizer is 'adamw' in the run's checkpoints, 'muon' now" in line
        assert "start a new run" in line  # the way out: init_from keeps the weights
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000004"


# 8 sequences per step in micro-batches of 2, 20 steps (as tests/train/test_distributed.py, longer).
GLOBAL_BATCH = ("train.micro_batch=2", "train.grad_accum=4", "train.tokens=5120", "train.ckpt_interval=10")


@pytest.mark.slow  # DDP, then FSDP2, on 2 gloo ranks: ~40 s on 2 CPU cores
def test_two_gloo_ranks_take_one_process_s_muon_steps_under_ddp_and_fsdp2(tmp_path, corpus):
    prepared = tmp_path / "prepared"
    assert runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(prepared)]).exit_code == 0
    args = (*MUON, *GLOBAL_BATCH, "train.decay_tokens=1024", "train.eval_interval=100")
    one = tmp_path / "one"
    train(*tiny_args(one, prepared, *args))
    reference = losses(one)
    assert len(reference) == 20 and reference[-1] < reference[0] - 1
    for mode in ("ddp", "fsdp"):
        run = tmp_path / mode
        result = run_cli("train", *tiny_args(run, prepared, *args, f"train.distributed={mode}"), nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        got = losses(run)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, reference, strict=True))
        print(f"{mode}: largest relative loss difference {worst:.1e} over {len(got)} steps")
        assert len(got) == 20 and worst <= 1e-5, (mode, got, reference)


RAGGED = '''
import pathlib, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
from rwkvx_cli.models.optimizer import orthogonalize_all, newton_schulz
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
mesh = init_device_mesh("cpu", (world,))
g = torch.Generator().manual_seed(0)
whole = [torch.randn(s, generator=g) for s in [(5, 7), (64, 16), (2, 40), (33, 33)]]
shards = [distribute_tensor(w, mesh, [Shard(0)]) for w in whole]
for w, o, s in zip(whole, orthogonalize_all(shards, [5] * 4), shards):
    chunk = -(-w.shape[0] // world)
    torch.testing.assert_close(o, newton_schulz(w)[rank * chunk : rank * chunk + s.to_local().shape[0]], rtol=0, atol=0)
pathlib.Path(sys.argv[1], f"rank{rank}").write_text("rows match")  # stdout interleaves across ranks
'''


def test_fsdp2_shards_of_any_row_count_are_orthogonalised_whole(tmp_path):
    """3 ranks, matrices of 5, 64, 2 and 33 rows: each rank gets exactly its rows of the whole matrix's
    Newton-Schulz, including a rank that holds none (2 rows over 3 ranks)."""
    script = tmp_path / "ragged.py"
    script.write_text(RAGGED)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", script, tmp_path],
        capture_output=True, text=True, env=env(), timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(3)] == ["rows match"] * 3


def test_muon_under_bf16_mixed_and_grad_accum_keeps_fp32_momentum(tmp_path, corpus):
    from rwkvx_cli.checkpoints import store

    run = tmp_path / "run"
    train(*tiny_args(run, corpus, *MUON, "train.precision=bf16-mixed", "train.grad_accum=2", "train.micro_batch=2"))
    got = losses(run)
    assert len(got) == 10 and got[-1] < got[0] - 1, got
    ckpt = store.list_checkpoints(run / "checkpoints")[-1]
    state = full.load_optimizer_state(ckpt, store.read_meta(ckpt))
    muon = [g for g in state["param_groups"] if g.get("muon")]
    assert len(muon) == 1 and muon[0]["params"]
    buffers = [state["state"][i]["momentum_buffer"] for i in muon[0]["params"]]
    assert all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in buffers)


@pytest.mark.slow  # compiles the model: minutes on CPU; run by `make test-slow` (CI)
def test_muon_under_train_compile_takes_the_eager_steps(tmp_path, corpus):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train(*tiny_args(eager, corpus, *MUON, "train.tokens=640"))
    args = tiny_args(compiled, corpus, *MUON, "train.tokens=640", "train.compile=true")
    result = run_cli("train", *args, timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    worst = max(abs(a - b) for a, b in zip(losses(compiled), losses(eager), strict=True))
    assert len(losses(compiled)) == 5 and worst < 1e-3, (losses(compiled), losses(eager))


# -- branching a decay (train.decay_from) -------------------------------------------------------------
STABLE = ("train.optimizer=muon", "train.lr_schedule=wsd", "train.tokens=2560", "train.decay_tokens=512")
STABLE += ("train.keep_last=9",)


def test_a_decay_branched_from_a_stable_checkpoint_is_the_run_planned_that_long(tmp_path, corpus):
    """A WSD run's checkpoint at step 8 (1,024 tokens, stable), decayed over 512 tokens in a new run
    directory, takes the steps of a run planned for 1,536 tokens from the start, bit for bit; the source
    run is not touched."""
    source, branch, planned = tmp_path / "source", tmp_path / "branch", tmp_path / "planned"
    train(*tiny_args(source, corpus, *STABLE))
    before = {p: p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file()}
    ckpt = source / "checkpoints" / "step_00000008"
    decay = (f"train.decay_from={ckpt}", "train.ckpt_interval=2")
    result = train(*tiny_args(branch, corpus, *STABLE, *decay))
    said = " ".join(result.stdout.split())
    assert "decaying from" in said and "step_00000008 (step 8, 1.02k tokens) over 512 tokens (1-sqrt)" in said
    train(*tiny_args(planned, corpus, *STABLE, "train.tokens=1536"))
    notes, steps = [r for r in rows(branch) if "event" in r], [r for r in rows(branch) if "event" not in r]
    assert notes == [{"event": "decay", "from": str(ckpt), "step": 8, "tokens": 1024}]
    assert [r["step"] for r in steps] == list(range(9, 13))
    assert [r["loss"] for r in steps] == losses(planned)[8:]
    assert [r["lr"] for r in steps] == [r["lr"] for r in rows(planned)][8:]
    assert {p: p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file()} == before
    # the branch resumes as any run, and its config says where it came from
    rollback_to(branch, 10)
    assert "resumed from step 10" in train(*tiny_args(branch, corpus, *STABLE, *decay), "--resume").output
    assert [r["loss"] for r in rows(branch) if "event" not in r] == losses(planned)[8:]
    assert f"decay_from: {ckpt}" in (branch / "config.yaml").read_text()


def test_a_decay_is_refused_outside_a_stable_phase_in_one_line(tmp_path, corpus):
    cosine, wsd = tmp_path / "cosine", tmp_path / "wsd"
    train(*tiny_args(cosine, corpus, "train.tokens=1024"))
    train(*tiny_args(wsd, corpus, *STABLE))
    cases = [
        (cosine / "checkpoints" / "step_00000004", "is of a cosine run"),
        (wsd / "checkpoints" / "step_00000020", "is outside its run's stable phase"),  # in its decay
        (wsd, "is outside its run's stable phase"),  # a run directory: its newest, the end
    ]
    for ckpt, why in cases:
        result = runner.invoke(app, ["train", *tiny_args(tmp_path / "b", corpus, *STABLE, f"train.decay_from={ckpt}")])
        assert why in one_line_error(result, 2)
        assert not (tmp_path / "b" / "checkpoints").exists()
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "b", corpus, "train.decay_from=x")])
    assert "train.decay_from: branches a warmup-stable-decay run's decay" in one_line_error(result, 2)
