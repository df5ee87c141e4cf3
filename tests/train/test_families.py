"""Each family's demo config trains: a short run at tiny size lowers the validation
loss, and `rwkvx eval` reads the checkpoint back."""

import json

import pytest
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from tests.train.helpers import REPO, rollback_to, rows

runner = CliRunner()


@pytest.mark.parametrize("family", ["rwkv4", "gdn", "kda", "rwkv8"])
def test_family_demo_config_lowers_validation_loss(tmp_path, corpus, family):
    run = tmp_path / family
    args = [
        "--config",
        str(REPO / "configs" / f"tiny-{family}.yaml"),
        f"run_dir={run}",
        f"data.corpus=[{corpus}]",
        "data.prepared_dir=",
        "model.n_embd=64",
        "model.head_size=32",
        f"model.layers={family}*2",
        "train.ctx_len=32",
        "train.micro_batch=4",
        "train.tokens=3072",  # 24 steps
        "train.eval_interval=4",
        "train.eval_tokens=512",
        "train.ckpt_interval=24",
        "train.warmup_tokens=256",
        "train.lr=3e-3",
    ]
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    val = [r["val_loss"] for r in rows(run) if r.get("val_loss") is not None]
    assert len(val) == 6
    assert val[-1] < val[0] - 0.3, val
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss"] == pytest.approx(val[-1], rel=0.05)
    out = tmp_path / "model.pth"
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--format", "rwkv-lm", "--out", str(out)])
    assert result.exit_code == 1 and f"has {family} blocks" in result.stderr and not out.exists()


def test_tbptt_carries_dict_states_and_resumes_exactly(tmp_path, corpus):
    """The relatives' states (a conv window and S for kda, rho for rwkv8, aa/bb/pp for rwkv4)
    carry across steps under TBPTT and are checkpointed with the run."""
    run = tmp_path / "run"
    args = [
        f"run_dir={run}",
        f"data.corpus=[{corpus}]",
        "model.n_embd=64",
        "model.head_size=32",
        "model.layers=kda,rwkv8,rwkv4,gdn",
        "train.tbptt=true",
        "train.ctx_len=16",
        "train.micro_batch=2",
        "train.tokens=256",  # 8 steps
        "train.eval_interval=8",
        "train.eval_tokens=128",
        "train.ckpt_interval=4",
        "train.warmup_tokens=32",
    ]
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    reference = [r["loss"] for r in rows(run)]
    assert len(reference) == 8
    rollback_to(run, 4)
    result = runner.invoke(app, ["train", *args, "--resume"])
    assert result.exit_code == 0 and "resumed from step 4" in result.output, result.output
    assert [r["loss"] for r in rows(run)] == reference
