"""Upcycling: start a hybrid (RWKV-7 + MoBA) model from a plain RWKV-7 one.

The rule, as RWKV-X's `RWKVHybrid.init_moba_from_rwkv` (pretrain/src/model.py) does it:
- the embedding, ln_out, head and every RWKV-7 block load from the source, RWKV-7 blocks in
  order (the target's j-th RWKV-7 block is the source's j-th);
- each MoBA block copies `att.{receptance,key,value,output}.weight` and `ffn.{key,value}.weight`
  from the RWKV-7 block directly below it (RWKV-X: block (i + 1) * (n_rwkv // n_attn) - 1, the
  same block);
- the rest of a MoBA block starts fresh: `ln1`, `ln2` (LayerNorm's ones and zeros in both) and
  `ffn.x_k`. There rwkvx keeps the target's own init, whose depth is that of the block below
  (models/model.py, block_depth); RWKV-X's fresh x_k is RWKV-LM's init at layer_id = the MoBA
  block's index i among MoBA blocks (`RWKV_CMix_x070(args, i)`), which this does not copy.
- whatever the source has beyond that (a hybrid source's own MoBA blocks) is left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rwkvx_cli.formats import sizes as sz
from rwkvx_cli.formats.errors import FormatError, SizeMismatchError
from rwkvx_cli.formats.tensors import Shape

COPIED = ("att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight",
          "ffn.key.weight", "ffn.value.weight")  # fmt: skip
ACTIONS = ("load", "copy", "fresh", "left out")


@dataclass(frozen=True)
class PlanRow:
    """One table row: target tensor (None for a source tensor left out), what happens, from where."""

    target: str | None
    action: str  # one of ACTIONS
    source: str | None
    why: str


def _shapes(d: Mapping) -> dict[str, Shape]:
    return {k: tuple(v.shape) if hasattr(v, "shape") else tuple(v) for k, v in d.items()}


def upcycle_plan(source: Mapping, target: Mapping) -> list[PlanRow]:
    """Rows for every target tensor and every unused source tensor. `source`, `target`: rwkvx
    state dicts (or {name: shape}); the source in rwkvx's names from any format. Raises
    FormatError when the RWKV-7 block counts differ and SizeMismatchError naming each tensor
    whose shape differs between the two."""
    src, tgt = _shapes(source), _shapes(target)
    s_blocks, t_blocks = sz.block_tensors(src), sz.block_tensors(tgt)
    s_kinds = [sz.block_kind(p, s_blocks[p]) for p in range(len(s_blocks))]
    t_kinds = [sz.block_kind(p, t_blocks[p]) for p in range(len(t_blocks))]
    s_rwkv = [p for p, k in enumerate(s_kinds) if k == "rwkv7"]
    t_rwkv = [p for p, k in enumerate(t_kinds) if k == "rwkv7"]
    if len(s_rwkv) != len(t_rwkv):
        raise FormatError(f"the source has {len(s_rwkv)} RWKV-7 blocks, the target {len(t_rwkv)}: they load one to one")
    src_of = dict(zip(t_rwkv, s_rwkv, strict=True))
    rows: list[PlanRow] = []
    for name in tgt:
        m = sz._BLOCK.fullmatch(name)
        if not m:
            rows.append(PlanRow(name, "load", name, "embedding / output"))
            continue
        pos, part = int(m.group(1)), m.group(2)
        if part.startswith("ln0."):  # the embedding's norm, wherever block 0 is
            rows.append(PlanRow(name, "load", f"blocks.{s_rwkv[0] if s_rwkv else 0}.{part}", "ln0 of the embedding"))
        elif t_kinds[pos] == "rwkv7":
            j = t_rwkv.index(pos)
            rows.append(PlanRow(name, "load", f"blocks.{src_of[pos]}.{part}", f"RWKV-7 block {j}"))
        else:
            below = [p for p in t_rwkv if p < pos]
            if part in COPIED and below:
                rows.append(PlanRow(name, "copy", f"blocks.{src_of[below[-1]]}.{part}", "from the RWKV-7 block below"))
            else:
                why = "no RWKV-7 block below" if part in COPIED else "MoBA's own (fresh, as RWKV-X)"
                rows.append(PlanRow(name, "fresh", None, why))
    used = {r.source for r in rows if r.source}
    rows += [PlanRow(None, "left out", n, "no place in the target") for n in src if n not in used]
    bad = [
        f"{r.target} {list(tgt[r.target])} vs {r.source} {list(src[r.source])}"
        for r in rows
        if r.target and r.source and (r.source not in src or tgt[r.target] != src[r.source])
    ]
    missing = [r.source for r in rows if r.target and r.source and r.source not in src]
    if missing:
        raise SizeMismatchError(f"the source lacks {', '.join(missing[:5])}")
    if bad:
        more = f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""
        raise SizeMismatchError(f"source and target shapes differ: {'; '.join(bad[:8])}{more}")
    return rows


def apply_plan(rows: list[PlanRow], source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]):
    """The target's new state dict: loaded and copied tensors from `source` (cast to the target's
    dtype), fresh ones as `target` has them."""
    out = {}
    for r in rows:
        if r.target is None:
            continue
        t = target[r.target]
        out[r.target] = t.clone() if r.action == "fresh" else source[r.source].to(t.dtype).clone()
    return out


def plan_table(rows: list[PlanRow]) -> list[tuple[str, str, str, str]]:
    """(target, action, source, why) per row, "-" for an empty cell: the CLI's table."""
    return [(r.target or "-", r.action, r.source or "-", r.why) for r in rows]


def summary(rows: list[PlanRow]) -> dict[str, int]:
    out = dict.fromkeys(ACTIONS, 0)
    for r in rows:
        out[r.action] += 1
    return out
