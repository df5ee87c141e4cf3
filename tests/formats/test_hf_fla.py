"""An exported HF directory run by fla's own RWKV7ForCausalLM (flash-linear-attention, loaded by
transformers' AutoModelForCausalLM) gives rwkvx's logits, over a sequence and token by token
with fla's cache. fla and transformers are test extras: without them this module fails to import
(a failure, not a skip).

On a machine without CUDA, fla's Triton kernels run in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1). Triton's autotuner cannot time configs there (it asks for a GPU
driver), so the first config of each kernel is used: launch settings only, the same arithmetic.
fla takes its fused recurrent kernel for inference (no grad, fewer than 64 tokens), the path
checked here; its chunked kernel (training, >= 64 tokens) does not run in the interpreter
(chunk_dplr_fwd_kernel_h calls `.to` on a plain int loop index), so it is not checked on CPU.
"""

import json

import fla  # noqa: F401 - registers model_type rwkv7 with transformers' Auto classes
import pytest
import torch
from transformers import AutoModelForCausalLM

from rwkvx_cli.formats import export_hf, load_hf, materialize
from tests.formats.conftest import perturbed_model


@pytest.fixture
def first_config_autotune(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    if not torch.cuda.is_available():
        prune = Autotuner.prune_configs
        monkeypatch.setattr(Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])


def rel_err(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    return ((theirs - ours).abs().max() / ours.abs().max()).item()


def test_fla_runs_the_export_with_our_logits(rwkv7_cfg, tmp_path, first_config_autotune):
    model = perturbed_model(rwkv7_cfg)
    out = tmp_path / "hf"
    export_hf(model.state_dict(), out, cfg=rwkv7_cfg)
    fla_model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    fla_model.eval()
    assert type(fla_model).__name__ == "RWKV7ForCausalLM"
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # fla builds its group-norm eps from head_dim x norm_eps: the exported config must give rwkvx's.
    assert fla_model.model.layers[1].attn.g_norm.eps == pytest.approx(64e-5)

    tokens = torch.tensor([[5, 17, 3, 96, 0, 42, 7, 7, 13, 200, 256, 1, 64, 64, 9, 128]])
    with torch.no_grad():
        ours, _ = model(tokens)
        seq = fla_model(tokens, use_cache=True).logits
        cache, steps = None, []
        for t in range(tokens.shape[1]):
            step = fla_model(tokens[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps.append(step.logits[:, -1])
    assert rel_err(seq, ours) <= 1e-5
    assert rel_err(torch.stack(steps, dim=1), ours) <= 1e-5
    # Not vacuous: a different model is far off.
    assert rel_err(seq, perturbed_model(rwkv7_cfg, seed=4)(tokens)[0]) > 1e-2


def test_fla_save_pretrained_reads_back_to_our_weights(rwkv7_cfg, tmp_path, first_config_autotune):
    """fla's own writer (transformers' save_pretrained) and our reader agree: its directory loads
    back into exactly the weights we exported (layer 0's unused v0/v1/v2 aside, which come back zero)."""
    model = perturbed_model(rwkv7_cfg)
    sd = model.state_dict()
    export_hf(sd, tmp_path / "ours", cfg=rwkv7_cfg)
    fla_model = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    fla_model.save_pretrained(tmp_path / "theirs")
    back, sizes = load_hf(tmp_path / "theirs")
    assert sizes.n_layer == 2 and sizes.n_embd == 128 and sizes.head_size == 64
    assert set(back) == set(sd)
    for name, t in sd.items():
        if name in ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"):
            assert not back[name].any(), name
        else:
            assert torch.equal(back[name], t), name
    saved = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert saved["decay_low_rank_dim"] == sizes.lora.w and saved["v_low_rank_dim"] == sizes.lora.v


def test_rwkvx_export_hf_of_a_checkpoint_runs_in_fla(rwkv7_cfg, tmp_path, first_config_autotune):
    """The command (`rwkvx export --format hf`), not only the mapping: fla runs what it wrote, and the
    run's byte tokenizer comes along as files transformers reads."""
    from typer.testing import CliRunner

    from rwkvx_cli.checkpoints.full import save_checkpoint
    from rwkvx_cli.cli import app
    from rwkvx_cli.config import Config, config_to_dict
    from rwkvx_cli.data import ByteTokenizer

    model = perturbed_model(rwkv7_cfg)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 3, model, None, {"config": config_to_dict(Config(model=rwkv7_cfg))}, 3)
    ByteTokenizer().save(run / "tokenizer.json")
    (run / "data").mkdir()
    ByteTokenizer().save(run / "data" / "tokenizer.json")
    out = tmp_path / "hf"
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(run), "--format", "hf", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    fla_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 17, 3, 96, 0, 42, 7, 7]])
    with torch.no_grad():
        assert rel_err(fla_model(tokens).logits, model(tokens)[0]) <= 1e-5
    again = CliRunner().invoke(app, ["export", "--checkpoint", str(run), "--format", "hf", "--out", str(out)])
    assert again.exit_code == 2 and "pass --force" in again.stderr



@pytest.mark.parametrize("C,head", [(64, 32), (128, 128)])
def test_fla_runs_other_head_sizes_with_our_logits_both_ways(C, head, tmp_path, first_config_autotune):
    """fla's group-norm eps is head_dim x norm_eps (norm_eps 1e-5, also its LayerNorms'): a model of head size
    32 or 128 with model.ln_x_eps = head_size x 1e-5 goes out as an HF directory fla runs with our logits, and
    fla's own save of it comes back in with that ln_x_eps and the same weights (so the same logits)."""
    from rwkvx_cli.config import ModelConfig
    from rwkvx_cli.formats import config_from_sizes
    from rwkvx_cli.models import LM
    from rwkvx_cli.runs.weights import open_any

    cfg = ModelConfig(vocab_size=97, n_layer=2, n_embd=C, head_size=head, ln_x_eps=head * 1e-5)
    model = perturbed_model(cfg)
    export_hf(model.state_dict(), tmp_path / "out", cfg=cfg)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["head_dim"] == head and written["norm_eps"] == pytest.approx(1e-5, rel=1e-12)
    # torch's norms (fuse_norm false: the same eps rule; fla's fused ones are slow in Triton's interpreter)
    fla_model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, fuse_norm=False).eval()
    assert fla_model.model.layers[1].attn.g_norm.eps == pytest.approx(head * 1e-5, rel=1e-12)
    assert fla_model.model.norm.eps == pytest.approx(1e-5, rel=1e-12)
    tokens = torch.tensor([[5, 17, 3, 96]])
    with torch.no_grad():
        ours, theirs = model(tokens)[0], fla_model(tokens).logits
    assert rel_err(theirs, ours) <= 1e-5

    fla_model.save_pretrained(tmp_path / "fla")
    source, sizes = open_any(tmp_path / "fla")
    with source:
        back_cfg = config_from_sizes(sizes, ModelConfig())
        back = LM(back_cfg).eval()  # built from the config read back, not initialised: the weights come next
        back.load_state_dict(materialize(source))
    assert back_cfg.head_size == head and back_cfg.ln_x_eps == pytest.approx(head * 1e-5, rel=1e-12)
    with torch.no_grad():
        assert torch.equal(back(tokens)[0], ours)
        # Not vacuous: rwkvx's old fixed eps (64e-5) is off by more than the bound.
        for block in back.blocks:
            block.att.ln_x.eps = 64e-5
        assert rel_err(theirs, back(tokens)[0]) > 1e-5
