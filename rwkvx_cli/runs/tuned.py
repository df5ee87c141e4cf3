"""State-tuned runs (`train.tune: state`, models/state.py): the frozen base their checkpoints name, and the
files the tuned state leaves in.

A state-tuned run's checkpoint holds the initial state's tensors (as its model.safetensors, or a sharded
checkpoint's shards) and their optimizer state, never the frozen weights; its meta.json's "base" names
those:

    {"source": train.init_from as given, "weights": the file or checkpoint directory read,
     "step": that checkpoint's step (an rwkvx run's; else null), "sha256": weights_digest of the model}

A resume, and every command that opens such a checkpoint, reads the base again from "weights" and
refuses it when its digest differs: the state was tuned for other weights.

The tuned state leaves in two files (`rwkvx export`):

    state              RWKV-PEFT's state file, what RWKV runtimes load (RWKV-Runner): torch.save of
                       {"blocks.{j}.att.time_state": [H, N, N]}, one per RWKV-7 block and nothing else
                       (j counts the RWKV-7 blocks: in a plain stack the block's index; in a hybrid
                       RWKV-X's `rwkv.blocks.j`, as `--format rwkv-x` numbers them)
    state-safetensors  rwkvx's: the state's tensors under their own names (models/state.py), and in the
                       header's metadata "rwkvx_state", JSON: the base (as above), the model section of
                       the config, the step and the checkpoint it came from. `eval --state` and
                       `bench --model ... --state` read it; nothing in it is pickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from rwkvx_cli.checkpoints.find import open_weights
from rwkvx_cli.checkpoints.fit import check_finite, mismatch
from rwkvx_cli.config import ConfigError, ModelConfig
from rwkvx_cli.errors import CheckpointError, RwkvxError
from rwkvx_cli.formats.errors import FormatError
from rwkvx_cli.formats.tensors import SafetensorsFiles, materialize
from rwkvx_cli.models.state import InitialState

STATE_META = "rwkvx_state"  # the metadata key of rwkvx's state file
STATE_FORMAT = 1


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's weights as loaded (each tensor's name, dtype, shape and bytes, by name): the
    same for the same values whichever file layout they came from."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def base_record(source: str, weights: str, step: int | None, model: torch.nn.Module) -> dict:
    """meta.json's "base" of a state-tuned run whose frozen `model` was loaded from `weights`."""
    return {"source": source, "weights": weights, "step": step, "sha256": weights_digest(model)}


def check_base(base: dict, model: torch.nn.Module, where: str) -> None:
    """`model`'s weights are the ones `base` names (their digest), or one CheckpointError."""
    digest = weights_digest(model)
    if digest != base.get("sha256"):
        raise CheckpointError(
            f"{where}: its state was tuned for other weights than those at {base.get('weights')} now "
            f"(sha256 {str(base.get('sha256'))[:12]}..., now {digest[:12]}...); a state fits only the weights "
            "it was tuned for"
        )


def base_of(meta: dict, where: str) -> dict | None:
    """The "base" of a checkpoint's meta.json (None: not a state-tuned run's), checked for its fields."""
    base = meta.get("base")
    if base is None:
        return None
    if not (isinstance(base, dict) and isinstance(base.get("weights"), str) and isinstance(base.get("sha256"), str)):
        raise CheckpointError(f"{where}: meta.json's base is malformed: {str(base)[:80]}")
    return base


def load_state(initial: InitialState, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Tensors named as `initial`'s (a checkpoint's, or a state file's) into it, strictly."""
    own = initial.state_dict()
    problems = mismatch(own, tensors)
    if problems:
        raise CheckpointError(f"{where} does not fit this model's tuned state: {problems}")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: {name} is {str(t.dtype).removeprefix('torch.')}, not floating point")
    check_finite(tensors, where)
    with torch.no_grad():
        for name, t in tensors.items():
            own[name].copy_(t)


def checkpoint_state(ckpt: Path, meta: dict) -> dict[str, torch.Tensor]:
    """The tuned state's tensors of a verified state-tuned checkpoint (either format)."""
    with open_weights(ckpt, meta) as source:
        return materialize(source)


def tuned_shifts(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a state's tensors hold tuned token shifts."""
    return any(name.endswith(".shift_state") for name in tensors)


# -- rwkvx's state file ---------------------------------------------------------------------------------
def state_file_meta(base: dict, model: ModelConfig, step: int, checkpoint: str, shifts: bool) -> dict:
    """The "rwkvx_state" metadata of a state file."""
    return {
        "format": STATE_FORMAT,
        "base": base,
        "model": dataclasses.asdict(model),
        "step": step,
        "checkpoint": checkpoint,
        "shifts": shifts,
    }


def read_state_file(path: Path | str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, the "rwkvx_state" metadata) of rwkvx's state file, checked for its fields; anything else
    (a torch.save'd RWKV-PEFT file included: rwkvx never unpickles one) is one RwkvxError."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise RwkvxError(
            f"--state {path}: expected rwkvx's state file (.safetensors, `rwkvx export --format state-safetensors`)"
        )
    try:
        source = SafetensorsFiles([path])
    except FormatError as e:
        raise RwkvxError(f"--state {e}") from None
    with source:
        raw = source.metadata.get(STATE_META)
        if raw is None:
            raise RwkvxError(f"--state {path}: not an rwkvx state file (no {STATE_META!r} in its metadata)")
        try:
            info = json.loads(raw)
        except ValueError:
            raise RwkvxError(f"--state {path}: its {STATE_META!r} metadata is not JSON") from None
        if not isinstance(info, dict) or info.get("format") != STATE_FORMAT:
            raise RwkvxError(f"--state {path}: an rwkvx state file of another format ({str(info)[:60]})")
        if base_of(info, f"--state {path}") is None or not isinstance(info.get("model"), dict):
            raise RwkvxError(f"--state {path}: its metadata lacks the base or the model")
        try:
            ModelConfig(**info["model"])
        except TypeError:
            raise ConfigError(f"--state {path}: its model section is not rwkvx's") from None
        tensors = materialize(source)
    return tensors, info


def peft_state(tensors: dict[str, torch.Tensor], kinds: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """RWKV-PEFT's state dict of a tuned state: `blocks.{j}.att.time_state` [H, N, N] for the j-th RWKV-7
    block (its index in a plain stack), nothing else (its readers refuse another count of keys)."""
    rwkv7 = [i for i, kind in enumerate(kinds) if kind == "rwkv7"]
    return {
        f"blocks.{j}.att.time_state": tensors[f"blocks.{i}.att.time_state"].to(dtype).contiguous()
        for j, i in enumerate(rwkv7)
    }
