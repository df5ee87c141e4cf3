"""RWKV-X's checkpoint layout (howard-hou/RWKV-X), both ways.

One `.pth` state dict, as RWKV-X's trainer saves `RWKVHybrid` (pretrain/src/model.py) and as its
inference package loads it (`rwkv_x.model.RWKV_X.load_from_ckpt`, PyPI `rwkv-x`): `rwkv.` + the
RWKV-LM names for the embedding, the RWKV-7 blocks (`rwkv.blocks.j`, numbered among the RWKV-7
blocks only), `rwkv.ln_out` and `rwkv.head`; `moba.i.{ln1,ln2}.{weight,bias}`,
`moba.i.att.{receptance,key,value,output}.weight` and `moba.i.ffn.{x_k,key.weight,value.weight}`
for the i-th attention block (`MOBABlock` / `MemoryAttentionBlock`, strict load).

The file holds no config. RWKV-X's loader reads n_embd from `rwkv.emb.weight`, the block counts
from the names, and takes 64 as the head size of the attention blocks (`n_head = n_embd // 64`)
and of the RWKV-7 state: so only head size 64 is exported. The MoBA chunk size and top-k are
training arguments (`--moba_chunk_size`, `--moba_topk`), never saved: they come from the rwkvx
config on export (returned as `rwkv_x_args`) and must be given on import.

Two facts handled here:
- RWKV-X's `moba_topk` counts the query's own chunk (moba_efficient.py, `moba_attn_varlen`:
  "adjust selective topk to moba_topk - 1, as the last chunk is always chosen"); rwkvx's
  `moba_top_k` counts only earlier chunks, so K = moba_top_k + 1. Both read "every chunk" at the
  ends: rwkvx's top_k <= 0, RWKV-X's K = 1 (no selection left: dense causal attention).
- RWKV-X runs its blocks in `get_block_exe_order`: `[rwkv x interval, moba]` n_attn times with
  interval = n_rwkv // n_attn, so when n_attn > 1 does not divide n_rwkv the leftover RWKV-7
  blocks are never run, where rwkvx runs them on top. Such a stack is refused both ways.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.formats import sizes as sz
from rwkvx_cli.formats.errors import FormatError
from rwkvx_cli.formats.hf import DTYPES
from rwkvx_cli.formats.tensors import MappedSource, Rule, Shape, TensorSource, as_source, materialize, open_tensors
from rwkvx_cli.formats.write import atomic_file

RWKV_X_HEAD_SIZE = 64  # rwkv_x/model.py: n_head = n_embd // 64, HEAD_SIZE = 64
_TOP = ("emb.weight", "ln_out.weight", "ln_out.bias", "head.weight")
_MOBA_PARTS = (
    "ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias",
    "att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight",
    "ffn.x_k", "ffn.key.weight", "ffn.value.weight",
)  # fmt: skip


def rwkv_x_order(n_rwkv: int, n_attn: int) -> list[str]:
    """The kinds in the order RWKV-X runs them (`get_block_exe_order`), leftover RWKV-7 blocks dropped."""
    if n_attn == 0:
        return ["rwkv7"] * n_rwkv
    if n_attn == 1:
        return ["rwkv7"] * n_rwkv + ["moba"]
    interval = n_rwkv // n_attn
    return (["rwkv7"] * interval + ["moba"]) * n_attn


def check_stack(kinds: list[str], head_size: int) -> None:
    """Refuse, in one line, a stack that RWKV-X would read differently."""
    others = sorted(set(kinds) - {"rwkv7", "moba"})
    if others:
        raise FormatError(f"the rwkv-x format holds RWKV-7 and MoBA blocks; this model has {', '.join(others)} blocks")
    if head_size != RWKV_X_HEAD_SIZE:
        raise FormatError(f"head size {head_size}: RWKV-X's loader assumes 64 (n_head = n_embd // 64)")
    n_rwkv, n_attn = kinds.count("rwkv7"), kinds.count("moba")
    if kinds and kinds[0] != "rwkv7":
        raise FormatError("the first block is MoBA: RWKV-X's stack starts with RWKV-7 block 0 (which holds ln0)")
    theirs = rwkv_x_order(n_rwkv, n_attn)
    if kinds != theirs:
        if n_attn > 1 and n_rwkv % n_attn:
            raise FormatError(
                f"{n_rwkv} RWKV-7 blocks do not split evenly around {n_attn} MoBA blocks: RWKV-X's "
                f"get_block_exe_order would never run the top {n_rwkv % n_attn}, which rwkvx runs"
            )
        raise FormatError(
            f"RWKV-X runs {n_rwkv} RWKV-7 and {n_attn} MoBA blocks as {_spell(theirs)}, not {_spell(kinds)}"
        )


def _spell(kinds: list[str]) -> str:
    out, prev, n = [], None, 0
    for k in [*kinds, None]:
        if k == prev:
            n += 1
            continue
        if prev is not None:
            out.append(prev if n == 1 else f"{prev}*{n}")
        prev, n = k, 1
    return ",".join(out)


def moba_topk_to_rwkv_x(top_k: int) -> int:
    """rwkvx's moba_top_k (earlier chunks; <= 0: all) as RWKV-X's --moba_topk (own chunk included; 1: all)."""
    return top_k + 1 if top_k > 0 else 1


def moba_topk_from_rwkv_x(k: int) -> int:
    return max(k - 1, 0)


def to_rwkv_x_rules(shapes: Mapping[str, Shape]) -> list[Rule]:
    """Rules from an rwkvx state dict (RWKV-7 and MoBA blocks, RWKV-X's order) to RWKV-X's names."""
    blocks = sz.block_tensors(shapes)
    kinds = [sz.block_kind(p, blocks[p]) for p in range(len(blocks))]
    rules = [Rule(f"rwkv.{n}", n) for n in _TOP if n in shapes]
    seen = {"rwkv7": 0, "moba": 0}
    for pos, kind in enumerate(kinds):
        j = seen[kind]
        seen[kind] += 1
        dst = f"rwkv.blocks.{j}." if kind == "rwkv7" else f"moba.{j}."
        rules += [Rule(dst + part, f"blocks.{pos}.{part}") for part in blocks[pos]]
    left = set(shapes) - {r.src for r in rules}
    if left:
        raise FormatError(f"no place in the rwkv-x layout for {', '.join(sorted(left)[:5])}")
    return rules


_RWKV_BLOCK = re.compile(r"rwkv\.blocks\.(\d+)\.(.+)")
_MOBA_BLOCK = re.compile(r"moba\.(\d+)\.(.+)")


def from_rwkv_x_rules(shapes: Mapping[str, Shape]) -> list[Rule]:
    """Rules from RWKV-X's names to rwkvx's, the blocks placed in the order RWKV-X runs them."""
    rwkv: dict[int, list[str]] = {}
    moba: dict[int, list[str]] = {}
    top = []
    for name in shapes:
        if name.startswith("rwkv.") and name[5:] in _TOP:
            top.append(name)
        elif m := _RWKV_BLOCK.fullmatch(name):
            rwkv.setdefault(int(m.group(1)), []).append(m.group(2))
        elif (m := _MOBA_BLOCK.fullmatch(name)) and m.group(2) in _MOBA_PARTS:
            moba.setdefault(int(m.group(1)), []).append(m.group(2))
        else:
            raise FormatError(f"{name} is not a tensor of RWKV-X's layout (rwkv.*, moba.<i>.*)")
    for what, d in (("rwkv.blocks", rwkv), ("moba", moba)):
        if sorted(d) != list(range(len(d))):
            raise FormatError(f"the {what} blocks are not numbered 0..n-1")
    n_rwkv, n_attn = len(rwkv), len(moba)
    if n_attn > 1 and n_rwkv % n_attn:
        raise FormatError(
            f"{n_rwkv} RWKV-7 blocks around {n_attn} MoBA blocks: RWKV-X's get_block_exe_order never runs "
            f"the top {n_rwkv % n_attn} of them, rwkvx would; refusing a model the two would compute differently"
        )
    rules = [Rule(n[5:], n) for n in top if n == "rwkv.emb.weight"]
    ids = {"rwkv7": 0, "moba": 0}
    for pos, kind in enumerate(rwkv_x_order(n_rwkv, n_attn)):
        j = ids[kind]
        ids[kind] += 1
        src, parts = (f"rwkv.blocks.{j}.", rwkv[j]) if kind == "rwkv7" else (f"moba.{j}.", moba[j])
        rules += [Rule(f"blocks.{pos}.{p}", src + p) for p in parts]
    return rules + [Rule(n[5:], n) for n in top if n != "rwkv.emb.weight"]


sz.RENAMES["rwkv-x"] = from_rwkv_x_rules


def to_rwkv_x(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    src = as_source(state)
    sizes = sz.infer_sizes(src.shapes())
    check_stack(sizes.kinds, sizes.head_size)
    return materialize(MappedSource(src, to_rwkv_x_rules(src.shapes())))


def from_rwkv_x(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    src = as_source(state)
    return materialize(MappedSource(src, from_rwkv_x_rules(src.shapes())))


def open_rwkv_x(path: str | Path) -> tuple[TensorSource, sz.Sizes]:
    """An RWKV-X `.pth` as a lazy rwkvx-named source and its sizes (moba_chunk, moba_top_k: None, not in the file)."""
    return read_rwkv_x(open_tensors(path))


def read_rwkv_x(base: TensorSource) -> tuple[TensorSource, sz.Sizes]:
    """`open_rwkv_x` of tensors already open under RWKV-X's names."""
    source = MappedSource(base, from_rwkv_x_rules(base.shapes()))
    sizes = sz.infer_sizes(source.shapes(), layout="rwkvx")
    sizes.layout = "rwkv-x"
    sizes.notes.append("moba_chunk and moba_top_k are not in RWKV-X files: give them (top_k = RWKV-X's K - 1)")
    return source, sizes


def rwkv_x_args(sizes: sz.Sizes, moba_chunk: int, moba_top_k: int) -> dict[str, int]:
    """RWKV-X trainer arguments (pretrain/train.py) that describe the same model."""
    return {
        "n_layer": sizes.n_layer,
        "n_embd": sizes.n_embd,
        "head_size_a": sizes.head_size,
        "vocab_size": sizes.vocab_size,
        "n_moba_layer": sizes.n_attn,
        "moba_chunk_size": moba_chunk,
        "moba_topk": moba_topk_to_rwkv_x(moba_top_k),
    }


def export_rwkv_x(
    weights: TensorSource | Mapping[str, torch.Tensor],
    out: str | Path,
    *,
    cfg: ModelConfig | None = None,
    dtype: str = "fp32",
    force: bool = False,
) -> dict:
    """Write an rwkvx model (RWKV-7 and MoBA blocks in RWKV-X's order, head size 64) as one RWKV-X
    `.pth` (tensors only). Mapped inputs stay mapped, so the file is written without a second
    in-memory copy of the model at fp32; a dtype cast holds the cast copy. Written to a temporary
    file renamed into place. Returns a summary with `rwkv_x_args` (needs `cfg` for the MoBA settings)."""
    if dtype not in DTYPES:
        raise FormatError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    source = as_source(weights)
    sizes = sz.infer_sizes(source.shapes())
    if cfg is not None:
        sz.config_from_sizes(sizes, cfg, written=sz.SIZE_KEYS)
    check_stack(sizes.kinds, sizes.head_size)
    mapped = MappedSource(source, to_rwkv_x_rules(source.shapes()), dtype=DTYPES[dtype])
    tensors = {n: mapped.get(n) for n in mapped.names()}
    tmp, f, commit = atomic_file(Path(out), force)
    try:
        torch.save(tensors, f)
        commit()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    summary = {"out": str(out), "format": "rwkv-x", "tensors": len(tensors), "sizes": sz.sizes_line(sizes)}
    if cfg is not None:
        summary["rwkv_x_args"] = rwkv_x_args(sizes, cfg.moba_chunk, cfg.moba_top_k)
    return summary
