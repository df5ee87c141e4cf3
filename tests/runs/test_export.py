"""Export round trips: RWKV-LM's .pth read back by the public `rwkv` pip package
gives the logits of our model; safetensors keeps every tensor bit for bit."""

import os

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from rwkvx_cli.checkpoints.full import save_checkpoint
from rwkvx_cli.cli import app
from rwkvx_cli.config import Config, ModelConfig, config_to_dict
from rwkvx_cli.models import build_model

runner = CliRunner()


@pytest.fixture
def trained_like_run(tmp_path):
    """A checkpoint of a model whose weights are all perturbed away from init."""
    cfg = Config(model=ModelConfig(vocab_size=97, n_layer=3, n_embd=128, head_size=64))
    model = build_model(cfg.model, 0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    save_checkpoint(tmp_path / "run" / "checkpoints", 5, model, None, {"config": config_to_dict(cfg)}, 3)
    return tmp_path / "run", model


def test_rwkv_lm_export_runs_in_the_rwkv_pip_package(trained_like_run, tmp_path):
    run, model = trained_like_run
    out = tmp_path / "model.pth"
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--format", "rwkv-lm", "--out", str(out)])
    assert result.exit_code == 0, result.output
    sd = torch.load(out, weights_only=True)
    assert set(sd) == set(model.state_dict())

    os.environ["RWKV_V7_ON"] = "1"
    os.environ["RWKV_JIT_ON"] = "0"
    os.environ["RWKV_CUDA_ON"] = "0"
    from rwkv.model import RWKV

    ext = RWKV(model=str(out)[: -len(".pth")], strategy="cpu fp32")
    tokens = [5, 17, 3, 96, 0, 42, 7, 7, 13]
    with torch.no_grad():
        ours, _ = model(torch.tensor([tokens]))
        theirs_seq, _ = ext.forward(tokens, None, full_output=True)
        state, theirs_one = None, []
        for t in tokens:
            logits, state = ext.forward([t], state)
            theirs_one.append(logits)
    torch.testing.assert_close(theirs_seq, ours[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(theirs_one), ours[0], rtol=1e-4, atol=1e-4)


def test_safetensors_export_is_exact(trained_like_run, tmp_path):
    run, model = trained_like_run
    out = tmp_path / "model.safetensors"
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--format", "safetensors", "--out", str(out)])
    assert result.exit_code == 0, result.output
    tensors = load_file(out)
    for name, t in model.state_dict().items():
        assert torch.equal(tensors[name], t), name


def test_export_refuses_bad_requests(trained_like_run, tmp_path):
    run, _ = trained_like_run
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--format", "onnx", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "'onnx' is not one of 'rwkv-lm', 'safetensors'" in result.stderr
    result = runner.invoke(app, ["export", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and "no checkpoint found" in result.stderr
    assert not (tmp_path / "x").exists()


def test_export_warns_when_it_passes_over_a_damaged_checkpoint(trained_like_run, tmp_path):
    run, model = trained_like_run
    cfg = Config(model=ModelConfig(vocab_size=97, n_layer=3, n_embd=128, head_size=64))
    save_checkpoint(run / "checkpoints", 7, model, None, {"config": config_to_dict(cfg)}, 3)
    weights = run / "checkpoints" / "step_00000007" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # torn by a crash
    out = tmp_path / "model.safetensors"
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--format", "safetensors", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "skipping damaged checkpoint step_00000007" in result.stderr and "step 5" in result.stdout


def test_ctrl_c_outside_training_is_one_line_and_exit_130(trained_like_run, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("rwkvx_cli.runs.export.export_checkpoint", interrupted)
    run, _ = trained_like_run
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--out", str(tmp_path / "m.pth")])
    assert result.exit_code == 130 and result.stderr.strip() == "interrupted"
    assert "Traceback" not in result.output


def export(run, fmt, out, *more):
    return runner.invoke(app, ["export", "--checkpoint", str(run), "--format", fmt, "--out", str(out), *more])


def test_a_pth_export_refuses_a_group_norm_eps_its_readers_do_not_use(tmp_path):
    """RWKV-LM's and RWKV-X's .pth hold no config and their readers use ln_x eps 64e-5: a model with
    another model.ln_x_eps is refused in one line (--force: exported, with a warning); hf and
    safetensors carry it."""
    cfg = Config(model=ModelConfig(vocab_size=97, n_layer=1, n_embd=64, head_size=64, ln_x_eps=1e-3))
    meta = {"config": config_to_dict(cfg)}
    save_checkpoint(tmp_path / "run" / "checkpoints", 1, build_model(cfg.model, 0), None, meta, 3)
    for fmt in ("rwkv-lm", "rwkv-x"):
        out = tmp_path / f"{fmt}.pth"
        result = export(tmp_path / "run", fmt, out)
        assert result.exit_code == 1 and not out.exists(), result.output
        line = result.stderr.strip()
        assert "\n" not in line and "Traceback" not in result.output
        assert f"model.ln_x_eps is 0.001, but the {fmt} .pth holds no config" in line and "--force" in line
        result = export(tmp_path / "run", fmt, out, "--force")
        assert result.exit_code == 0 and out.is_file(), result.output
        assert "exported anyway (--force): model.ln_x_eps is 0.001" in result.stderr
    out = tmp_path / "model.safetensors"
    result = export(tmp_path / "run", "safetensors", out)
    assert result.exit_code == 0, result.output
    from rwkvx_cli.runs.weights import open_any

    source, sizes = open_any(out)
    source.close()
    assert sizes.ln_x_eps == 1e-3  # the safetensors export's config, read back by train.init_from


def test_a_checkpoint_from_before_ln_x_eps_loads_with_the_default(tmp_path):
    from rwkvx_cli.runs.opening import find_checkpoint
    from rwkvx_cli.runs.weights import open_any

    cfg = Config(model=ModelConfig(vocab_size=97, n_layer=1, n_embd=64, head_size=64))
    old = config_to_dict(cfg)
    del old["model"]["ln_x_eps"]
    save_checkpoint(tmp_path / "run" / "checkpoints", 1, build_model(cfg.model, 0), None, {"config": old}, 3)
    assert find_checkpoint(tmp_path / "run").config.model.ln_x_eps == 64e-5
    source, sizes = open_any(tmp_path / "run")
    source.close()
    assert sizes.ln_x_eps is None  # the config's own (the default) stays
    result = export(tmp_path / "run", "rwkv-lm", tmp_path / "m.pth")
    assert result.exit_code == 0, result.output


def test_a_full_disk_names_the_output_and_what_is_intact(trained_like_run, tmp_path, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    run, _ = trained_like_run
    out = tmp_path / "m.pth"
    monkeypatch.setattr("rwkvx_cli.runs.export.torch.save", full)
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == (
        f"error: cannot write {out}: No space left on device; nothing was written there; the checkpoint is intact"
    )
    assert list(tmp_path.iterdir()) == [run]  # no temporary file left
    out.write_bytes(b"an earlier export")
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--out", str(out), "--force"])
    assert result.exit_code == 1 and "the file that was there is unchanged" in result.stderr
    assert out.read_bytes() == b"an earlier export"
    monkeypatch.setattr("rwkvx_cli.formats.hf.write_shards", full)  # the hf directory's safetensors
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert result.stderr.strip().startswith(f"error: cannot write {tmp_path / 'hf'}: No space left on device; nothing")
