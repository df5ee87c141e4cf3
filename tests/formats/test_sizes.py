"""Size inference from names and shapes alone, on tensors shaped like the released RWKV-7 World
family (meta tensors: no memory), in every layout."""

import dataclasses

import pytest
import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.formats import FormatError, LoraRanks, SizeMismatchError, config_from_sizes, infer_sizes
from rwkvx_cli.formats.hf import to_hf_rules
from rwkvx_cli.formats.sizes import expected_shapes, sizes_of_config
from rwkvx_cli.formats.tensors import op_shape
from rwkvx_cli.models.model import LM, layer_kinds
from tests.formats.conftest import shapes

# (name, n_layer, n_embd, LoRA ranks w, a, v, g) of the released RWKV-7 World models, as their HF
# configs state them (quoted in public code; the weights cannot be downloaded here); vocab 65536, head size 64.
RELEASED = [
    ("0.1B", 12, 768, (64, 64, 32, 128)),
    ("0.4B", 24, 1024, (64, 64, 32, 128)),
    ("1.5B", 24, 2048, (96, 96, 64, 256)),
    ("2.9B", 32, 2560, (96, 96, 64, 320)),
]


def rwkv_lm_shapes(L: int, C: int, ranks, V: int = 65536, N: int = 64) -> dict:
    """RWKV-LM's RWKV-7 state dict (RWKV-v7/train_temp), written out from its model, not from rwkvx's code."""
    w, a, v, g = ranks
    out = {"emb.weight": (V, C)}
    for i in range(L):
        b = f"blocks.{i}."
        if i == 0:
            out[b + "ln0.weight"], out[b + "ln0.bias"] = (C,), (C,)
        for ln in ("ln1", "ln2"):
            out[b + f"{ln}.weight"], out[b + f"{ln}.bias"] = (C,), (C,)
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"):
            out[b + f"att.{x}"] = (1, 1, C)
        for x, d in (("w", w), ("a", a), ("v", v), ("g", g)):
            out[b + f"att.{x}1"], out[b + f"att.{x}2"] = (C, d), (d, C)
        out[b + "att.r_k"] = (C // N, N)
        for p in ("receptance", "key", "value", "output"):
            out[b + f"att.{p}.weight"] = (C, C)
        out[b + "att.ln_x.weight"], out[b + "att.ln_x.bias"] = (C,), (C,)
        out[b + "ffn.x_k"], out[b + "ffn.key.weight"], out[b + "ffn.value.weight"] = (1, 1, C), (4 * C, C), (C, 4 * C)
    out.update({"ln_out.weight": (C,), "ln_out.bias": (C,), "head.weight": (V, C)})
    return out


def fla_shapes(L: int, C: int, ranks, V: int = 65536) -> dict:
    """fla's own RWKV7ForCausalLM state dict, built on the meta device (names and shapes only)."""
    import transformers.modeling_utils as mu
    from fla.models.rwkv7 import RWKV7Config, RWKV7ForCausalLM
    from transformers.initialization import no_init_weights

    w, a, v, g = ranks
    cfg = RWKV7Config(hidden_size=C, num_hidden_layers=L, head_dim=64, vocab_size=V, decay_low_rank_dim=w,
                      a_low_rank_dim=a, v_low_rank_dim=v, gate_low_rank_dim=g, intermediate_size=4 * C)  # fmt: skip
    # fla's layers init themselves unless transformers' `_init_weights` flag says no (meta tensors cannot be).
    had = getattr(mu, "_init_weights", None)
    mu._init_weights = False
    try:
        with torch.device("meta"), no_init_weights():
            model = RWKV7ForCausalLM(cfg)
    finally:
        if had is None:
            del mu._init_weights
        else:
            mu._init_weights = had
    return shapes(model.state_dict())


def rwkv_x_shapes(n_rwkv: int, n_attn: int, C: int, ranks, V: int = 65536) -> dict:
    """RWKV-X's RWKVHybrid state dict (pretrain/src/model.py): rwkv.<RWKV-LM names>, moba.<i>.*."""
    out = {f"rwkv.{k}": s for k, s in rwkv_lm_shapes(n_rwkv, C, ranks, V).items()}
    for i in range(n_attn):
        m = f"moba.{i}."
        for ln in ("ln1", "ln2"):
            out[m + f"{ln}.weight"], out[m + f"{ln}.bias"] = (C,), (C,)
        for p in ("receptance", "key", "value", "output"):
            out[m + f"att.{p}.weight"] = (C, C)
        out[m + "ffn.x_k"], out[m + "ffn.key.weight"], out[m + "ffn.value.weight"] = (1, 1, C), (4 * C, C), (C, 4 * C)
    return out


@pytest.mark.parametrize("name,L,C,ranks", RELEASED)
def test_released_family_in_every_layout(name, L, C, ranks):
    want = dict(vocab_size=65536, n_embd=C, head_size=64, n_layer=L, lora=LoraRanks(*ranks), ffn_size=4 * C)
    for layout, tensors in (("rwkv-lm", rwkv_lm_shapes(L, C, ranks)), ("hf", fla_shapes(L, C, ranks))):
        s = infer_sizes(tensors)
        assert s.layout == layout
        assert {k: getattr(s, k) for k in want} == want, (name, layout)
        assert s.n_attn == 0 and s.layers == []
    x = infer_sizes(rwkv_x_shapes(L, 1, C, ranks))
    assert (
        x.layout == "rwkv-x" and x.n_layer == L and x.n_attn == 1 and x.kinds[-1] == "moba" and x.lora == want["lora"]
    )


def test_meta_tensors_work_like_shapes():
    sd = {k: torch.empty(s, device="meta") for k, s in rwkv_lm_shapes(12, 768, (64, 64, 32, 128)).items()}
    assert infer_sizes(shapes(sd)).n_layer == 12


def test_which_released_ranks_follow_rwkvx_rule():
    follows = {name: LoraRanks(*ranks).follows_rule(C) for name, _, C, ranks in RELEASED}
    assert follows == {"0.1B": True, "0.4B": False, "1.5B": False, "2.9B": False}
    assert LoraRanks.rule(1024) == LoraRanks(64, 64, 64, 160)  # the rule; the 0.4B model has 64, 64, 32, 128


def test_ranks_off_the_rule_go_into_the_config():
    s = infer_sizes(rwkv_lm_shapes(24, 1024, (64, 64, 32, 128)))
    assert s.notes and "differ from rwkvx's rule" in s.notes[0]
    cfg = config_from_sizes(s, ModelConfig())
    assert (cfg.n_layer, cfg.n_embd, cfg.lora_w, cfg.lora_a, cfg.lora_v, cfg.lora_g) == (24, 1024, 64, 64, 32, 128)
    assert LoraRanks.of_config(cfg) == s.lora
    with torch.device("meta"):  # the model these sizes build has the released checkpoint's shapes
        built = {k: tuple(v.shape) for k, v in LM(cfg).state_dict().items()}
    assert built == rwkv_lm_shapes(24, 1024, (64, 64, 32, 128))


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(vocab_size=97, n_layer=3, n_embd=128, head_size=32),
        ModelConfig(vocab_size=97, n_layer=4, n_embd=128, head_size=64, n_attn=2),
        ModelConfig(vocab_size=97, n_layer=5, n_embd=64, head_size=64, n_attn=2),  # leftover block on top
        ModelConfig(vocab_size=97, n_embd=64, head_size=64, layers=["moba", "rwkv7", "rwkv7", "moba"]),
    ],
)
def test_rwkvx_state_dicts_round_trip_through_their_sizes(cfg):
    from rwkvx_cli.config import expand_layers

    cfg = dataclasses.replace(cfg, layers=expand_layers(cfg.layers))
    with torch.device("meta"):
        own = shapes(LM(cfg).state_dict())
    # expected_shapes is what every other check relies on: it must be the model's state dict exactly.
    assert list(expected_shapes(sizes_of_config(cfg)).items()) == list(own.items())
    s = infer_sizes(own)
    assert s.kinds == layer_kinds(cfg)
    back = config_from_sizes(s, ModelConfig(), written=())
    assert (back.n_embd, back.head_size, back.vocab_size, back.n_layer, back.n_attn) == (
        cfg.n_embd, cfg.head_size, cfg.vocab_size, s.n_layer, s.n_attn,
    )  # fmt: skip


def test_a_written_size_that_disagrees_names_every_tensor():
    s = infer_sizes(rwkv_lm_shapes(2, 768, (64, 64, 32, 128), V=1000))
    with pytest.raises(SizeMismatchError) as e:
        config_from_sizes(s, ModelConfig(n_embd=1024, vocab_size=1000), written={"n_embd", "vocab_size"})
    msg = str(e.value)
    assert "n_embd=1024 (the weights: 768)" in msg and "emb.weight is [1000, 768], want [1000, 1024]" in msg
    assert "more)" in msg and "\n" not in msg
    # Unwritten sizes simply come from the tensors.
    assert config_from_sizes(s, ModelConfig(n_embd=1024), written=()).n_embd == 768


def test_inconsistent_tensors_are_named():
    t = rwkv_lm_shapes(2, 768, (64, 64, 32, 128), V=1000)
    t["blocks.1.att.w1"] = (768, 96)  # layer 1's decay LoRA differs from layer 0's
    t["blocks.1.att.w2"] = (96, 768)
    with pytest.raises(SizeMismatchError, match=r"blocks\.1\.att\.w1 is \[768, 96\], want \[768, 64\]"):
        infer_sizes(t)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("emb.weight"), "cannot tell the layout"),
        (lambda t: t.update({"blocks.1.ffn.key.weight": (3 * 768, 768)}), r"ffn\.key\.weight is \[2304, 768\]"),
        (lambda t: [t.pop(k) for k in list(t) if k.startswith("blocks.1.")], "numbered 0..n-1"),
        (lambda t: [t.pop(k) for k in list(t) if k.startswith("blocks.2.att.w")], "neither RWKV-7"),
    ],
)
def test_refusals_are_one_line(edit, message):
    t = rwkv_lm_shapes(3, 768, (64, 64, 32, 128), V=1000)
    edit(t)
    with pytest.raises(FormatError, match=message) as e:
        infer_sizes(t)
    assert "\n" not in str(e.value)


def test_hf_inference_agrees_with_our_hf_names():
    """Our rwkvx -> HF renaming of RWKV-LM's tensors gives exactly fla's own names and shapes."""
    ours = rwkv_lm_shapes(3, 256, (32, 32, 32, 64), V=300)
    mapped = {r.dst: op_shape(r.op, ours[r.src]) for r in to_hf_rules(ours)}
    assert mapped == fla_shapes(3, 256, (32, 32, 32, 64), V=300)
