"""Export a checkpoint: RWKV-LM's `.pth` state dict (tensors only, loadable with
`torch.load(weights_only=True)` and by the `rwkv` pip package), or safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from rwkvx_cli.errors import RwkvxError, UsageError
from rwkvx_cli.fsio import check_output, create_temp, fsync_path
from rwkvx_cli.models import layer_kinds
from rwkvx_cli.runs import store
from rwkvx_cli.runs.opening import find_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_checkpoint(
    checkpoint: Path, out: Path, fmt: str, dtype: str = "fp32", on_skip=None, force: bool = False
) -> dict:
    """`on_skip(path, reason)` hears of each damaged checkpoint passed over for an older one. An
    existing `out` is replaced only with `force`; never a directory, nor a file in a checkpoint."""
    if fmt not in ("rwkv-lm", "safetensors"):
        raise UsageError(f"unknown export format {fmt!r}; valid: rwkv-lm, safetensors")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    out = check_output(out, force, "--out")
    ckpt = find_checkpoint(checkpoint, on_skip)
    path, meta = ckpt.path, ckpt.meta
    other = sorted(set(layer_kinds(ckpt.config.model)) - {"rwkv7"})
    if fmt == "rwkv-lm" and other:
        raise RwkvxError(f"the rwkv-lm format holds plain RWKV-7 models; this one has {', '.join(other)} blocks")
    weights = store.load_weights(path)
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in weights.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, f = create_temp(out)  # a new file: a link planted at the temporary name is not followed
    try:
        with f:
            if fmt == "rwkv-lm":
                torch.save(tensors, f)
        if fmt == "safetensors":
            save_file(tensors, tmp, metadata={"rwkvx_config": json.dumps(meta["config"]), "step": str(meta["step"])})
        fsync_path(tmp)
        os.replace(tmp, out)
    except (OSError, SafetensorError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        tmp.unlink(missing_ok=True)
        raise RwkvxError(f"cannot write {out}: {store.io_reason(e)}") from None
    return {"checkpoint": str(path), "step": meta["step"], "out": str(out), "format": fmt, "tensors": len(tensors)}
