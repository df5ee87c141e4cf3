"""train.checkpoint_format=sharded through the CLI (issue 35): a run that writes sharded checkpoints
computes what a full-format run does and resumes exactly from them, also when a resume switches the
format either way (keep_last counting both); `eval`, `export --format safetensors` and `init --from`
read a sharded checkpoint as they read the full one; a damaged shard is set aside like a damaged
full checkpoint and the previous one used; a checkpoint written by 2 FSDP2 ranks resumes on one
process."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from rwkvx_cli.checkpoints import find, sharded
from rwkvx_cli.checkpoints.full import load_weights
from rwkvx_cli.cli import app
from rwkvx_cli.runs.weights import load_weights_file
from tests.train.helpers import losses, rollback_to, rows, run_cli, tiny_args

# One worker runs this module (`make test`: xdist --dist loadgroup), so its module fixture `runs`
# (the same run written in each format) is built once, not on each worker taking a test.
pytestmark = pytest.mark.xdist_group("sharded-resume")

runner = CliRunner()

# 10 steps with truncated BPTT (so the carry is checkpointed too), checkpoints at 4, 8 and 10.
TBPTT = ("train.tbptt=true",)
SHARDED = "train.checkpoint_format=sharded"
FULL = "train.checkpoint_format=full"


def train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


def names(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """The same 10-step run written in each format: {"full": run dir, "sharded": run dir}."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for fmt in ("full", "sharded"):
        train(*tiny_args(root / fmt, corpus, *TBPTT, f"train.checkpoint_format={fmt}"))
        out[fmt] = root / fmt
    return out


def copy_run(runs, fmt, tmp_path):
    run = tmp_path / fmt
    shutil.copytree(runs[fmt], run)
    return run


def test_a_sharded_run_computes_what_a_full_one_does_and_resumes_exactly(runs, tmp_path, corpus):
    reference = losses(runs["full"])
    assert len(reference) == 10 and losses(runs["sharded"]) == reference  # the format changes nothing computed
    step = runs["sharded"] / "checkpoints" / "step_00000010"
    assert sorted(p.name for p in step.iterdir()) == [
        "extra.safetensors",  # the TBPTT carry, whole
        "index.json",
        "meta.json",
        "shard-00000-of-00001.safetensors",
    ]
    assert sharded.is_sharded(find.verify(step))

    run = copy_run(runs, "sharded", tmp_path)
    rollback_to(run, 4)
    result = train(*tiny_args(run, corpus, *TBPTT, SHARDED), "--resume")
    assert "resumed from step 4" in result.stderr
    assert [r["step"] for r in rows(run)] == list(range(1, 11))
    assert losses(run) == reference
    assert names(run) == ["step_00000004", "step_00000008", "step_00000010"]


def test_a_resume_switches_the_format_either_way_exactly(runs, tmp_path, corpus):
    reference = losses(runs["full"])
    run = copy_run(runs, "full", tmp_path)
    rollback_to(run, 4)  # a full checkpoint, resumed writing sharded ones (no --allow-change needed)
    train(*tiny_args(run, corpus, *TBPTT, SHARDED, "train.keep_last=2"), "--resume")
    assert losses(run) == reference
    ckpts = run / "checkpoints"
    assert names(run) == ["step_00000008", "step_00000010"]  # keep_last counted the full step 4 too
    assert all(sharded.is_sharded(find.verify(ckpts / n)) for n in names(run))

    rollback_to(run, 8)  # a sharded checkpoint, resumed writing full ones
    result = train(*tiny_args(run, corpus, *TBPTT, FULL, "train.keep_last=1"), "--resume")
    assert "resumed from step 8" in result.stderr
    assert losses(run) == reference
    assert names(run) == ["step_00000010"]  # the full save's keep_last removed the sharded step 8
    assert (ckpts / "step_00000010" / "model.safetensors").is_file()
    assert not sharded.is_sharded(find.verify(ckpts / "step_00000010"))


def test_eval_export_and_init_read_a_sharded_checkpoint_as_the_full_one(runs, tmp_path, corpus):
    def evaluate(run):
        result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    full, shard = evaluate(runs["full"]), evaluate(runs["sharded"])
    assert shard["step"] == 10 and shard["loss"] == full["loss"]

    exported = {}
    for fmt, run in runs.items():
        out = tmp_path / f"{fmt}.safetensors"
        result = runner.invoke(app, ["export", "--checkpoint", str(run), "--format", "safetensors", "--out", str(out)])
        assert result.exit_code == 0, result.output
        exported[fmt] = load_file(out)  # one file
    assert sorted(exported["sharded"]) == sorted(exported["full"])
    inside = runs["sharded"] / "checkpoints" / "step_00000010" / "x.safetensors"  # never into a checkpoint
    result = runner.invoke(
        app, ["export", "--checkpoint", str(runs["sharded"]), "--format", "safetensors", "--out", str(inside)]
    )
    assert result.exit_code == 2 and "inside a checkpoint" in result.stderr and not inside.exists()
    for name, t in exported["full"].items():
        assert torch.equal(exported["sharded"][name], t), name

    # train.init_from / init --from: the weights of a sharded checkpoint (or its run), read through the store.
    weights = load_weights_file(runs["sharded"] / "checkpoints" / "step_00000010")
    assert sorted(weights) == sorted(exported["full"])
    assert all(torch.equal(weights[n], t) for n, t in exported["full"].items())
    result = runner.invoke(app, ["init", *tiny_args(tmp_path / "new", corpus), "--from", str(runs["sharded"])])
    assert result.exit_code == 0, result.output
    start = load_weights(tmp_path / "new" / "checkpoints" / "step_00000000")
    assert all(torch.equal(start[n], t) for n, t in exported["full"].items())


def _flip_byte(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 7] ^= 0x40
    path.write_bytes(bytes(raw))


DAMAGE = {
    "flipped byte in a shard": (lambda c: _flip_byte(c / "shard-00000-of-00001.safetensors"), "SHA-256"),
    "truncated shard": (
        lambda c: (c / "shard-00000-of-00001.safetensors").write_bytes(b"\0" * 16),
        "meta.json says",
    ),
    "missing index": (lambda c: (c / "index.json").unlink(), "index.json is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_sharded_checkpoint_is_set_aside_and_the_previous_one_used(runs, tmp_path, corpus, damage):
    reference = losses(runs["sharded"])
    run = copy_run(runs, "sharded", tmp_path)
    ckpts = run / "checkpoints"
    DAMAGE[damage][0](ckpts / "step_00000010")

    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])  # passes over it, leaves it
    assert result.exit_code == 0, result.output
    assert "skipping damaged checkpoint step_00000010" in result.stderr and json.loads(result.stdout)["step"] == 8
    assert (ckpts / "step_00000010").is_dir()

    result = train(*tiny_args(run, corpus, *TBPTT, SHARDED), "--resume")
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "skipping damaged checkpoint step_00000010" in warning[0], result.stderr
    assert DAMAGE[damage][1] in warning[0]
    assert "resumed from step 8" in result.stderr
    assert losses(run) == reference
    assert names(run) == ["corrupt-step_00000010", "step_00000004", "step_00000008", "step_00000010"]


# 8 sequences per step in micro-batches of 2 (tests/train/test_distributed.py): 2 ranks and 1 process
# train on the same global batch. 10 steps.
GLOBAL_BATCH = ("train.micro_batch=2", "train.grad_accum=4", "train.tokens=2560")


def close(got, want) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5


@pytest.mark.slow  # launches on 2, then 1 and 4 ranks: ~35 s on 2 CPU cores
def test_two_ranks_write_sharded_and_resume_on_another_number(tmp_path, corpus):
    """FSDP2 on 2 ranks writes shards; one process resumes from them; 2 DDP ranks resume from them and
    write their own (whole tensors cut in rows); one process resumes from those. Every attempt gives
    the 1-process run's losses (to 1e-5: the ranks reduce in another order, as tests/train/test_distributed.py)."""
    single = tmp_path / "single"
    train(*tiny_args(single, corpus, *GLOBAL_BATCH, *TBPTT))
    reference = losses(single)
    prepared = tmp_path / "prepared"  # a multi-process train does not prepare data
    assert runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(prepared)]).exit_code == 0
    run = tmp_path / "run"
    args = tiny_args(run, prepared, *GLOBAL_BATCH, *TBPTT, SHARDED)

    def torchrun(*extra):
        result = run_cli("train", *args, *extra, nproc=2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result

    def shards(step) -> list[str]:
        return sorted(p.name for p in (run / "checkpoints" / f"step_{step:08d}").glob("shard-*"))

    torchrun("train.distributed=fsdp")
    assert shards(4) == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    two_ranks = losses(run)
    assert close(two_ranks, reference)

    rollback_to(run, 4)  # FSDP2's 2 shards, on one process
    result = train(*args, "--resume")
    assert "resumed from step 4" in result.stderr
    assert losses(run)[:4] == two_ranks[:4] and close(losses(run), reference)
    assert shards(10) == ["shard-00000-of-00001.safetensors"]

    rollback_to(run, 4)  # ... and on 2 DDP ranks, which write their own
    result = torchrun("train.distributed=ddp", "--resume")
    assert "resumed from step 4" in result.stderr and close(losses(run), reference)
    assert shards(8) == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]

    rollback_to(run, 8)  # DDP's 2 shards, on one process
    result = train(*args, "--resume")
    assert "resumed from step 8" in result.stderr and close(losses(run), reference)
