"""Hugging Face format for RWKV-7 models: the layout of fla's `RWKV7ForCausalLM`
(flash-linear-attention, `fla/models/rwkv7/`, `fla/layers/rwkv7.py`), both ways.

Names, shapes and transposes follow fla's modules (docs/formats.md has the table): fla's LoRAs
are `nn.Sequential(Linear(C, D, bias=False), act, Linear(D, C))`, so RWKV-LM's `w1` [C, D] is
`w_lora.lora.0.weight` transposed, `w2` [D, C] is `w_lora.lora.2.weight` transposed and `w0`
[1, 1, C] is `w_lora.lora.2.bias` [C] (likewise a, v; g has no bias); `k_k`, `k_a` and the
channel mix's `x_k` are flat [C] there. fla's layer 0 has no `v_lora` (it sets v_first), so
RWKV-LM's unused layer-0 `v0`, `v1`, `v2` are left out on export and come back as zeros.

The eps rule: fla's group norm (`g_norm`, RWKV-LM's `ln_x`) uses eps = head_dim * norm_eps, and
the same norm_eps is every LayerNorm's eps. rwkvx's LayerNorms use 1e-5 and its group norm
`model.ln_x_eps` (RWKV-LM's 64e-5 by default). So a directory must say norm_eps 1e-5 and comes in
with ln_x_eps = head_dim * norm_eps (any head size); a model goes out with norm_eps =
ln_x_eps / head_dim, which must be 1e-5: at head size 64 the default eps, at another head size
ln_x_eps = head_size * 1e-5 (an HF import has it; other eps are refused in one line).

Reading a directory needs no fla: config.json is checked for the settings rwkvx's model cannot
change, and the tensors are renamed lazily.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from rwkvx_cli.config import LN_X_EPS, ModelConfig
from rwkvx_cli.formats import sizes as sz
from rwkvx_cli.formats.checks import U64_MAX, is_int, is_number, show, strict_json
from rwkvx_cli.formats.errors import FormatError, SizeMismatchError
from rwkvx_cli.formats.tensors import (
    HF_INDEX,
    INVERSE,
    MappedSource,
    Rule,
    SafetensorsFiles,
    Shape,
    TensorSource,
    as_source,
    materialize,
    open_shards,
)
from rwkvx_cli.formats.write import DEFAULT_SHARD_BYTES, atomic_dir, write_json, write_shards
from rwkvx_cli.fsio import fsync_path

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
LN_EPS = 1e-5  # rwkvx's and RWKV-LM's LayerNorm eps (torch's default)
GN_EPS = LN_X_EPS  # RWKV-LM's ln_x GroupNorm eps, model.ln_x_eps's default

# rwkvx (RWKV-LM) name inside blocks.N -> (fla name inside model.layers.N, op from rwkvx to fla)
_BLOCK: dict[str, tuple[str, str]] = {
    "ln0.weight": ("pre_norm.weight", "same"),
    "ln0.bias": ("pre_norm.bias", "same"),
    "ln1.weight": ("attn_norm.weight", "same"),
    "ln1.bias": ("attn_norm.bias", "same"),
    "ln2.weight": ("ffn_norm.weight", "same"),
    "ln2.bias": ("ffn_norm.bias", "same"),
    **{f"att.x_{c}": (f"attn.x_{c}", "same") for c in "rwkvag"},
    "att.k_k": ("attn.k_k", "flat"),
    "att.k_a": ("attn.k_a", "flat"),
    "att.r_k": ("attn.r_k", "same"),
    **{f"att.{c}0": (f"attn.{c}_lora.lora.2.bias", "flat") for c in "wav"},
    **{f"att.{c}1": (f"attn.{c}_lora.lora.0.weight", "t") for c in "wavg"},
    **{f"att.{c}2": (f"attn.{c}_lora.lora.2.weight", "t") for c in "wavg"},
    "att.receptance.weight": ("attn.r_proj.weight", "same"),
    "att.key.weight": ("attn.k_proj.weight", "same"),
    "att.value.weight": ("attn.v_proj.weight", "same"),
    "att.output.weight": ("attn.o_proj.weight", "same"),
    "att.ln_x.weight": ("attn.g_norm.weight", "same"),
    "att.ln_x.bias": ("attn.g_norm.bias", "same"),
    "ffn.x_k": ("ffn.x_k", "flat"),
    "ffn.key.weight": ("ffn.key.weight", "same"),
    "ffn.value.weight": ("ffn.value.weight", "same"),
}
_TOP = {
    "emb.weight": "model.embeddings.weight",
    "ln_out.weight": "model.norm.weight",
    "ln_out.bias": "model.norm.bias",
    "head.weight": "lm_head.weight",
}
_BLOCK_BACK = {hf: (ours, INVERSE[op]) for ours, (hf, op) in _BLOCK.items()}
_TOP_BACK = {hf: ours for ours, hf in _TOP.items()}
FIRST_LAYER_UNUSED = ("att.v0", "att.v1", "att.v2")  # fla's layer 0 has no v_lora


def hf_name(name: str) -> tuple[str, str] | None:
    """(fla name, op) of an rwkvx RWKV-7 tensor name; None for layer 0's unused v0/v1/v2."""
    if name in _TOP:
        return _TOP[name], "same"
    m = sz._BLOCK.fullmatch(name)
    if m and m.group(2) in _BLOCK:
        if m.group(1) == "0" and m.group(2) in FIRST_LAYER_UNUSED:
            return None
        hf, op = _BLOCK[m.group(2)]
        return f"model.layers.{m.group(1)}.{hf}", op
    raise FormatError(f"{name} has no place in the HF (fla) RWKV-7 layout")


def to_hf_rules(shapes: Mapping[str, Shape]) -> list[Rule]:
    """Rules that turn an rwkvx RWKV-7 state dict (`{name: shape}`) into fla's names and layouts."""
    rules = []
    for name in shapes:
        got = hf_name(name)
        if got is not None:
            rules.append(Rule(got[0], name, got[1]))
    return rules


def from_hf_rules(shapes: Mapping[str, Shape], tied: bool = False) -> list[Rule]:
    """Rules that turn fla's tensors (`{name: shape}`) into rwkvx's names, with zeros for layer 0's
    v0 [1, 1, C], v1 [C, Dv], v2 [Dv, C] (Dv read from layer 1's v_lora, or the rule for one layer).
    `tied`: lm_head is the embedding (tie_word_embeddings)."""
    emb = shapes.get("model.embeddings.weight")
    if emb is not None and len(emb) != 2:
        raise FormatError(f"model.embeddings.weight is {list(emb)}, not [vocab_size, hidden_size]")
    rules = []
    for name in shapes:
        if name in _TOP_BACK:
            rules.append(Rule(_TOP_BACK[name], name))
            continue
        m = _HF_LAYER.fullmatch(name)
        if not (m and m.group(2) in _BLOCK_BACK):
            raise FormatError(f"{name} is not a tensor of fla's RWKV-7 (RWKV7ForCausalLM)")
        ours, op = _BLOCK_BACK[m.group(2)]
        rules.append(Rule(f"blocks.{m.group(1)}.{ours}", name, op))
    if tied and "lm_head.weight" not in shapes and "model.embeddings.weight" in shapes:
        rules.append(Rule("head.weight", "model.embeddings.weight"))
    if "model.embeddings.weight" in shapes and any(n.startswith("model.layers.0.") for n in shapes):
        C = shapes["model.embeddings.weight"][1]
        v1 = shapes.get("model.layers.1.attn.v_lora.lora.0.weight")
        dv = v1[0] if v1 else sz.LoraRanks.rule(C).v
        for suffix, shape in (("v0", (1, 1, C)), ("v1", (C, dv)), ("v2", (dv, C))):
            rules.append(Rule(f"blocks.0.att.{suffix}", None, shape=shape))
    return _in_model_order(rules)


sz.RENAMES["hf"] = from_hf_rules


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# rwkvx's parameter order inside an RWKV-7 block (its module order), for state dicts read back.
_ONE_BLOCK = sz.Sizes("rwkvx", 1, 64, 64, ["rwkv7"], sz.LoraRanks(32, 32, 32, 32), 256)
_ORDER = {k.split(".", 2)[2]: i for i, k in enumerate(sz.expected_shapes(_ONE_BLOCK)) if k.startswith("blocks.0.")}
_TOP_ORDER = {"emb.weight": (0, 0), "ln_out.weight": (2, 0), "ln_out.bias": (2, 1), "head.weight": (2, 2)}


def _in_model_order(rules: list[Rule]) -> list[Rule]:
    """rwkvx's state-dict order: embedding, blocks bottom to top in module order, ln_out, head."""

    def key(r: Rule):
        m = sz._BLOCK.fullmatch(r.dst)
        if m:
            return (1, int(m.group(1)), _ORDER.get(m.group(2), len(_ORDER)))
        return (*_TOP_ORDER.get(r.dst, (3, 0)), 0)

    return sorted(rules, key=key)


def norm_eps_of(head_size: int, ln_x_eps: float) -> float:
    """fla's norm_eps for a model with this head size and group-norm eps (the eps rule): ln_x_eps / head_dim,
    which is also fla's LayerNorm eps, so it must be rwkvx's 1e-5, or FormatError."""
    norm_eps = ln_x_eps / head_size
    if not math.isclose(norm_eps, LN_EPS, rel_tol=1e-9):
        raise FormatError(
            f"model.ln_x_eps {ln_x_eps:g} at head size {head_size}: fla's group-norm eps is head_dim x norm_eps and "
            f"norm_eps is also its LayerNorms' eps (rwkvx's: {LN_EPS:g}), so the hf format holds ln_x_eps = "
            f"{head_size} x {LN_EPS:g} = {head_size * LN_EPS:g} only"
        )
    return norm_eps


def check_exportable(sizes: sz.Sizes, ln_x_eps: float = GN_EPS) -> float:
    """Refuse what fla cannot compute as rwkvx does; returns config.json's norm_eps."""
    if sizes.n_attn or any(k != "rwkv7" for k in sizes.kinds):
        others = sorted(set(sizes.kinds) - {"rwkv7"})
        raise FormatError(f"the hf format holds plain RWKV-7 models; this one has {', '.join(others)} blocks")
    return norm_eps_of(sizes.head_size, ln_x_eps)


def hf_config(sizes: sz.Sizes, eod_id: int = 0, dtype: torch.dtype = torch.float32, ln_x_eps: float = GN_EPS) -> dict:
    """config.json for fla's RWKV7Config (fla/models/rwkv7/configuration_rwkv7.py). No auto_map:
    fla registers `rwkv7` with transformers' Auto classes when imported (`import fla`). `ln_x_eps`:
    the model's group-norm eps (model.ln_x_eps), written as norm_eps = ln_x_eps / head_dim."""
    norm_eps = check_exportable(sizes, ln_x_eps)
    C, L = sizes.n_embd, sizes.n_layer
    return {
        "architectures": ["RWKV7ForCausalLM"],
        "model_type": "rwkv7",
        "attn": None,  # no softmax-attention layers among the RWKV-7 ones
        "attn_mode": "chunk",
        "hidden_size": C,
        "num_hidden_layers": L,
        "head_dim": sizes.head_size,
        "num_heads": C // sizes.head_size,
        "decay_low_rank_dim": sizes.lora.w,
        "a_low_rank_dim": sizes.lora.a,
        "v_low_rank_dim": sizes.lora.v,
        "gate_low_rank_dim": sizes.lora.g,
        "hidden_ratio": 4,
        "intermediate_size": sizes.ffn_size,
        "hidden_act": "sqrelu",
        "value_dim": [C] * L,
        "norm_first": True,  # layer 0 has pre_norm (RWKV-LM's ln0)
        "norm_bias": True,
        "norm_eps": norm_eps,
        "vocab_size": sizes.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "pad_token_id": None,
        "use_cache": True,
        "fuse_norm": True,
        "fuse_cross_entropy": True,
        "fuse_linear_cross_entropy": False,
        "use_l2warp": True,
        "max_position_embeddings": 2048,  # fla's default; RWKV-7 has no position limit
        "initializer_range": 0.02,
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }


def generation_config(eod_id: int = 0) -> dict:
    return {"bos_token_id": eod_id, "eos_token_id": eod_id, "_from_model_config": True}


# fla's RWKV7Config defaults (fla/models/rwkv7/configuration_rwkv7.py): what fla builds for a key
# config.json leaves out. A key written as null means the layer's own rule instead (LoRA ranks: fla's
# lora rule, fla/layers/rwkv7.py; intermediate_size: hidden_ratio x C rounded up to 32).
FLA_DEFAULTS = {
    "head_dim": 64,
    "hidden_ratio": 4,
    "decay_low_rank_dim": 64,
    "a_low_rank_dim": 64,
    "v_low_rank_dim": 16,
    "gate_low_rank_dim": 128,
    "vocab_size": 32000,
    "norm_eps": LN_EPS,
}
_LORA_KEYS = ("decay_low_rank_dim", "a_low_rank_dim", "v_low_rank_dim", "gate_low_rank_dim")
_LORA_FACTOR = (2.5, 2.5, 1.7, 5.0)


def sizes_from_hf_config(config: dict, where: str = "config.json") -> dict[str, object]:
    """The sizes config.json states, as fla's RWKV7Config and RWKV7 layers read them (a key left
    out takes fla's default), after checking every key rwkvx reads for its type and range and
    refusing every setting rwkvx's RWKV-7 cannot reproduce. Keys rwkvx does not read (auto_map,
    token ids, dtype, ...) are not looked at: no code from the directory is ever loaded."""

    def need(cond: bool, why: str):
        if not cond:
            raise FormatError(f"{where}: {why}")

    def typed(key: str, ok, what: str, nullable: bool = True):
        value = config.get(key, FLA_DEFAULTS.get(key))
        need((nullable and value is None) or ok(value), f"{key} is {show(value)}, not {what}")
        return value

    def positive(value) -> bool:
        return is_int(value) and 0 < value <= U64_MAX

    model_type = config.get("model_type")
    need(model_type == "rwkv7", f"model_type is {show(model_type)}, not 'rwkv7' (fla's RWKV-7)")
    attn = config.get("attn")
    need(attn is None, f"attn is {show(attn)}: softmax-attention layers, which rwkvx's RWKV-7 stack does not have")
    need("hidden_size" in config and "num_hidden_layers" in config, "hidden_size / num_hidden_layers missing")
    C = typed("hidden_size", positive, "a size (an integer > 0)", nullable=False)
    L = typed("num_hidden_layers", positive, "a layer count (an integer > 0)", nullable=False)
    head = typed("head_dim", positive, "a head size (an integer > 0) or null")
    heads = typed("num_heads", positive, "a head count (an integer > 0) or null")
    need(head is not None or heads is not None, "head_dim / num_heads missing (both null)")
    if head is None:  # fla: head_dim = hidden_size // num_heads
        need(C % heads == 0, f"num_heads {heads} does not divide hidden_size {C}")
        head = C // heads
    need(C % head == 0, f"head_dim {head} does not divide hidden_size {C}")
    need(heads is None or heads * head == C, f"head_dim {head} x num_heads {heads} is not hidden_size {C}")
    eps = typed("norm_eps", lambda v: is_number(v) and v > 0, "a number > 0", nullable=False)
    need(math.isclose(eps, LN_EPS, rel_tol=1e-9), f"norm_eps {eps} (rwkvx's LayerNorms use {LN_EPS})")
    act = config.get("hidden_act", "sqrelu")
    need(act == "sqrelu", f"hidden_act is {show(act)}, not 'sqrelu' (rwkvx's channel mix)")
    for key, why in (
        ("norm_first", "norm_first is false: rwkvx always normalises the embedding (ln0)"),
        ("norm_bias", "norm_bias is false: rwkvx's LayerNorms have biases"),
    ):
        value = config.get(key, True)
        need(isinstance(value, bool), f"{key} is {show(value)}, not true or false")
        need(value, why)
    vd = config.get("value_dim")
    spelt = vd if is_int(vd) or vd is None else show(vd)
    need(
        vd is None or vd == C or (isinstance(vd, list) and len(vd) == L and all(is_int(v) and v == C for v in vd)),
        f"value_dim {spelt} is not hidden_size {C} (or a list of it, one per layer)",
    )
    inter = typed("intermediate_size", positive, "a width (an integer > 0) or null")
    ratio = typed("hidden_ratio", lambda v: is_number(v) and 0 < v <= 2**32, "a number > 0 or null")
    if inter is None:  # fla's RWKV7FeedForward: hidden_ratio (None: 4) x C rounded up to a multiple of 32
        inter = 32 * ((int(C * (ratio if ratio is not None else 4)) + 31) // 32)
    ranks = []
    for key, m in zip(_LORA_KEYS, _LORA_FACTOR, strict=True):
        rank = typed(key, positive, "a rank (an integer > 0) or null")
        factor = head / 64 if key != "gate_low_rank_dim" else 1.0  # fla/layers/rwkv7.py's rule for null
        ranks.append(rank if rank is not None else max(32, int(round((m * (C**0.5)) * factor / 32) * 32)))
    vocab = typed("vocab_size", positive, "a vocabulary size (an integer > 0)", nullable=False)
    tied = config.get("tie_word_embeddings", False)
    need(isinstance(tied, bool), f"tie_word_embeddings is {show(tied)}, not true or false")
    return {
        "vocab_size": vocab,
        "n_embd": C,
        "n_layer": L,
        "head_size": head,
        "ffn_size": inter,
        "lora": sz.LoraRanks(*ranks),
        "tied": tied,
        "ln_x_eps": head * eps,  # fla's g_norm eps (the eps rule)
    }


def read_hf_config(path: Path) -> dict:
    """config.json of an HF directory: strict JSON (checks.strict_json), an object."""
    file = Path(path) / "config.json"
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise FormatError(f"{file} is missing or unreadable ({e.strerror or e})") from None
    cfg = strict_json(raw, str(file))
    if not isinstance(cfg, dict):
        raise FormatError(f"{file} is {show(cfg)}, not a JSON object")
    return cfg


def open_hf(path: str | Path) -> tuple[TensorSource, sz.Sizes]:
    """An HF (fla) RWKV-7 directory as a lazy rwkvx-named source, and its sizes (from the tensors,
    checked against config.json: every size that disagrees is named)."""
    path = Path(path)
    config = read_hf_config(path)
    stated = sizes_from_hf_config(config, str(path / "config.json"))
    if (path / HF_INDEX).is_file():
        base = open_shards(path)
    elif (path / "model.safetensors").is_file():
        base = SafetensorsFiles([path / "model.safetensors"])
    else:
        raise FormatError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    rules = from_hf_rules(base.shapes(), tied=stated["tied"])
    source = MappedSource(base, rules)
    sizes = sz.infer_sizes(source.shapes(), layout="rwkv-lm")
    sizes.layout, sizes.ln_x_eps = "hf", stated["ln_x_eps"]
    said = {
        "vocab_size": sizes.vocab_size,
        "n_embd": sizes.n_embd,
        "n_layer": sizes.n_layer,
        "head_size": sizes.head_size,
        "ffn_size": sizes.ffn_size,
        "lora": sizes.lora,
    }
    wrong = [f"{k} {stated[k]} (the tensors: {v})" for k, v in said.items() if stated[k] is not None and stated[k] != v]
    if wrong:
        raise SizeMismatchError(f"{path / 'config.json'} disagrees with the tensors: {'; '.join(wrong)}")
    if "auto_map" in config:
        sizes.notes.append(
            "config.json's auto_map (remote code) is ignored: rwkvx never runs a model directory's code; "
            "the tensors are read as fla's RWKV7ForCausalLM"
        )
    return source, sizes


def load_hf(path: str | Path) -> tuple[dict[str, torch.Tensor], sz.Sizes]:
    """An HF (fla) RWKV-7 directory as an rwkvx state dict in memory, and its sizes."""
    source, sizes = open_hf(path)
    try:
        return materialize(source), sizes
    finally:
        source.close()


def to_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An rwkvx RWKV-7 state dict in fla's names and layouts, in memory (small models, tests)."""
    src = as_source(state)
    return materialize(MappedSource(src, to_hf_rules(src.shapes())))


def from_hf(state: Mapping[str, torch.Tensor], tied: bool = False) -> dict[str, torch.Tensor]:
    src = as_source(state)
    return materialize(MappedSource(src, from_hf_rules(src.shapes(), tied)))


def export_hf(
    weights: TensorSource | Mapping[str, torch.Tensor],
    out: str | Path,
    *,
    cfg: ModelConfig | None = None,
    dtype: str = "fp32",
    tokenizer=None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    force: bool = False,
) -> dict:
    """Write an rwkvx RWKV-7 state dict as an HF (fla) model directory: config.json,
    generation_config.json, safetensors shards (sharded above `max_shard_bytes`, with
    model.safetensors.index.json) and the tokenizer's HF files where it has a standard form.
    Streams tensor by tensor; the directory appears whole (temporary sibling renamed into place)
    or not at all. `cfg`: the run's ModelConfig, checked against the tensors. Returns a summary."""
    if dtype not in DTYPES:
        raise FormatError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    from rwkvx_cli.formats.tokenizer_files import hf_tokenizer_files

    source = as_source(weights)
    sizes = sz.infer_sizes(source.shapes())
    if cfg is not None:
        sz.config_from_sizes(sizes, cfg, written=sz.SIZE_KEYS)
    ln_x_eps = cfg.ln_x_eps if cfg is not None else GN_EPS
    check_exportable(sizes, ln_x_eps)
    eod = getattr(tokenizer, "eod_id", 0) if tokenizer is not None else 0
    files, note = hf_tokenizer_files(tokenizer)
    mapped = MappedSource(source, to_hf_rules(source.shapes()), dtype=DTYPES[dtype])
    with atomic_dir(Path(out), force) as tmp:
        written = write_shards(mapped, tmp, max_shard_bytes, metadata={"rwkvx_sizes": sz.sizes_line(sizes)})
        write_json(tmp / "config.json", hf_config(sizes, eod, DTYPES[dtype], ln_x_eps))
        write_json(tmp / "generation_config.json", generation_config(eod))
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
            fsync_path(tmp / name)
    dropped = [n for n in source.names() if hf_name(n) is None]
    return {
        "out": str(out),
        "format": "hf",
        "tensors": len(mapped.names()),
        "bytes": written["total_size"],
        "files": ["config.json", "generation_config.json", *written["files"], *files],
        "left_out": dropped,
        "tokenizer": note,
        "sizes": sz.sizes_line(sizes),
    }
