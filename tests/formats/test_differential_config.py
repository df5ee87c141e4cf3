"""rwkvx's reading of an HF config.json against fla's own (issue 36), by property: configs written
by rwkvx's exporter, then mutated (keys left out, set to null, to other values, to other types).
Every config rwkvx's reader accepts (hf.sizes_from_hf_config), fla's RWKV7Config loads through
transformers' `from_pretrained` and builds (RWKV7ForCausalLM on the meta device) with the sizes
rwkvx read: head size, channel-mix width, the four LoRA ranks, vocabulary, layers, the group norm's
eps. So every config fla cannot load or build, rwkvx refuses, and never reads a size otherwise than
fla. rwkvx refuses more than fla (a `true` for a number, `"1e-5"` for norm_eps, which fla stores and
then multiplies): each refusal is a one-line FormatError naming the key.

fla and transformers are test extras (imported, not skipped). Nothing is downloaded: configs are
read from local directories.
"""

import json
import math
import os

import fla  # noqa: F401 - registers model_type rwkv7 with transformers
import pytest
import torch
from fla.models.rwkv7 import RWKV7Config, RWKV7ForCausalLM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rwkvx_cli.formats import sizes as sz
from rwkvx_cli.formats.errors import FormatError
from rwkvx_cli.formats.hf import hf_config, sizes_from_hf_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def base_config(draw) -> dict:
    C = draw(st.sampled_from([32, 64, 96, 128]))
    head = draw(st.sampled_from([h for h in (16, 32, 64) if C % h == 0]))
    L = draw(st.integers(2, 3))  # fla's weight init divides by num_hidden_layers - 1: one layer fails there
    V = draw(st.sampled_from([257, 300]))
    lora = sz.LoraRanks(*(draw(st.sampled_from([16, 32, 64])) for _ in range(4)))
    sizes = sz.Sizes("rwkvx", V, C, head, ["rwkv7"] * L, lora, 4 * C)
    return hf_config(sizes, ln_x_eps=head * 1e-5)


def alternatives(cfg: dict) -> dict[str, list]:
    C, L, head, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"], cfg["vocab_size"]
    rank = [32, None, 0, -32, "32", 32.0, True, 48]
    return {
        "model_type": ["rwkv7", "rwkv6", 7, None],
        "attn": [None, {}, {"layers": [0], "num_heads": 2}, 0, [], "x"],
        "hidden_size": [C, str(C), float(C), -C, 0, None, True, 2 * C],
        "num_hidden_layers": [L, str(L), 0, 1.5, None, L + 1],
        "head_dim": [head, None, str(head), 0, -head, 48, C, 7, float(head), True, head * 2],
        "num_heads": [C // head, None, str(C // head), 0, 3, float(C // head), 1],
        "norm_eps": [1e-5, "1e-5", None, [1e-5], 1e-6, 0, True, 1, 1.00000000001e-5],
        "hidden_act": ["sqrelu", "relu", None, 3],
        "norm_first": [True, False, "yes", 1, None],
        "norm_bias": [True, False, 0, None],
        "value_dim": [None, C, [C] * L, [C] * (L + 1), 2 * C, [2 * C] * L, "x", [str(C)] * L, [float(C)] * L],
        "intermediate_size": [4 * C, None, 4 * C + 32, str(4 * C), 0, -1, 4.0 * C],
        "hidden_ratio": [4, None, 3.5, [4], "4", 0, True, -1, 4.01],
        "decay_low_rank_dim": rank,
        "a_low_rank_dim": rank,
        "v_low_rank_dim": rank,
        "gate_low_rank_dim": rank,
        "vocab_size": [V, None, str(V), 0, -1, 300, float(V)],
        "tie_word_embeddings": [False, True, "no", 0, None],
        "auto_map": [{"AutoModelForCausalLM": "modeling.X"}],
    }


@st.composite
def mutated_config(draw) -> dict:
    cfg = draw(base_config())
    alt = alternatives(cfg)
    for key in draw(st.lists(st.sampled_from(sorted(alt)), max_size=4, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            cfg.pop(key, None)
        else:
            cfg[key] = draw(st.sampled_from(alt[key]))
    return cfg


def _ours(cfg: dict):
    try:
        return sizes_from_hf_config(cfg, "config.json")
    except FormatError as e:
        assert "\n" not in str(e) and len(str(e)) < 300 and str(e).startswith("config.json: "), str(e)
        return None


def _fla(cfg: dict, where):
    """(fla's config, {name: shape} of the model it builds), or None where fla refuses."""
    (where / "config.json").write_text(json.dumps(cfg))
    try:
        config = RWKV7Config.from_pretrained(where)
        with torch.device("meta"):
            model = RWKV7ForCausalLM(config)
    except Exception:  # noqa: BLE001 - any refusal of fla's or transformers' is a refusal
        return None
    return config, model, {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_like_fla(cfg: dict, where) -> None:
    ours = _ours(cfg)
    if ours is None:
        return
    theirs = _fla(cfg, where)
    assert theirs is not None, cfg  # rwkvx never accepts a config fla cannot load and build
    config, model, shapes = theirs
    assert shapes["model.embeddings.weight"] == (ours["vocab_size"], ours["n_embd"])
    assert len(model.model.layers) == ours["n_layer"]
    assert shapes["model.layers.0.attn.r_k"] == (ours["n_embd"] // ours["head_size"], ours["head_size"])
    assert shapes["model.layers.0.ffn.key.weight"] == (ours["ffn_size"], ours["n_embd"])
    assert shapes["model.layers.0.attn.v_proj.weight"] == (ours["n_embd"], ours["n_embd"])
    lora = ours["lora"]
    for part, rank in (("w", lora.w), ("a", lora.a), ("g", lora.g)):
        assert shapes[f"model.layers.0.attn.{part}_lora.lora.0.weight"] == (rank, ours["n_embd"]), part
    if ours["n_layer"] > 1:  # layer 0 has no v_lora
        assert shapes["model.layers.1.attn.v_lora.lora.0.weight"] == (lora.v, ours["n_embd"])
    assert math.isclose(model.model.layers[0].attn.g_norm.eps, ours["ln_x_eps"], rel_tol=1e-9)
    assert config.tie_word_embeddings is ours["tied"]


@FAST
@given(mutated_config())
def test_what_rwkvx_reads_in_config_json_fla_reads_alike(tmp_path_factory, cfg):
    check_like_fla(cfg, tmp_path_factory.mktemp("cfg"))


@pytest.mark.slow
@SLOW
@given(mutated_config())
def test_what_rwkvx_reads_in_config_json_fla_reads_alike_long(tmp_path_factory, cfg):
    check_like_fla(cfg, tmp_path_factory.mktemp("cfg"))


@settings(FAST, max_examples=20)
@given(base_config())
def test_exported_configs_and_fla_s_own_save_read_alike(tmp_path_factory, cfg):
    """Not vacuous: rwkvx's own configs are accepted by both, and so is the config fla writes back
    (transformers' save_pretrained, with its own keys), with the same sizes."""
    where = tmp_path_factory.mktemp("cfg")
    assert _ours(cfg) is not None and _fla(cfg, where) is not None
    check_like_fla(cfg, where)
    RWKV7Config.from_pretrained(where).save_pretrained(where / "saved")
    saved = json.loads((where / "saved" / "config.json").read_text())
    assert _ours(saved) == _ours(cfg)


def test_fields_fla_would_reject_are_refused_by_name():
    cfg = hf_config(sz.Sizes("rwkvx", 257, 64, 32, ["rwkv7"], sz.LoraRanks(32, 32, 32, 32), 256), ln_x_eps=32e-5)
    for key, value in (("head_dim", "32"), ("hidden_size", "64"), ("num_hidden_layers", 1.5), ("attn", {})):
        with pytest.raises(FormatError, match=f"config.json: {key} is "):
            sizes_from_hf_config({**cfg, key: value}, "config.json")
