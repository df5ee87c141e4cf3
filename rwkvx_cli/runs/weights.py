"""Weights into a model: from a checkpoint of ours or from elsewhere (a `.safetensors` file, an
RWKV-LM `.pth` state dict), never by unpickling code; a strict load that names every missing,
unexpected or mis-shaped tensor and refuses NaN/inf."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from rwkvx_cli.runs.store import CheckpointError, load_weights, read_safetensors, resolve_checkpoint


def check_finite(weights: dict[str, torch.Tensor], source: str) -> None:
    for name, t in weights.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{source}: {name} holds non-finite values")


def load_into(model, weights: dict[str, torch.Tensor], source: str) -> None:
    """Strict load that reports every missing, unexpected or mis-shaped tensor, and refuses NaN/inf."""
    problems = mismatch(model.state_dict(), weights)
    if problems:
        raise CheckpointError(f"{source} does not match the model: {problems}")
    check_finite(weights, source)
    model.load_state_dict(weights)


def mismatch(own: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> str:
    """What differs between two state dicts' names and shapes ("" when nothing)."""
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(weights))
        if tuple(weights[k].shape) != tuple(own[k].shape)
    ]
    problems = [
        f"{what} {_first_five(names)}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
        if names
    ]
    return "; ".join(problems)


def _first_five(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")


def _load_failure(e: Exception) -> str:
    """Why torch.load(weights_only=True) refused a file, without torch's advice to retry with
    weights_only=False: that runs the file's code, which rwkvx never does for a file from elsewhere."""
    text = str(e)
    if "Weights only load failed" in text or "weights_only" in text:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        what = f" (it would call {found.group(1)})" if found else ""
        return f"it holds Python objects besides tensors{what}; rwkvx never unpickles code"
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return first


def load_weights_file(path: Path | str) -> dict[str, torch.Tensor]:
    """Weights from elsewhere, never by unpickling code: a checkpoint or run directory, a
    .safetensors file, or a .pth/.pt state dict (RWKV-LM's) through torch.load(weights_only=True)."""
    path = Path(path)
    if path.is_dir():
        return load_weights(resolve_checkpoint(path)[0])
    if not path.is_file():
        raise CheckpointError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    if path.suffix not in (".pth", ".pt"):
        raise CheckpointError(f"{path}: expected a .safetensors or .pth file, or a checkpoint directory")
    try:
        with warnings.catch_warnings():  # a damaged file also warns (odd pickle protocol); the error says it all
            warnings.simplefilter("ignore")
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a foreign file fails in many ways (zip, pickle, EOF); all mean unreadable
        raise CheckpointError(f"{path} is not a weights-only state dict: {_load_failure(e)}") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{path} does not hold a flat state dict of named tensors")
    return sd
