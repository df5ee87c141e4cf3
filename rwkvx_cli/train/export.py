"""Export a checkpoint: RWKV-LM's `.pth` state dict (tensors only, loadable with
`torch.load(weights_only=True)` and by the `rwkv` pip package), or safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from rwkvx_cli.errors import RwkvxError, UsageError
from rwkvx_cli.fsio import fsync_path
from rwkvx_cli.train import checkpoint as ck

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_checkpoint(checkpoint: Path, out: Path, fmt: str, dtype: str = "fp32", on_skip=None) -> dict:
    """`on_skip(path, reason)` hears of each damaged checkpoint passed over for an older one."""
    if fmt not in ("rwkv-lm", "safetensors"):
        raise UsageError(f"unknown export format {fmt!r}; valid: rwkv-lm, safetensors")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    path = ck.resolve_checkpoint(checkpoint, on_skip)
    meta = ck.read_meta(path)
    weights = ck.load_weights(path)
    model_cfg = meta["config"]["model"]
    other = sorted(set(model_cfg.get("layers") or []) - {"rwkv7"}) or (["moba"] if model_cfg.get("n_attn", 0) else [])
    if fmt == "rwkv-lm" and other:
        raise RwkvxError(f"the rwkv-lm format holds plain RWKV-7 models; this one has {', '.join(other)} blocks")
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in weights.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if fmt == "rwkv-lm":
        torch.save(tensors, tmp)
    else:
        save_file(tensors, tmp, metadata={"rwkvx_config": json.dumps(meta["config"]), "step": str(meta["step"])})
    fsync_path(tmp)
    os.replace(tmp, out)
    return {"checkpoint": str(path), "step": meta["step"], "out": str(out), "format": fmt, "tensors": len(tensors)}
