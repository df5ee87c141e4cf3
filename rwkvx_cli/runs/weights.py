"""Weights into a model: from a checkpoint of ours or from elsewhere (a `.safetensors` file, an
RWKV-LM or RWKV-X `.pth`, an HF directory), never by unpickling code; a strict load that names every missing,
unexpected or mis-shaped tensor and refuses NaN/inf."""

from __future__ import annotations

from pathlib import Path

import torch

from rwkvx_cli.runs.store import CheckpointError


def check_finite(weights: dict[str, torch.Tensor], source: str) -> None:
    for name, t in weights.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{source}: {name} holds non-finite values")


def load_into(model, weights, source: str) -> None:
    """Strict load that reports every missing, unexpected or mis-shaped tensor, refuses a tensor that is
    not floating point where the model's is (an integer or bool tensor would be cast into weights), and
    NaN/inf, including values the model's dtype cannot hold (an fp64 1e300 would load as inf).
    `weights`: a state dict, or a TensorSource (a sharded checkpoint's) read one tensor at a time."""
    if not isinstance(weights, dict):
        return _load_streaming(model, weights, source)
    own = model.state_dict()
    problems = mismatch(own, weights)
    if problems:
        raise CheckpointError(f"{source} does not match the model: {problems}")
    for name, t in weights.items():
        if own[name].is_floating_point() and not t.is_floating_point():
            raise CheckpointError(f"{source}: {name} is {str(t.dtype).removeprefix('torch.')}, not floating point")
    check_finite(weights, source)
    for name, t in weights.items():  # one cast copy at a time
        if t.is_floating_point() and t.dtype != own[name].dtype and not torch.isfinite(t.to(own[name].dtype)).all():
            want = str(own[name].dtype).removeprefix("torch.")
            raise CheckpointError(f"{source}: {name} holds values too large for the model's {want}")
    model.load_state_dict(weights)


def _load_streaming(model, weights, source: str) -> None:
    """load_into from a TensorSource, one tensor at a time, so that the weights are never held twice (the
    model's, and a second copy to load from). Names, shapes and dtypes are checked before any value is
    read; a tensor found non-finite (or too large) stops the load with the model partly loaded: the
    caller discards it, as it does on any failure."""
    own = model.state_dict()
    names = weights.names()
    shapes = {n: torch.empty(weights.shape(n), dtype=weights.dtype(n), device="meta") for n in names}
    problems = mismatch(own, shapes)
    if problems:
        raise CheckpointError(f"{source} does not match the model: {problems}")
    for name in names:
        if own[name].is_floating_point() and not weights.dtype(name).is_floating_point:
            dtype = str(weights.dtype(name)).removeprefix("torch.")
            raise CheckpointError(f"{source}: {name} is {dtype}, not floating point")
    with torch.no_grad():
        for name in names:
            t = weights.get(name)
            check_finite({name: t}, source)
            want = own[name].dtype
            if t.is_floating_point() and t.dtype != want and not torch.isfinite(t.to(want)).all():
                dtype = str(want).removeprefix("torch.")
                raise CheckpointError(f"{source}: {name} holds values too large for the model's {dtype}")
            own[name].copy_(t)
            del t
            weights.release(name)


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


def load_weights_file(path: Path | str) -> dict[str, torch.Tensor]:
    """Weights from elsewhere, under rwkvx's names, never by unpickling code: a checkpoint or run
    directory, an HF (fla) directory, a .safetensors file, or a .pth/.pt state dict (RWKV-LM's or
    RWKV-X's, through torch.load(weights_only=True)); read tensor by tensor (runs/formats)."""
    from rwkvx_cli.runs.formats import materialize, open_source

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"weights file not found: {path}")
    if path.is_file() and path.suffix not in (".safetensors", ".pth", ".pt"):
        raise CheckpointError(f"{path}: expected a .safetensors or .pth file, or a checkpoint or HF directory")
    with open_source(path) as source:
        return materialize(source)
