"""Weights into a model, from anywhere: an rwkvx checkpoint, run directory or checkpoints folder
(checkpoints/find.py), or another tool's file (a `.safetensors` file, an RWKV-LM or RWKV-X `.pth`, an
HF directory: formats/, renamed to rwkvx's names), never by unpickling code; a strict load that names
every missing, unexpected or mis-shaped tensor and refuses NaN/inf."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from rwkvx_cli.checkpoints.find import open_weights, resolve_checkpoint
from rwkvx_cli.checkpoints.fit import check_finite, mismatch
from rwkvx_cli.checkpoints.sharded import ShardedSource
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.formats import (
    FormatError,
    Sizes,
    TensorSource,
    detect_layout,
    infer_sizes,
    materialize,
    open_hf,
    open_tensors,
)
from rwkvx_cli.formats.hf import LN_EPS, from_hf_rules
from rwkvx_cli.formats.rwkv_x import read_rwkv_x
from rwkvx_cli.formats.tensors import MappedSource, SafetensorsFiles, from_store


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


def load_weights_file(path: Path | str) -> dict[str, torch.Tensor]:
    """Weights from elsewhere, under rwkvx's names, never by unpickling code: a checkpoint or run
    directory, an HF (fla) directory, a .safetensors file, or a .pth/.pt state dict (RWKV-LM's or
    RWKV-X's, through torch.load(weights_only=True)); read tensor by tensor (open_source)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"weights file not found: {path}")
    if path.is_file() and path.suffix not in (".safetensors", ".pth", ".pt"):
        raise CheckpointError(f"{path}: expected a .safetensors or .pth file, or a checkpoint or HF directory")
    with open_source(path) as source:
        return materialize(source)


def open_source(path) -> TensorSource:
    """Weights from any supported layout at `path`, lazily, under rwkvx's names: an HF directory, an
    RWKV-X or RWKV-LM `.pth`, an rwkvx checkpoint or run directory, or a `.safetensors` file."""
    return _open(path, need_sizes=False)[0]


def open_any(path) -> tuple[TensorSource, Sizes]:
    """`open_source`, and the sizes the tensors give (what `rwkvx init --from` and `train.init_from` read)."""
    return _open(path, need_sizes=True)


def _open(path, need_sizes: bool) -> tuple[TensorSource, Sizes | None]:
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        return open_hf(path)
    if path.is_dir() and from_store(path):  # the store's own finder (verifies): model.safetensors, or the shards
        base = open_weights(*resolve_checkpoint(path))
    else:
        base = open_tensors(path)
    layout = "rwkvx" if "emb.weight" in base else detect_layout(base.names())
    if layout == "rwkv-x":
        return read_rwkv_x(base)
    if layout == "hf":
        base = MappedSource(base, from_hf_rules(base.shapes()))
    if not need_sizes:
        return base, None
    sizes = infer_sizes(base.shapes())
    if layout == "rwkvx":
        sizes.ln_x_eps = _rwkvx_ln_x_eps(base)
    elif layout == "hf":  # no config.json: fla's defaults, norm_eps 1e-5, so its group norm's eps is head_dim x 1e-5
        sizes.layout, sizes.ln_x_eps = "hf", sizes.head_size * LN_EPS
    return base, sizes


def _rwkvx_ln_x_eps(source: TensorSource) -> float | None:
    """model.ln_x_eps of an rwkvx checkpoint (its meta.json) or safetensors export (its metadata's
    config); None where none is stated (a checkpoint from before the setting: the default)."""
    if isinstance(source, ShardedSource):  # a sharded checkpoint: its meta.json, verified when it was opened
        path = source.ckpt / "meta.json"
    elif not isinstance(source, SafetensorsFiles) or len(source.paths) != 1:
        return None
    else:
        path = source.paths[0]
    try:
        if isinstance(source, SafetensorsFiles) and "rwkvx_config" in source.metadata:
            config = json.loads(source.metadata["rwkvx_config"])
        elif (path.parent / "meta.json").is_file():
            config = json.loads((path.parent / "meta.json").read_text(encoding="utf-8"))["config"]
        else:
            return None
        eps = config["model"].get("ln_x_eps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None  # no readable config beside the weights: the tensors alone, as for a bare file
    if eps is None:
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise FormatError(f"{path}: its config's model.ln_x_eps is {eps!r}, not a finite number > 0")
    return float(eps)
