"""Round trips through both formats (bit for bit), the shard writer against safetensors' own
reader, atomic output directories, and every refusal as one line."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.errors import UsageError
from rwkvx_cli.formats import (
    FormatError,
    OutputExistsError,
    SizeMismatchError,
    export_hf,
    export_rwkv_x,
    from_rwkv_x,
    materialize,
    moba_topk_from_rwkv_x,
    moba_topk_to_rwkv_x,
    open_hf,
    open_rwkv_x,
    open_tensors,
    to_rwkv_x,
)
from rwkvx_cli.formats import write as wr
from rwkvx_cli.formats.hf import from_hf, to_hf
from rwkvx_cli.formats.tensors import SafetensorsFiles
from rwkvx_cli.models.model import LM
from rwkvx_cli.runs.weights import open_any
from tests.formats.conftest import perturbed_model

UNUSED = ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2")
TOKENS = torch.tensor([[5, 17, 3, 96, 0, 42, 7, 7, 13, 200, 256, 1, 64, 64, 9, 128]])


def logits_of(cfg, sd):
    model = LM(cfg)
    model.load_state_dict(sd)
    with torch.no_grad():
        return model.eval()(TOKENS)[0]


def test_rwkvx_hf_rwkvx_is_bit_exact_and_sharded(rwkv7_cfg, tmp_path):
    model = perturbed_model(rwkv7_cfg)
    sd = model.state_dict()
    out = tmp_path / "hf"
    summary = export_hf(sd, out, cfg=rwkv7_cfg, max_shard_bytes=300_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert summary["left_out"] == list(UNUSED)
    # safetensors' own reader reads every shard, and our reader returns the same tensors.
    theirs = {}
    for f in shards:
        with safe_open(str(out / f), "pt") as fh:
            assert fh.metadata()["format"] == "pt"
        theirs.update(load_file(out / f))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in theirs.values())
    assert set(theirs) == set(index["weight_map"])
    assert theirs["model.layers.1.attn.w_lora.lora.0.weight"].shape == sd["blocks.1.att.w1"].t().shape
    source, sizes = open_hf(out)
    back = materialize(source)
    source.close()
    assert list(back) == list(sd) and sizes.n_layer == 2
    for name, t in sd.items():
        assert torch.equal(back[name], t) if name not in UNUSED else not back[name].any(), name
    assert torch.equal(logits_of(rwkv7_cfg, back), logits_of(rwkv7_cfg, sd))


def test_hf_export_in_bf16_and_unsharded(rwkv7_cfg, tmp_path):
    sd = perturbed_model(rwkv7_cfg).state_dict()
    export_hf(sd, tmp_path / "hf", dtype="bf16")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back, _ = open_hf(tmp_path / "hf")
    assert all(torch.equal(back.get(n), sd[n].bfloat16()) for n in sd if n not in UNUSED)


def test_in_memory_hf_round_trip(rwkv7_cfg):
    sd = perturbed_model(rwkv7_cfg).state_dict()
    hf = to_hf(sd)
    assert hf["model.layers.0.attn.k_k"].shape == (128,) and "model.layers.0.attn.v_lora.lora.0.weight" not in hf
    back = from_hf(hf)
    assert all(torch.equal(back[n], sd[n]) for n in sd if n not in UNUSED)


def test_tied_embeddings_are_read_as_the_head(rwkv7_cfg, tmp_path):
    sd = perturbed_model(rwkv7_cfg).state_dict()
    sd["head.weight"] = sd["emb.weight"].clone()
    out = tmp_path / "hf"
    export_hf(sd, out)
    st = load_file(out / "model.safetensors")
    del st["lm_head.weight"]
    from safetensors.torch import save_file

    save_file(st, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    back, _ = open_hf(out)
    assert torch.equal(back.get("head.weight"), sd["emb.weight"])


def test_rwkvx_rwkv_x_rwkvx_is_bit_exact(hybrid_cfg, tmp_path):
    sd = perturbed_model(hybrid_cfg).state_dict()
    out = tmp_path / "x.pth"
    export_rwkv_x(sd, out, cfg=hybrid_cfg)
    raw = torch.load(out, weights_only=True)
    assert "rwkv.blocks.3.ln1.weight" in raw and "moba.1.ffn.x_k" in raw and "rwkv.blocks.0.ln0.weight" in raw
    # rwkvx block 5 (the second MoBA) is RWKV-X's moba.1; block 4 is its rwkv.blocks.3.
    assert torch.equal(raw["moba.1.att.key.weight"], sd["blocks.5.att.key.weight"])
    assert torch.equal(raw["rwkv.blocks.3.att.w1"], sd["blocks.4.att.w1"])
    source, sizes = open_rwkv_x(out)
    back = materialize(source)
    assert list(back) == list(sd) and all(torch.equal(back[n], sd[n]) for n in sd)
    assert (sizes.n_layer, sizes.n_attn, sizes.moba_chunk) == (4, 2, None) and sizes.layers == []
    assert torch.equal(logits_of(hybrid_cfg, back), logits_of(hybrid_cfg, sd))
    assert list(from_rwkv_x(to_rwkv_x(sd))) == list(sd)


def test_moba_top_k_conventions():
    assert [moba_topk_to_rwkv_x(k) for k in (-1, 0, 1, 2, 23)] == [1, 1, 2, 3, 24]
    assert [moba_topk_from_rwkv_x(k) for k in (1, 2, 3, 24)] == [0, 1, 2, 23]


@pytest.mark.parametrize(
    "cfg,message",
    [
        (ModelConfig(vocab_size=97, n_layer=5, n_embd=64, head_size=64, n_attn=2), "would never run the top 1"),
        (ModelConfig(vocab_size=97, n_layer=4, n_embd=64, head_size=32, n_attn=2), "assumes 64"),
        (ModelConfig(vocab_size=97, n_embd=64, head_size=64, layers=["moba", "rwkv7", "rwkv7"]), "first block is MoBA"),
        (ModelConfig(vocab_size=97, n_embd=64, head_size=64, layers=["rwkv7", "moba", "rwkv7"]), "rwkv7,moba,rwkv7"),
        (ModelConfig(vocab_size=97, n_embd=64, head_size=64, layers=["rwkv7", "gdn"]), "block 1 is neither"),
    ],
)
def test_rwkv_x_refuses_stacks_it_would_read_differently(cfg, message, tmp_path):
    from rwkvx_cli.config import expand_layers

    cfg.layers = expand_layers(cfg.layers)
    sd = LM(cfg).state_dict()
    with pytest.raises(FormatError, match=message) as e:
        export_rwkv_x(sd, tmp_path / "x.pth")
    assert "\n" not in str(e.value) and not (tmp_path / "x.pth").exists()


def test_rwkv_x_import_refuses_leftover_blocks():
    sd = LM(ModelConfig(vocab_size=97, n_layer=4, n_embd=64, head_size=64, n_attn=2)).state_dict()
    x = to_rwkv_x(sd)
    x.update({k.replace("rwkv.blocks.3.", "rwkv.blocks.4."): v for k, v in x.items() if k.startswith("rwkv.blocks.3.")})
    with pytest.raises(FormatError, match="never runs the top 1"):
        from_rwkv_x(x)


@pytest.mark.parametrize(
    "cfg,message",
    [
        (
            ModelConfig(vocab_size=97, n_layer=2, n_embd=128, head_size=32),  # ln_x_eps 64e-5 would need norm_eps 2e-5
            r"model.ln_x_eps 0.00064 at head size 32: .* the hf format holds ln_x_eps = 32 x 1e-05 = 0.00032 only",
        ),
        (
            ModelConfig(vocab_size=97, n_layer=2, n_embd=128, head_size=64, ln_x_eps=1e-3),
            r"model.ln_x_eps 0.001 at head size 64: .* = 0.00064 only",
        ),
        (ModelConfig(vocab_size=97, n_layer=2, n_embd=128, head_size=64, n_attn=1), "plain RWKV-7 models; this one"),
    ],
)
def test_hf_refuses_what_fla_cannot_compute_alike(cfg, message, tmp_path):
    with pytest.raises(FormatError, match=message) as e:
        export_hf(LM(cfg).state_dict(), tmp_path / "hf", cfg=cfg)
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"norm_eps": 1e-6}, "norm_eps"),
        ({"head_dim": 128, "num_heads": 1}, r"disagrees with the tensors: head_size 128 \(the tensors: 64\)"),
        ({"head_dim": 48}, "head_dim 48 does not divide hidden_size 128"),
        ({"attn": {"layers": [1]}}, "softmax-attention"),
        ({"model_type": "rwkv6"}, "not 'rwkv7'"),
        ({"intermediate_size": 400}, "disagrees with the tensors: ffn_size 400"),
        ({"decay_low_rank_dim": 64}, "lora"),
        ({"hidden_act": "relu"}, "sqrelu"),
    ],
)
def test_hf_config_refusals(edit, message, rwkv7_cfg, tmp_path):
    out = tmp_path / "hf"
    export_hf(LM(rwkv7_cfg).state_dict(), out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(FormatError, match=message) as e:
        open_hf(out)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("head,eps", [(32, 32e-5), (64, 64e-5), (128, 128e-5)])
def test_hf_directories_of_any_head_size_come_in_with_their_group_norm_eps(head, eps, tmp_path):
    """fla's g_norm eps is head_dim x norm_eps: it comes in as model.ln_x_eps (which the model's ln_x
    then uses) and goes out as norm_eps = ln_x_eps / head_dim, the same config.json."""
    from rwkvx_cli.formats import config_from_sizes
    from rwkvx_cli.models import build_model

    cfg = ModelConfig(vocab_size=97, n_layer=2, n_embd=128, head_size=head, ln_x_eps=eps)
    export_hf(LM(cfg).state_dict(), tmp_path / "hf", cfg=cfg)
    stated = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert stated["head_dim"] == head and stated["norm_eps"] == pytest.approx(1e-5, rel=1e-12)
    source, sizes = open_any(tmp_path / "hf")
    source.close()
    got = config_from_sizes(sizes, ModelConfig())
    assert got.head_size == head and got.ln_x_eps == pytest.approx(eps, rel=1e-12)
    assert build_model(got, 0).blocks[1].att.ln_x.eps == got.ln_x_eps
    export_hf(LM(got).state_dict(), tmp_path / "again", cfg=got)
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == stated
    # A config that writes another ln_x_eps than the directory's is refused, in one line.
    with pytest.raises(FormatError, match=r"the config says ln_x_eps=0.001, the weights' \(hf\)") as e:
        config_from_sizes(sizes, ModelConfig(ln_x_eps=1e-3), written={"ln_x_eps"})
    assert "\n" not in str(e.value)


def test_export_checks_the_config_it_is_given(rwkv7_cfg, tmp_path):
    sd = LM(rwkv7_cfg).state_dict()
    wrong = ModelConfig(vocab_size=257, n_layer=3, n_embd=128, head_size=64)
    with pytest.raises(
        SizeMismatchError, match=r"^the config says n_layer=3 \(the weights: 2\): blocks.2.ln1.weight missing"
    ):
        export_hf(sd, tmp_path / "hf", cfg=wrong)


def test_output_directory_is_whole_or_absent(rwkv7_cfg, tmp_path, monkeypatch):
    sd = LM(rwkv7_cfg).state_dict()
    out = tmp_path / "hf"
    calls = []
    real = wr.write_safetensors

    def fail_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(wr, "write_safetensors", fail_on_second)
    with pytest.raises(OSError):
        export_hf(sd, out, max_shard_bytes=300_000)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    export_hf(sd, out)
    with pytest.raises(OutputExistsError, match="not empty; pass --force"):
        export_hf(sd, out)
    export_hf(sd, out, force=True, max_shard_bytes=300_000)  # replaces an export
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="no config.json"):
        export_hf(sd, other, force=True)
    assert (other / "todo.txt").read_text() == "mine"
    export_rwkv_x(sd, tmp_path / "x.pth")
    with pytest.raises(UsageError, match="already exists"):  # the guard of every output file (fsio)
        export_rwkv_x(sd, tmp_path / "x.pth")


def test_mapped_reader_matches_safe_open(hybrid_cfg, tmp_path):
    sd = perturbed_model(hybrid_cfg).state_dict()
    sd["extra.bf16"] = torch.randn(3, 5).bfloat16()
    sd["extra.odd"] = torch.randn(7).half()
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "m.safetensors")
    ours = SafetensorsFiles([tmp_path / "m.safetensors"])
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as fh:
        assert sorted(ours.names()) == sorted(fh.keys())
        for name in fh.keys():
            t = ours.get(name)
            assert t.dtype == fh.get_tensor(name).dtype and torch.equal(t, fh.get_tensor(name)), name
            ours.release(name)
            assert torch.equal(t, sd[name])  # still readable after its pages are dropped
    ours.close()


def test_truncated_and_foreign_files_are_one_line(tmp_path, rwkv7_cfg):
    from safetensors.torch import save_file

    save_file(LM(rwkv7_cfg).state_dict(), tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="truncated"):
        open_tensors(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(FormatError, match="not JSON"):
        open_tensors(tmp_path / "junk.safetensors")

    torch.save({"w": torch.zeros(2), "obj": Opaque()}, tmp_path / "code.pth")
    with pytest.raises(FormatError, match="never unpickles code") as e:
        open_tensors(tmp_path / "code.pth")
    assert "\n" not in str(e.value)


class Opaque:
    pass


def test_open_any_reads_every_layout(rwkv7_cfg, hybrid_cfg, tmp_path):
    sd = perturbed_model(rwkv7_cfg).state_dict()
    torch.save(sd, tmp_path / "rwkv-lm.pth")  # RWKV-LM's .pth: rwkvx names, tensors only
    export_hf(sd, tmp_path / "hf")
    hyb = perturbed_model(hybrid_cfg).state_dict()
    export_rwkv_x(hyb, tmp_path / "x.pth")
    from safetensors.torch import save_file

    save_file(hyb, tmp_path / "rwkvx.safetensors")
    from rwkvx_cli.checkpoints.full import save_checkpoint
    from rwkvx_cli.config import Config, config_to_dict

    save_checkpoint(
        tmp_path / "run" / "checkpoints", 5, hyb, None, {"config": config_to_dict(Config(model=hybrid_cfg))}, 3
    )
    for path, layout, kinds, want in (
        ("run", "rwkvx", ["rwkv7", "rwkv7", "moba"] * 2, hyb),
        ("rwkv-lm.pth", "rwkv-lm", ["rwkv7"] * 2, sd),
        ("hf", "hf", ["rwkv7"] * 2, sd),
        ("x.pth", "rwkv-x", ["rwkv7", "rwkv7", "moba"] * 2, hyb),
        ("rwkvx.safetensors", "rwkvx", ["rwkv7", "rwkv7", "moba"] * 2, hyb),
    ):
        source, sizes = open_any(tmp_path / path)
        assert (sizes.layout, sizes.kinds) == (layout, kinds), path
        got = materialize(source)
        assert all(torch.equal(got[n], want[n]) for n in want if n not in UNUSED), path


def test_bench_convert_measures_each_conversion(tmp_path):
    from rwkvx_cli.formats import sizes as sz
    from rwkvx_cli.tools.bench_convert import run_benchmark

    tiny = sz.Sizes("rwkvx", 97, 64, 64, ["rwkv7"] * 2, sz.LoraRanks(32, 32, 32, 32), 256)
    result = run_benchmark(tmp_path, sizes=tiny)
    assert set(result["runs"]) == {"rwkvx->hf", "hf->rwkvx", "rwkvx->rwkv-x"}
    assert result["parameters"] == sum(torch.Size(s).numel() for s in sz.expected_shapes(tiny).values())
    for r in result["runs"].values():
        assert r["peak_rss"] >= r["baseline_rss"] > 0
    assert list(tmp_path.iterdir()) == []  # everything it wrote is gone
