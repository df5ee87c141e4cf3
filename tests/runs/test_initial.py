"""train.init_from and `rwkvx init --from`: the model's sizes come from the weights (any layout), a
size the config writes must agree, an RWKV-7 upcycles into a hybrid, and a resume keeps the sizes."""

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.checkpoints import full, store
from rwkvx_cli.cli import app
from rwkvx_cli.config import load_config
from rwkvx_cli.runs.opening import find_checkpoint
from tests.train.helpers import tiny_args

runner = CliRunner()
SHORT = ("train.tokens=256", "train.ckpt_interval=2", "train.eval_interval=2", "train.eval_tokens=64")


def invoke(*args):
    return runner.invoke(app, [*map(str, args)])


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus):
    """A trained RWKV-7 (2 x 64, head 64, with the 0.4B family's kind of LoRA ranks: not the rule)
    and its exports as RWKV-LM .pth and an HF directory."""
    root = tmp_path_factory.mktemp("source")
    ranks = ("model.head_size=64", "model.lora_w=32", "model.lora_a=64", "model.lora_v=32", "model.lora_g=96")
    assert invoke("train", *tiny_args(root / "run", corpus, *SHORT, *ranks)).exit_code == 0
    for fmt, out in (("rwkv-lm", root / "model.pth"), ("hf", root / "hf")):
        result = invoke("export", "--checkpoint", root / "run", "--format", fmt, "--out", out)
        assert result.exit_code == 0, result.output
    return root


def weights_of(run):
    return full.load_weights(store.list_checkpoints(run / "checkpoints")[-1])


@pytest.mark.parametrize("layout", ["run", "model.pth", "hf"])
def test_init_from_reads_the_sizes_of_any_layout(source, tmp_path, corpus, layout):
    run = tmp_path / "new"
    # The config says nothing about the model: the defaults (4 x 128, head 64, rule ranks) give way.
    args = [f"run_dir={run}", f"data.corpus=[{corpus}]", "train.ctx_len=32", "train.micro_batch=4"]
    result = invoke("init", *args, "--from", source / layout)
    assert result.exit_code == 0, result.output
    cfg = find_checkpoint(run).config.model
    assert (cfg.n_layer, cfg.n_embd, cfg.head_size, cfg.vocab_size) == (2, 64, 64, 257)
    assert (cfg.lora_w, cfg.lora_a, cfg.lora_v, cfg.lora_g) == (32, 64, 32, 96)
    assert "weights from" in result.stdout
    ours, theirs = weights_of(run), weights_of(source / "run")
    for name, t in theirs.items():
        if layout == "hf" and name in ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"):
            continue  # fla's layer 0 has no value residual: unused, they come back as zeros
        assert torch.equal(ours[name], t), name


def test_a_written_size_that_disagrees_names_the_tensors(source, tmp_path, corpus):
    result = invoke("init", *tiny_args(tmp_path / "new", corpus, "model.n_embd=128"), "--from", source / "model.pth")
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = result.stderr.strip()
    assert "\n" not in line and "the config says n_embd=128 (the weights: 64)" in line and "emb.weight" in line
    assert not (tmp_path / "new").exists()


def test_an_rwkv7_upcycles_into_a_hybrid(source, tmp_path, corpus):
    run = tmp_path / "hybrid"
    args = tiny_args(run, corpus, "model.n_attn=1", "model.head_size=64")
    result = invoke("init", *args, "--from", source / "model.pth")
    assert result.exit_code == 0, result.output
    assert "upcycle" in result.stdout and "copy" in result.stdout and "fresh" in result.stdout
    assert find_checkpoint(run).config.model.n_attn == 1
    ours, theirs = weights_of(run), weights_of(source / "run")
    for name in ("emb.weight", "head.weight", "blocks.1.att.w1", "blocks.1.ffn.key.weight"):
        assert torch.equal(ours[name], theirs[name]), name
    # The MoBA block (position 2) starts from the RWKV-7 block below it, as RWKV-X's init_moba_from_rwkv.
    for part in ("att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight"):
        assert torch.equal(ours[f"blocks.2.{part}"], theirs[f"blocks.1.{part}"]), part
    assert torch.equal(ours["blocks.2.ln1.weight"], torch.ones(64))  # fresh


def test_a_run_started_from_weights_resumes_with_their_sizes(source, tmp_path, corpus):
    run = tmp_path / "continued"
    args = tiny_args(run, corpus, *SHORT, f"train.init_from={source / 'model.pth'}")
    for a in [a for a in args if a.startswith(("model.n_layer", "model.n_embd", "model.head_size"))]:
        args.remove(a)
    assert invoke("train", *args).exit_code == 0
    before = weights_of(run)
    result = invoke("train", *[a.replace("train.tokens=256", "train.tokens=384") for a in args], "--resume")
    assert result.exit_code == 0, result.output
    assert "resumed from step 2" in result.output
    assert weights_of(run).keys() == before.keys()
    assert load_config(run / "config.yaml").model.n_embd == 64


def test_the_continue_config_takes_its_sizes_from_a_released_style_pth(tmp_path, corpus):
    """configs/continue.yaml has no model section: a World-vocabulary RWKV-7 .pth (RWKV-LM's names,
    shaped as a tiny member of the released family) gives every size."""
    from rwkvx_cli.config import ModelConfig
    from rwkvx_cli.models import build_model

    pth = tmp_path / "RWKV-x070-World-tiny.pth"
    torch.save(build_model(ModelConfig(vocab_size=65536, n_layer=1, n_embd=64, head_size=64), 1).state_dict(), pth)
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"data.corpus=[{corpus}]", f"data.prepared_dir={tmp_path / 'data'}"]
    args += ["train.ctx_len=32", "train.micro_batch=2", "train.warmup_tokens=0"]
    result = invoke("init", "-c", "configs/continue.yaml", *args, "--from", pth)
    assert result.exit_code == 0, result.output
    cfg = find_checkpoint(run).config
    assert (cfg.model.vocab_size, cfg.model.n_layer, cfg.model.n_embd, cfg.data.tokenizer) == (65536, 1, 64, "world")



def test_an_hf_model_of_head_size_32_keeps_its_group_norm_eps_through_init_resume_and_export(tmp_path, corpus):
    """fla's g_norm eps is head_dim x norm_eps: an HF directory of head size 32 comes in with
    model.ln_x_eps 32e-5, which the run's config.yaml and checkpoint keep, a resume with the same
    train.init_from keeps (its config does not write it), a run started from that run inherits, and
    the hf export writes back as norm_eps 1e-5."""
    import json

    from rwkvx_cli.checkpoints.manager import resume_changes
    from rwkvx_cli.config import ModelConfig
    from rwkvx_cli.formats import export_hf
    from rwkvx_cli.models import build_model
    from rwkvx_cli.runs.initial import sizes_from

    cfg = ModelConfig(vocab_size=257, n_layer=2, n_embd=64, head_size=32, ln_x_eps=32e-5)
    export_hf(build_model(cfg, 1).state_dict(), tmp_path / "hf", cfg=cfg)
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"data.corpus=[{corpus}]", f"data.prepared_dir={tmp_path / 'data'}"]
    args += ["train.ctx_len=32", "train.micro_batch=4"]
    result = invoke("init", *args, "--from", tmp_path / "hf")
    assert result.exit_code == 0, result.output
    saved = find_checkpoint(run).config
    assert saved.model.ln_x_eps == pytest.approx(32e-5, rel=1e-12)
    assert load_config(run / "config.yaml").model.ln_x_eps == saved.model.ln_x_eps
    # `train --resume` with the same config and init_from: the sizes (and eps) the weights gave are kept.
    again = load_config(None, [*args, f"train.init_from={saved.train.init_from}"])
    again.model = sizes_from(saved.model, again)
    assert again.model.ln_x_eps == saved.model.ln_x_eps and resume_changes(saved, again) == {}

    child = tmp_path / "child"
    result = invoke("init", *[a.replace(str(run), str(child)) for a in args], "--from", run)
    assert result.exit_code == 0, result.output
    assert find_checkpoint(child).config.model.ln_x_eps == pytest.approx(32e-5, rel=1e-12)
    result = invoke("export", "--checkpoint", run, "--format", "hf", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    stated = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (stated["head_dim"], stated["norm_eps"]) == (32, pytest.approx(1e-5, rel=1e-12))


def _flip_byte(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 7] ^= 0x40
    path.write_bytes(bytes(raw))


def _run_of_two_checkpoints(root, fmt):
    """A run directory with checkpoints at steps 2 and 4 (written in `fmt`), each its step in every value of
    emb.weight; the newest then damaged by a flipped byte."""
    from rwkvx_cli.checkpoints import sharded
    from rwkvx_cli.config import Config, ModelConfig, config_to_dict
    from rwkvx_cli.models import LM

    cfg = Config(run_dir=str(root), model=ModelConfig(n_layer=1, n_embd=32, head_size=32))
    model = LM(cfg.model)
    for step in (2, 4):
        with torch.no_grad():
            model.emb.weight.fill_(step)
        save = full.save_checkpoint if fmt == "full" else sharded.save_sharded
        save(root / "checkpoints", step, model, None, {"config": config_to_dict(cfg)}, 3)
    newest = root / "checkpoints" / "step_00000004"
    _flip_byte(newest / ("model.safetensors" if fmt == "full" else "shard-00000-of-00001.safetensors"))
    return root


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_init_from_a_run_passes_over_a_damaged_newest_checkpoint_with_a_warning_and_names_the_step(
    tmp_path, corpus, fmt
):
    """`init --from RUN` finds its checkpoint as eval and export do (find.latest_good): a damaged newest one is
    reported, left where it is, and the one started from named by its step."""
    source = _run_of_two_checkpoints(tmp_path / "source", fmt)
    run = tmp_path / "new"
    args = [f"run_dir={run}", f"data.corpus=[{corpus}]", "train.ctx_len=32", "train.micro_batch=4"]
    result = invoke("init", *args, "--from", source)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "skipping damaged checkpoint step_00000004" in warnings[0], result.stderr
    assert "SHA-256" in warnings[0]
    assert f"weights from {source}, step 2 (" in " ".join(result.stdout.split())
    assert torch.equal(weights_of(run)["emb.weight"], torch.full((257, 32), 2.0))
    assert (source / "checkpoints" / "step_00000004").is_dir()  # a reader reports damage; only --resume sets it aside


def test_train_init_from_a_run_passes_over_a_damaged_newest_checkpoint_with_a_warning(tmp_path, corpus):
    source = _run_of_two_checkpoints(tmp_path / "source", "full")
    run = tmp_path / "new"
    args = [f"run_dir={run}", f"data.corpus=[{corpus}]", "train.ctx_len=32", "train.micro_batch=4"]
    args += ["train.tokens=128", "train.eval_tokens=64", f"train.init_from={source}"]
    result = invoke("train", *args)
    assert result.exit_code == 0, result.output
    assert "skipping damaged checkpoint step_00000004" in result.stderr
    assert f"weights from {source}, step 2 (" in " ".join(result.stdout.split())
