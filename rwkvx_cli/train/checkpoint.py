"""Checkpoints: tensors in safetensors, everything else in JSON; never pickle.

Layout: <run>/checkpoints/step_00000100/{model.safetensors, optimizer.safetensors,
meta.json}. A checkpoint is written under a temporary name, its files fsynced,
then the directory is renamed into place, so a crash never leaves a partial
checkpoint under a real name; `meta.json` is written last and marks it complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.fsio import atomic_write_text, fsync_dir, fsync_path


class CheckpointError(RwkvxError):
    pass


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors = {}
    scalars = {}
    for idx, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = val
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t
    for name, val in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = val
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    ckpt_root: Path, step: int, model, optimizer, meta: dict, keep_last: int, extra: dict | None = None
) -> Path:
    """`extra`: more tensors to keep (e.g. the TBPTT carry), written to extra.safetensors."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, tmp / "model.safetensors")
    fsync_path(tmp / "model.safetensors")
    if optimizer is not None:
        opt_tensors, opt_meta = _optimizer_tensors(optimizer)
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        fsync_path(tmp / "optimizer.safetensors")
        meta = {**meta, "optimizer": opt_meta}
    if extra:
        save_file({k: v.detach().cpu().contiguous() for k, v in extra.items()}, tmp / "extra.safetensors")
        fsync_path(tmp / "extra.safetensors")
    atomic_write_text(tmp / "meta.json", json.dumps({**meta, "step": step}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (those with meta.json), oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.glob("step_*") if (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory from itself, a run directory (its latest) or a checkpoints folder."""
    path = Path(path)
    if (path / "meta.json").is_file() and (path / "model.safetensors").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(f"no checkpoint found at {path}")


def read_meta(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt / 'meta.json'} is unreadable: {e}") from None


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(ckpt / "model.safetensors")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{ckpt / 'model.safetensors'} is unreadable: {e}") from None


def load_into(model, weights: dict[str, torch.Tensor], source: str) -> None:
    """Strict load that reports every missing, unexpected or mis-shaped tensor."""
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(weights))
        if weights[k].shape != own[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
    if shapes:
        problems.append(f"shape mismatch {', '.join(shapes[:5])}")
    if problems:
        raise CheckpointError(f"{source} does not match the model: {'; '.join(problems)}")
    model.load_state_dict(weights)


def load_extra(ckpt: Path) -> dict[str, torch.Tensor]:
    if not (ckpt / "extra.safetensors").is_file():
        return {}
    try:
        return load_file(ckpt / "extra.safetensors")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{ckpt / 'extra.safetensors'} is unreadable: {e}") from None


def load_optimizer(ckpt: Path, optimizer, meta: dict) -> None:
    try:
        tensors = load_file(ckpt / "optimizer.safetensors")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{ckpt / 'optimizer.safetensors'} is unreadable: {e}") from None
    optimizer.load_state_dict(_optimizer_state(tensors, meta["optimizer"]))
