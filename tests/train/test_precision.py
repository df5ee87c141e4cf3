"""train.precision (runs/runtime.py): bf16-mixed trains on the CPU and resumes exactly,
fp32 is what the CPU default gives, a precision the device cannot run or an unknown one is a
one-line error before training; and every trainable parameter of every layer kind gets a
gradient, so DDP runs without find_unused_parameters."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import Config, ConfigError, ModelConfig, load_config
from rwkvx_cli.models import parameter_groups
from rwkvx_cli.models.model import build_model
from rwkvx_cli.runs import runtime as precision
from rwkvx_cli.train.distributed import fsdp_policy
from rwkvx_cli.train.runner import run_training
from tests.train.helpers import losses, rollback_to, rows, run_cli, tiny_args

runner = CliRunner()

# 6 steps (ctx 32 x micro-batch 4 = 128 tokens a step), checkpoints at 3 and 6, validation at 3 and 6.
SHORT = ("train.tokens=768", "train.ckpt_interval=3", "train.eval_interval=3", "train.device=cpu")


def train(run_dir, corpus, *extra, resume=False):
    args = ["train", *tiny_args(run_dir, corpus, *SHORT, *extra), *(["--resume"] if resume else [])]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


def test_bf16_mixed_trains_on_the_cpu_and_validates_in_bf16(tmp_path, corpus, monkeypatch):
    seen = []  # (mode, grad enabled) of every forward the loop runs: training steps and validation
    real = precision.autocast

    def spy(mode, device):
        seen.append((mode, torch.is_grad_enabled()))
        return real(mode, device)

    monkeypatch.setattr(precision, "autocast", spy)
    train(tmp_path / "bf16", corpus, "train.precision=bf16-mixed")
    bf16 = rows(tmp_path / "bf16")
    assert len(bf16) == 6
    assert all(math.isfinite(r["loss"]) for r in bf16) and bf16[-1]["loss"] < bf16[0]["loss"] - 0.3
    assert all(math.isfinite(r["val_loss"]) for r in bf16 if r["step"] in (3, 6))
    assert {mode for mode, _ in seen} == {"bf16-mixed"}
    assert any(grad for _, grad in seen) and any(not grad for _, grad in seen)  # training and validation

    # `rwkvx eval` of the checkpoint runs in the run's precision: the last validation, exactly.
    result = runner.invoke(app, ["eval", "--checkpoint", str(tmp_path / "bf16"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss"] == bf16[-1]["val_loss"]

    # Autocast really ran: the fp32 run of the same seed and batches differs, but only a little.
    train(tmp_path / "fp32", corpus, "train.precision=fp32")
    fp32 = losses(tmp_path / "fp32")
    assert [r["loss"] for r in bf16] != fp32
    assert max(abs(r["loss"] - f) for r, f in zip(bf16, fp32, strict=True)) < 0.1


def test_the_cpu_default_is_plain_fp32(tmp_path, corpus):
    """auto on the CPU is fp32: bit for bit the losses of an explicit fp32 run (the behaviour before
    train.precision existed: no autocast on the CPU)."""
    assert Config().train.precision == "auto"
    assert precision.resolve_precision("auto", torch.device("cpu")) == "fp32"
    train(tmp_path / "default", corpus)
    train(tmp_path / "fp32", corpus, "train.precision=fp32")
    assert losses(tmp_path / "default") == losses(tmp_path / "fp32")


def test_bf16_mixed_resume_is_exact(tmp_path, corpus):
    run = tmp_path / "run"
    train(run, corpus, "train.precision=bf16-mixed")
    reference = losses(run)
    rollback_to(run, 3)
    result = train(run, corpus, "train.precision=bf16-mixed", resume=True)
    assert "resumed from step 3" in result.output
    assert losses(run) == reference  # bit-identical: fp32 master weights and optimizer state round-trip


def test_an_unknown_precision_is_a_one_line_exit_2(tmp_path, corpus):
    with pytest.raises(ConfigError, match=r"train.precision: 'fp16' is not one of auto, fp32, bf16-mixed, tf32"):
        load_config(None, ["train.precision=fp16"])
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "run", corpus, "train.precision=bf16")])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "train.precision: 'bf16' is not one of auto, fp32, bf16-mixed, tf32" in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_gpu_without_bf16_is_refused_before_training(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Old GPU")
    cuda = torch.device("cuda", 0)
    with pytest.raises(ConfigError) as e:
        precision.resolve_precision("bf16-mixed", cuda)
    assert str(e.value) == (
        "train.precision: bf16-mixed: this GPU (Old GPU) does not support bfloat16; use train.precision=fp32 (or tf32)"
    )
    assert precision.resolve_precision("auto", cuda) == "fp32"  # auto takes what the GPU can run
    assert precision.resolve_precision("bf16-mixed", cuda, fallback=True) == "fp32"  # rwkvx eval of such a run

    # The run refuses before it touches the run directory, prepares data or builds the model.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_args(run_dir, corpus, "train.precision=bf16-mixed", "train.device=cuda"))
    with pytest.raises(ConfigError, match="does not support bfloat16"):
        run_training(cfg, resume=False)
    assert not run_dir.exists()


def test_tf32_needs_cuda(monkeypatch):
    with pytest.raises(ConfigError, match="^train.precision: tf32 is a CUDA matmul mode; on the CPU use fp32 or bf16"):
        precision.resolve_precision("tf32", torch.device("cpu"))
    assert precision.resolve_precision("tf32", torch.device("cpu"), fallback=True) == "fp32"
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 0))
    with pytest.raises(ConfigError, match=r"tf32: this GPU \(V100\) has no TF32 tensor cores"):
        precision.resolve_precision("tf32", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    assert precision.resolve_precision("tf32", cuda) == "tf32"


def test_matmul_precision_and_fsdp_policy():
    before = torch.get_float32_matmul_precision()
    try:
        precision.set_matmul_precision("tf32")
        assert torch.get_float32_matmul_precision() == "high"
        precision.set_matmul_precision("fp32")
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
    policy = fsdp_policy("bf16-mixed")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_policy("fp32") is None and fsdp_policy("tf32") is None
    assert isinstance(precision.autocast("bf16-mixed", torch.device("cpu")), torch.autocast)


STACKS = {
    "rwkv7": dict(layers=["rwkv7*3"]),
    "rwkv-x": dict(n_layer=4, n_attn=1),  # RWKV-X's rule: moba after the RWKV-7 blocks
    "moba-first": dict(layers=["moba", "rwkv7", "rwkv7"]),
    "rwkv4": dict(layers=["rwkv4*2"]),
    "gdn": dict(layers=["gdn*2"]),
    "kda": dict(layers=["kda*2"]),
    "rwkv8": dict(layers=["rwkv8*2"]),
    "rwkv8-per-head-values": dict(layers=["rwkv8*2"], rwkv8_shared_value=False),
    "mix": dict(layers=["gdn", "rwkv7", "moba", "rwkv4", "kda", "rwkv8", "rwkv7"]),
}


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("stack", list(STACKS))
def test_every_trainable_parameter_gets_a_gradient(stack, mode):
    """What DDP without find_unused_parameters needs: after one backward every parameter that
    requires a gradient has one. Only the first RWKV-7 layer's value-residual weights are frozen,
    and they stay in the state dict (RWKV-LM's layout) and in the optimizer's groups."""
    full = Config(model=ModelConfig(vocab_size=40, n_embd=32, head_size=16, moba_chunk=4, **STACKS[stack]))
    full.validate()  # expands model.layers
    model = build_model(full.model, seed=0)
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with precision.autocast(mode, x.device):
        loss, _ = model(x, None, x, l2wrap=True)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    first = model.kinds.index("rwkv7") if "rwkv7" in model.kinds else None
    assert frozen == ({f"blocks.{first}.att.v{i}" for i in range(3)} if first is not None else set())
    assert frozen <= set(model.state_dict())
    grouped = {id(p) for g in parameter_groups(model, 1e-3, 0.1) for p in g["params"]}
    assert grouped == {id(p) for p in model.parameters()}
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.slow  # two torchrun processes: make test-slow (CI)
def test_fsdp_under_bf16_mixed_matches_one_process(tmp_path, corpus):
    """2 gloo ranks with FSDP2's bf16 MixedPrecisionPolicy (bf16 compute parameters, fp32 reduction)
    track a 1-process bf16-mixed run of the same global batch (bf16 parameters round a little more
    than autocast over fp32 ones, hence the looser bound than fp32's 1e-5)."""
    prepared = tmp_path / "prepared"
    assert runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(prepared)]).exit_code == 0
    batch = ("train.micro_batch=2", "train.grad_accum=4", "train.tokens=1024", "train.precision=bf16-mixed")  # 4 steps
    train(tmp_path / "one", prepared, *batch)
    args = tiny_args(tmp_path / "fsdp", prepared, *SHORT, *batch, "train.distributed=fsdp")
    result = run_cli("train", *args, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(fsdp)" in result.stdout
    one, fsdp = losses(tmp_path / "one"), losses(tmp_path / "fsdp")
    assert len(fsdp) == 4 and all(math.isfinite(v) for v in fsdp) and fsdp[-1] < fsdp[0]
    assert max(abs(a - b) for a, b in zip(one, fsdp, strict=True)) < 2e-2
