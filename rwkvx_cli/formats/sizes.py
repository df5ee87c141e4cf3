"""Model sizes read from tensor names and shapes alone (no data, no config file): RWKV-LM `.pth`
state dicts, rwkvx state dicts (RWKV-7 and MoBA blocks), HF (fla) directories and RWKV-X `.pth`
files. Every layout is first renamed to rwkvx's names (hf.py, rwkv_x.py), then read here.

What is read (rwkvx names): `emb.weight` [V, C] gives vocab_size and n_embd; the block indices and
which tensors each block has give the stack (an RWKV-7 block has `att.w1`, a MoBA block only the
four `att.{receptance,key,value,output}` projections); `att.r_k` [H, N] gives head_size;
`att.w1` / `a1` / `v1` / `g1` [C, D] give the four LoRA ranks; `ffn.key.weight` [F, C] the
channel-mix width. Then every tensor is checked against the shape those sizes imply, and each that
disagrees is named.

The LoRA ranks: rwkvx derives them from n_embd (`lora_rank` in models/layers/rwkv7.py, RWKV-LM
train_temp's rule max(32, round(m sqrt(C) / 32) * 32), m = 2.5, 2.5, 1.7, 5). The released RWKV-7
World models follow it only at 0.1B: 0.4B (C 1024) has w, a, v, g = 64, 64, 32, 128 where the rule
gives 64, 64, 64, 160; 1.5B (C 2048) 96, 96, 64, 256 (rule 128, 128, 64, 224); 2.9B (C 2560)
96, 96, 64, 320 (rule 128, 128, 96, 256). So the ranks travel in `LoraRanks`, and into ModelConfig's
`lora_w`, `lora_a`, `lora_v`, `lora_g` (0 = the rule), which `config_from_sizes` fills.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from rwkvx_cli.config import LN_X_EPS, ConfigError, ModelConfig, expand_layers
from rwkvx_cli.formats.errors import FormatError, SizeMismatchError
from rwkvx_cli.formats.tensors import Rule, Shape, op_shape
from rwkvx_cli.models.layers.rwkv7 import lora_rank
from rwkvx_cli.models.model import block_kinds, layer_kinds

LAYOUTS = ("rwkv-lm", "rwkvx", "hf", "rwkv-x")
# The renaming of each other layout to rwkvx's names, from its shapes: hf.py and rwkv_x.py enter theirs
# (they build on this module), and the package's __init__ imports both, so any import of formats has them.
RENAMES: dict[str, Callable[[Mapping[str, Shape]], list[Rule]]] = {}
LORA_FIELDS = ("lora_w", "lora_a", "lora_v", "lora_g")  # ModelConfig's fields (0 = the rule)
SIZE_KEYS = ("vocab_size", "n_embd", "head_size", "n_layer", "n_attn", "layers")
MOBA_ATT = {f"att.{p}.weight" for p in ("receptance", "key", "value", "output")}


@dataclass(frozen=True)
class LoraRanks:
    """The low-rank sizes of RWKV-7's decay (w), in-context learning rate (a), value residual (v) and gate (g)."""

    w: int
    a: int
    v: int
    g: int

    @classmethod
    def rule(cls, n_embd: int) -> LoraRanks:
        return cls(lora_rank(2.5, n_embd), lora_rank(2.5, n_embd), lora_rank(1.7, n_embd), lora_rank(5.0, n_embd))

    @classmethod
    def of_config(cls, cfg: ModelConfig) -> LoraRanks:
        """The config's ranks: its lora_* fields where it has them and they are set, else the rule."""
        rule = cls.rule(cfg.n_embd)
        given = [getattr(cfg, f, 0) or 0 for f in LORA_FIELDS]
        return cls(*(g or r for g, r in zip(given, dataclasses.astuple(rule), strict=True)))

    def follows_rule(self, n_embd: int) -> bool:
        return self == LoraRanks.rule(n_embd)

    def __str__(self) -> str:
        return f"w={self.w} a={self.a} v={self.v} g={self.g}"


@dataclass
class Sizes:
    """What a state dict's tensors say about its model. `kinds` is the stack bottom to top;
    n_layer counts its RWKV-7 blocks and n_attn its MoBA blocks (ModelConfig's meaning).
    `moba_chunk` / `moba_top_k` are never in the tensors (None here)."""

    layout: str
    vocab_size: int
    n_embd: int
    head_size: int
    kinds: list[str]
    lora: LoraRanks
    ffn_size: int
    moba_chunk: int | None = None
    moba_top_k: int | None = None
    notes: list[str] = field(default_factory=list)
    # The group-norm eps the file states (an HF config.json: head_dim x norm_eps); None: it has no
    # config (RWKV-LM, RWKV-X) and the model's `model.ln_x_eps` stays the config's.
    ln_x_eps: float | None = None

    @property
    def n_layer(self) -> int:
        return self.kinds.count("rwkv7")

    @property
    def n_attn(self) -> int:
        return self.kinds.count("moba")

    @property
    def layers(self) -> list[str]:
        """model.layers: empty when RWKV-X's rule on (n_layer, n_attn) gives this stack."""
        return [] if self.kinds == block_kinds(self.n_layer, self.n_attn) else list(self.kinds)

    def model_overrides(self) -> dict[str, object]:
        """The ModelConfig values these sizes set, by field name; the LoRA ranks only where they differ
        from the rule (ModelConfig's lora_* fields)."""
        out: dict[str, object] = {
            "vocab_size": self.vocab_size,
            "n_embd": self.n_embd,
            "head_size": self.head_size,
            "n_layer": self.n_layer,
            "n_attn": self.n_attn,
            "layers": self.layers,
        }
        if not self.lora.follows_rule(self.n_embd):
            out.update(zip(LORA_FIELDS, dataclasses.astuple(self.lora), strict=True))
        if self.ln_x_eps is not None:
            out["ln_x_eps"] = self.ln_x_eps
        return out


def sizes_of_config(cfg: ModelConfig) -> Sizes:
    return Sizes(
        "rwkvx", cfg.vocab_size, cfg.n_embd, cfg.head_size, layer_kinds(cfg), LoraRanks.of_config(cfg), 4 * cfg.n_embd
    )


def expected_shapes(s: Sizes) -> dict[str, Shape]:
    """rwkvx's state dict names and shapes for sizes `s` (RWKV-7 and MoBA blocks), in the model's order.
    The tests hold this equal to the model's own state_dict for several configs."""
    C, V, N, F, r = s.n_embd, s.vocab_size, s.head_size, s.ffn_size, s.lora
    vec, norm = (1, 1, C), {"weight": (C,), "bias": (C,)}
    out: dict[str, Shape] = {"emb.weight": (V, C)}
    for pos, kind in enumerate(s.kinds):
        p = f"blocks.{pos}."
        block: dict[str, Shape] = {}
        if pos == 0 and kind == "rwkv7":  # parameter order: ln0 first in an RWKV-7 block, last in others
            block.update({f"ln0.{k}": v for k, v in norm.items()})
        block.update({f"ln1.{k}": v for k, v in norm.items()})
        block.update({f"ln2.{k}": v for k, v in norm.items()})
        if kind == "rwkv7":
            for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"):
                block[f"att.{name}"] = vec
            for name, d in (("w", r.w), ("a", r.a), ("v", r.v), ("g", r.g)):
                block[f"att.{name}1"], block[f"att.{name}2"] = (C, d), (d, C)
            block["att.r_k"] = (C // N, N)
            for proj in ("receptance", "key", "value", "output"):
                block[f"att.{proj}.weight"] = (C, C)
            block["att.ln_x.weight"], block["att.ln_x.bias"] = (C,), (C,)
        elif kind == "moba":
            for proj in ("receptance", "key", "value", "output"):
                block[f"att.{proj}.weight"] = (C, C)
        else:
            raise FormatError(f"block {pos} is {kind!r}: the formats here hold RWKV-7 and MoBA blocks only")
        block.update({"ffn.x_k": vec, "ffn.key.weight": (F, C), "ffn.value.weight": (C, F)})
        if pos == 0 and kind != "rwkv7":
            block.update({f"ln0.{k}": v for k, v in norm.items()})
        out.update({p + k: v for k, v in block.items()})
    out.update({"ln_out.weight": (C,), "ln_out.bias": (C,), "head.weight": (V, C)})
    return out


def mismatch(actual: Mapping[str, Shape], expected: Mapping[str, Shape], limit: int = 8) -> str:
    """Every missing, unexpected or mis-shaped tensor, as one line ("" when none)."""
    problems = [f"{k} missing (want {list(v)})" for k, v in expected.items() if k not in actual]
    problems += [f"{k} unexpected" for k in actual if k not in expected]
    problems += [
        f"{k} is {list(actual[k])}, want {list(v)}"
        for k, v in expected.items()
        if k in actual and tuple(actual[k]) != v
    ]
    more = f" (+{len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def detect_layout(names: Collection[str]) -> str:
    names = list(names)
    if any(n.startswith(("model.layers.", "model.embeddings.")) for n in names):
        return "hf"
    if any(n.startswith(("rwkv.", "moba.")) for n in names):
        return "rwkv-x"
    if "emb.weight" in names:
        return (
            "rwkvx"
            if any(
                n.endswith(".att.receptance.weight") and n.replace("receptance.weight", "w1") not in names
                for n in names
            )
            else "rwkv-lm"
        )
    raise FormatError(
        "cannot tell the layout of these weights: no emb.weight (RWKV-LM / rwkvx), model.embeddings.weight (HF) "
        "or rwkv.emb.weight (RWKV-X)"
    )


def to_rwkvx_shapes(shapes: Mapping[str, Shape], layout: str | None = None) -> tuple[str, dict[str, Shape]]:
    """(layout, shapes under rwkvx's names) of a state dict in any layout."""
    layout = layout or detect_layout(shapes)
    if layout in ("rwkv-lm", "rwkvx"):
        return layout, dict(shapes)
    if layout not in RENAMES:
        raise FormatError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    rules = RENAMES[layout](shapes)
    return layout, {r.dst: (tuple(r.shape) if r.src is None else op_shape(r.op, shapes[r.src])) for r in rules}


_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def block_tensors(shapes: Mapping[str, Shape]) -> dict[int, dict[str, Shape]]:
    """{block index: {name inside the block: shape}} of rwkvx names; the indices must be 0..n-1."""
    blocks: dict[int, dict[str, Shape]] = {}
    for name, shape in shapes.items():
        m = _BLOCK.fullmatch(name)
        if m:
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = tuple(shape)
    if sorted(blocks) != list(range(len(blocks))):
        gaps = [i for i in range(len(blocks)) if i not in blocks][:5]  # a forged blocks.10**12 is no range to build
        raise FormatError(f"the blocks are not numbered 0..n-1 (missing {', '.join(map(str, gaps))})")
    return blocks


def block_kind(pos: int, tensors: Mapping[str, Shape]) -> str:
    if "att.w1" in tensors:
        return "rwkv7"
    att = {k for k in tensors if k.startswith("att.")}
    if att == MOBA_ATT:
        return "moba"
    raise FormatError(
        f"block {pos} is neither RWKV-7 (att.w1) nor MoBA (only att.receptance/key/value/output): "
        "size inference reads those two kinds"
    )


def infer_sizes(shapes: Mapping[str, Shape], layout: str | None = None) -> Sizes:
    """Sizes from names and shapes alone (`{name: shape}`, e.g. `source.shapes()`); any layout of
    LAYOUTS, detected when not given. Raises FormatError for what these formats cannot hold and
    SizeMismatchError naming every tensor that disagrees with the rest."""
    layout, sd = to_rwkvx_shapes(shapes, layout)
    if "emb.weight" not in sd or len(sd["emb.weight"]) != 2:
        raise FormatError("no 2-D emb.weight: cannot read vocab_size and n_embd")
    V, C = sd["emb.weight"]
    blocks = block_tensors(sd)
    if not blocks:
        raise FormatError("no blocks.N tensors: cannot read the stack")
    kinds = [block_kind(pos, blocks[pos]) for pos in range(len(blocks))]
    rwkv = [pos for pos, k in enumerate(kinds) if k == "rwkv7"]
    if not rwkv:
        raise FormatError("no RWKV-7 block: cannot read head_size and the LoRA ranks")
    first = blocks[rwkv[0]]
    r_k = first.get("att.r_k", ())
    if len(r_k) != 2 or r_k[0] * r_k[1] != C:
        raise FormatError(f"blocks.{rwkv[0]}.att.r_k is {list(r_k)}, not [heads, head_size] of n_embd {C}")
    head_size = r_k[1]
    # Layer 0's v LoRA is never used (it sets v_first) and HF has none: read v from the next RWKV-7 block.
    v_from = blocks[rwkv[1]] if len(rwkv) > 1 else first
    try:
        ranks = LoraRanks(first["att.w1"][-1], first["att.a1"][-1], v_from["att.v1"][-1], first["att.g1"][-1])
        ffn = first["ffn.key.weight"][0]
    except (KeyError, IndexError):
        raise FormatError(f"block {rwkv[0]} lacks one of att.w1, a1, v1, g1, ffn.key.weight") from None
    sizes = Sizes(layout, V, C, head_size, kinds, ranks, ffn)
    problems = mismatch(sd, expected_shapes(sizes))
    if problems:
        raise SizeMismatchError(f"the tensors disagree with each other ({sizes_line(sizes)}): {problems}")
    if ffn != 4 * C:
        raise FormatError(f"the channel mix is {ffn} wide; rwkvx's is 4 x n_embd = {4 * C}")
    if not ranks.follows_rule(C):
        sizes.notes.append(f"LoRA ranks {ranks} differ from rwkvx's rule ({LoraRanks.rule(C)})")
    return sizes


def sizes_line(s: Sizes) -> str:
    eps = f" ln_x_eps={s.ln_x_eps:g}" if s.ln_x_eps is not None and s.ln_x_eps != LN_X_EPS else ""
    return (
        f"vocab_size={s.vocab_size} n_embd={s.n_embd} head_size={s.head_size} "
        f"n_layer={s.n_layer} n_attn={s.n_attn} lora {s.lora}{eps}"
    )


def config_from_sizes(sizes: Sizes, cfg: ModelConfig | None = None, written: Collection[str] = ()) -> ModelConfig:
    """`cfg` (default ModelConfig()) with every size the tensors give, except that a size the user
    wrote (`written`: ModelConfig field names, e.g. {"n_embd"}) must agree with the tensors: if
    any does not, SizeMismatchError names each tensor whose shape the written sizes contradict.
    Settings the tensors do not hold (moba_chunk, moba_top_k, ...) stay `cfg`'s."""
    cfg = cfg or ModelConfig()
    written = set(written)
    got = sizes.model_overrides()
    wrong = [k for k in SIZE_KEYS if k in written and k in got and _differs(cfg, k, got[k], sizes)]
    if wrong:
        theirs = dataclasses.replace(cfg, **{k: v for k, v in got.items() if k not in written and hasattr(cfg, k)})
        said = ", ".join(f"{k}={getattr(cfg, k)!r} (the weights: {got[k]!r})" for k in wrong)
        try:
            want = expected_shapes(sizes_of_config(theirs))
            detail = mismatch(expected_shapes(sizes), want)
        except FormatError as e:
            detail = str(e)
        raise SizeMismatchError(f"the config says {said}: {detail}")
    if "ln_x_eps" in written and "ln_x_eps" in got and not math.isclose(cfg.ln_x_eps, got["ln_x_eps"], rel_tol=1e-9):
        raise FormatError(
            f"the config says ln_x_eps={cfg.ln_x_eps:g}, the weights' ({sizes.layout}) {got['ln_x_eps']:g}; "
            "leave model.ln_x_eps out to take theirs"
        )
    return dataclasses.replace(cfg, **got)


def _differs(cfg: ModelConfig, key: str, value, sizes: Sizes) -> bool:
    if key == "layers":  # any spelling of the same stack agrees ("rwkv7*2,moba", or the rule's)
        if not cfg.layers:  # not given: n_layer and n_attn say the stack
            return False
        try:
            mine = layer_kinds(dataclasses.replace(cfg, layers=expand_layers(cfg.layers)))
        except ConfigError:
            return True
        return mine != sizes.kinds
    return getattr(cfg, key) != value
