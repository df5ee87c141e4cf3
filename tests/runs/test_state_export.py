"""A tuned state leaves rwkvx in the files others read: RWKV-PEFT's state file (`blocks.N.att.time_state`, exactly
one per RWKV-7 block), which the public `rwkv` pip package, given it as its initial state, turns into rwkvx's
logits for the base exported to RWKV-LM's .pth; and rwkvx's own state file, naming its base, which `eval --state`
and `bench --model --state` start from."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from rwkvx_cli.checkpoints.full import save_checkpoint
from rwkvx_cli.cli import app
from rwkvx_cli.config import Config, ModelConfig, config_to_dict
from rwkvx_cli.models import build_model
from rwkvx_cli.runs.opening import open_checkpoint
from tests.data.chats import write_chats
from tests.train.helpers import one_line_error, one_thread

# One worker runs this module (`make test`: xdist --dist loadgroup), so its module fixture `runs`
# (a base run and two state-tuning runs) is built once, not on each worker taking a test.
pytestmark = pytest.mark.xdist_group("state-export")

runner = CliRunner()
TOKENS = [5, 17, 3, 96, 0, 42, 7, 7, 13, 200, 31, 31, 64]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A perturbed RWKV-7 base run (3 layers), and two short state-tuning runs on conversations from it: the
    wkv states alone (`wkv`), and with the token shifts (`shifts`)."""
    root = tmp_path_factory.mktemp("state-export")
    cfg = Config(model=ModelConfig(vocab_size=257, n_layer=3, n_embd=64, head_size=32))
    model = build_model(cfg.model, 0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    save_checkpoint(root / "base" / "checkpoints", 5, model, None, {"config": config_to_dict(cfg)}, 3)
    write_chats(root / "chats.jsonl", 150, seed=2)
    for name, shifts in (("wkv", "false"), ("shifts", "true")):
        args = [
            f"run_dir={root / name}", f"data.corpus=[{root / 'chats.jsonl'}]", f"data.prepared_dir={root / 'data'}",
            f"train.init_from={root / 'base'}", "train.tune=state", f"train.tune_shifts={shifts}",
            "train.sampler=documents", "train.ctx_len=96", "train.micro_batch=4", "train.tokens=2304",
            "train.eval_interval=100", "train.eval_tokens=600", "train.warmup_tokens=0", "train.lr=0.5",
        ]  # fmt: skip
        with one_thread():
            result = runner.invoke(app, ["train", *args])
        assert result.exit_code == 0, result.output
    return root


def export(run, fmt, out, *more):
    return runner.invoke(app, ["export", "--checkpoint", str(run), "--format", fmt, "--out", str(out), *more])


def _pip_rwkv(pth):
    os.environ["RWKV_V7_ON"] = "1"
    os.environ["RWKV_JIT_ON"] = "0"
    os.environ["RWKV_CUDA_ON"] = "0"
    from rwkv.model import RWKV

    return RWKV(model=str(pth)[: -len(".pth")], strategy="cpu fp32")


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def test_the_rwkv_pip_package_started_from_the_exported_state_gives_rwkvx_logits(runs, tmp_path):
    """The base exported to RWKV-LM's .pth, the state to RWKV-PEFT's file: the pip package's RWKV-7 given
    state[i*3+1] = time_state[i] (token shifts zero, as runtimes load a state file) gives the logits rwkvx
    computes from the tuned state, every position of a sequence and token by token (fp32, 1e-5 relative)."""
    assert export(runs / "base", "rwkv-lm", tmp_path / "base.pth").exit_code == 0
    result = export(runs / "wkv", "state", tmp_path / "state.pth")
    assert result.exit_code == 0, result.output
    state_file = torch.load(tmp_path / "state.pth", weights_only=True)  # plain tensors: no pickled code
    assert list(state_file) == [f"blocks.{i}.att.time_state" for i in range(3)]  # exactly n_layer keys
    assert all(t.shape == (2, 32, 32) and t.dtype == torch.float32 for t in state_file.values())
    opened = open_checkpoint(runs / "wkv", tuned=True)
    assert all(torch.equal(state_file[n], p) for n, p in opened.initial.named_parameters())
    assert min(t.abs().max().item() for t in state_file.values()) > 0.1  # trained away from zeros

    ext = _pip_rwkv(tmp_path / "base.pth")
    start = ext.generate_zero_state()
    for i in range(3):
        start[i * 3 + 1] = state_file[f"blocks.{i}.att.time_state"].float()
    with torch.no_grad():
        ours, _ = opened.model(torch.tensor([TOKENS]), opened.initial.expand(1))
        zero, _ = opened.model(torch.tensor([TOKENS]))
        theirs, _ = ext.forward(TOKENS, [t.clone() for t in start], full_output=True)  # forward fills the list
        state, one = [t.clone() for t in start], []
        for t in TOKENS:
            logits, state = ext.forward([t], state)
            one.append(logits)
    assert _relative(ours[0], theirs) <= 1e-5
    assert _relative(ours[0], torch.stack(one)) <= 1e-5
    assert _relative(zero[0], theirs) > 1e-2  # the state changes the logits: the comparison can fail


def test_tuned_token_shifts_reach_the_pip_package_through_rwkvx_state_file(runs, tmp_path):
    """RWKV-PEFT's file holds no token shifts: with train.tune_shifts it is refused (--force: left out, with a
    warning). rwkvx's state file holds them, and the pip package given all three parts of each layer's state
    (state[i*3+0] the time mix's shift, [i*3+2] the channel mix's) gives rwkvx's logits."""
    line = one_line_error(export(runs / "shifts", "state", tmp_path / "s.pth"), 1)
    assert "which RWKV-PEFT's state file cannot hold" in line and "--force" in line
    result = export(runs / "shifts", "state", tmp_path / "s.pth", "--force")
    assert result.exit_code == 0 and "exported anyway (--force)" in result.stderr
    assert len(torch.load(tmp_path / "s.pth", weights_only=True)) == 3
    result = export(runs / "shifts", "state-safetensors", tmp_path / "s.safetensors")
    assert result.exit_code == 0, result.output
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        info = json.loads(f.metadata()["rwkvx_state"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    assert info["shifts"] and info["base"]["weights"] == str(runs / "base" / "checkpoints" / "step_00000005")
    assert len(tensors) == 9 and tensors["blocks.2.ffn.shift_state"].shape == (64,)

    assert export(runs / "base", "rwkv-lm", tmp_path / "base.pth").exit_code == 0
    ext = _pip_rwkv(tmp_path / "base.pth")
    start = ext.generate_zero_state()
    for i in range(3):
        start[i * 3 + 0] = tensors[f"blocks.{i}.att.shift_state"]
        start[i * 3 + 1] = tensors[f"blocks.{i}.att.time_state"]
        start[i * 3 + 2] = tensors[f"blocks.{i}.ffn.shift_state"]
    opened = open_checkpoint(runs / "base", state=tmp_path / "s.safetensors", tuned=True)
    with torch.no_grad():
        ours, _ = opened.model(torch.tensor([TOKENS]), opened.initial.expand(1))
        theirs, _ = ext.forward(TOKENS, [t.clone() for t in start], full_output=True)
    assert _relative(ours[0], theirs) <= 1e-5


def test_eval_starts_from_rwkvx_state_file_of_its_base_and_refuses_another(runs, tmp_path):
    out = tmp_path / "wkv.safetensors"
    assert export(runs / "wkv", "state-safetensors", out, "--dtype", "bf16").exit_code == 0
    with safe_open(out, "pt") as f:
        assert f.get_tensor("blocks.0.att.time_state").dtype == torch.bfloat16
    assert export(runs / "wkv", "state-safetensors", out, "--force").exit_code == 0

    def evaluate(*args):
        result = runner.invoke(app, ["eval", *args, "--json", "--data", str(runs / "data")])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    run = evaluate("--checkpoint", str(runs / "wkv"))
    again = evaluate("--checkpoint", str(runs / "wkv"), "--state", str(out))  # the run's windows, the file's state
    assert run["by_document"] and again["by_document"] and run["tuned_state"] == str(runs / "wkv" / "checkpoints"
                                                                                    / "step_00000006")
    assert again["loss"] == run["loss"] and again["tuned_state"] == str(out)
    # the base run's own settings (its ctx_len and eval_tokens), each document from its start: from zeros, tuned
    zero = evaluate("--checkpoint", str(runs / "base"), "--documents")
    from_file = evaluate("--checkpoint", str(runs / "base"), "--state", str(out))
    assert zero["tuned_state"] is None and zero["documents"] == from_file["documents"] > run["documents"]
    assert from_file["loss"] < zero["loss"]

    other = Config(model=ModelConfig(vocab_size=257, n_layer=3, n_embd=64, head_size=32))
    save_checkpoint(tmp_path / "other" / "checkpoints", 1, build_model(other.model, 1), None,
                    {"config": config_to_dict(other)}, 3)
    result = runner.invoke(app, ["eval", "--checkpoint", str(tmp_path / "other"), "--state", str(out),
                                 "--data", str(runs / "data")])
    assert "its state was tuned for other weights than those at" in one_line_error(result, 1)
    result = runner.invoke(app, ["eval", "--checkpoint", str(runs / "base"), "--state", str(tmp_path / "x.pth")])
    assert "expected rwkvx's state file" in one_line_error(result, 1)
    result = runner.invoke(app, ["eval", "--checkpoint", str(runs / "base"), "--state", str(out), "--by-position"])
    assert "--state goes with the validation figures and --generate" in one_line_error(result, 2)
    result = runner.invoke(app, ["eval", "--checkpoint", str(runs / "wkv"), "--no-documents"])
    assert "a tuned state starts each document" in one_line_error(result, 2)


def test_generation_and_bench_start_from_the_tuned_state(runs, tmp_path):
    out = tmp_path / "wkv.safetensors"
    assert export(runs / "wkv", "state-safetensors", out).exit_code == 0
    samples = {}
    for name, args in (("run", ["--checkpoint", str(runs / "wkv")]),
                       ("file", ["--checkpoint", str(runs / "base"), "--state", str(out)]),
                       ("zero", ["--checkpoint", str(runs / "base")])):
        result = runner.invoke(app, ["eval", *args, "--data", str(runs / "data"), "--json", "--generate", "User:",
                                     "--tokens", "40", "--temperature", "0"])
        assert result.exit_code == 0, result.output
        samples[name] = json.loads(result.stdout)["sample"]
    assert samples["run"] == samples["file"] != samples["zero"]

    cfg = tmp_path / "bench.yaml"
    cfg.write_text(json.dumps({"model": {"vocab_size": 257, "n_layer": 3, "n_embd": 64, "head_size": 32},
                               "train": {"ctx_len": 32, "micro_batch": 2, "tune": "state", "sampler": "documents",
                                         "init_from": str(runs / "base")}}))
    with one_thread():
        result = runner.invoke(app, ["bench", "--model", str(cfg), "--steps", "1", "--state", str(out),
                                     "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    bench = json.loads((tmp_path / "b.json").read_text())
    assert bench["tune"] == "state" and bench["trainable"] == 3 * 2 * 32 * 32 and bench["state"] == str(out)
    assert np.isfinite(bench["step_ms"]) and bench["grads_mb"] == pytest.approx(3 * 2 * 32 * 32 * 4 / 2**20)
    result = runner.invoke(app, ["bench", "--model", str(cfg), "--state", str(out), "--vs-gpt"])
    assert "--vs-gpt does not go with state tuning" in one_line_error(result, 2)

    # --vs-finetune: the same model fully fine-tuned, interleaved; what each keeps between steps
    with one_thread():
        result = runner.invoke(app, ["bench", "--model", str(cfg), "--steps", "1", "--vs-finetune",
                                     "--json", str(tmp_path / "f.json")])
    assert result.exit_code == 0, result.output
    assert "state tuning / full fine-tuning" in result.output
    bench = json.loads((tmp_path / "f.json").read_text())
    full, state = bench["finetune"], 3 * 2 * 32 * 32
    assert full["trainable"] == bench["parameters"] > state == bench["trainable"]
    # AdamW's two moments of the state (and a step count per tensor); a checkpoint adds the state itself
    assert bench["optimizer_mb"] == pytest.approx(2 * state * 4 / 2**20, rel=1e-3)
    assert bench["checkpoint_mb"] == pytest.approx(3 * state * 4 / 2**20, rel=1e-3)
    assert full["checkpoint_mb"] == pytest.approx(full["trainable"] * 4 / 2**20 + full["optimizer_mb"])
    assert full["optimizer_mb"] > 10 * bench["optimizer_mb"]  # the moments of every weight that trains
    ratios = bench["state_over_finetune"]
    assert ratios["checkpoint"] == pytest.approx(bench["checkpoint_mb"] / full["checkpoint_mb"])
    assert ratios["checkpoint"] < 0.1
    assert ratios["step_time"] == pytest.approx(bench["step_ms"] / full["step_ms"])
    plain = tmp_path / "plain.yaml"
    plain.write_text(json.dumps({"model": {"vocab_size": 257, "n_layer": 3, "n_embd": 64, "head_size": 32}}))
    result = runner.invoke(app, ["bench", "--model", str(plain), "--vs-finetune"])
    assert "--vs-finetune compares state tuning with full fine-tuning" in one_line_error(result, 2)


def test_exports_that_do_not_fit_the_checkpoint_are_refused(runs, tmp_path):
    line = one_line_error(export(runs / "base", "state", tmp_path / "x.pth"), 1)
    assert "is no state-tuned run's checkpoint" in line
    line = one_line_error(export(runs / "wkv", "rwkv-lm", tmp_path / "x.pth"), 1)
    assert "holds a tuned initial state, not weights" in line and "step_00000005" in line
    assert not (tmp_path / "x.pth").exists()
