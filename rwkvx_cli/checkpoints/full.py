"""The full checkpoint format: whole tensors, whichever parallelism held them.

    step_00000100/
        model.safetensors       the weights, RWKV-LM's parameter names
        optimizer.safetensors   the optimizer's tensors, `state.<index>.<key>` (its state_dict's layout)
        extra.safetensors       more tensors kept whole (the TBPTT carry), only when given
        meta.json               config, step, the optimizer's groups and scalars, ..., and each file's
                                size and SHA-256 (store.py)

Under FSDP2 every rank takes part in gathering the state (`full_state`) and rank 0 writes it
(`save_checkpoint`); a load checks the whole state on every rank and sets it into a plain or sharded
model (`load_full_state`), so a full checkpoint resumes on any number of ranks, in either mode.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError

from rwkvx_cli.checkpoints.ranks import sharded
from rwkvx_cli.checkpoints.store import (
    META_FORMAT,
    Root,
    check_file,
    failure_reason,
    holding,
    is_step_dir,
    meta_digest,
    open_dir,
    read_meta,
    read_safetensors,
    step_of,
    write_new,
    write_tensors,
)
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.models.optimizer import implementation, restore_implementation


# -- writing ---------------------------------------------------------------------------------------------
def save_checkpoint(
    ckpt_root: Path | Root, step: int, weights, optimizer, meta: dict, keep_last: int, extra: dict | None = None
) -> Path:
    """`ckpt_root`: the checkpoints folder (made as needed), or the Root a run holds. `weights`: a module
    or its state_dict; `optimizer`: an optimizer, its state_dict, or None. `extra`: more tensors to keep
    (e.g. the TBPTT carry), written to extra.safetensors. A failure is one CheckpointError, the partial
    `.tmp-step_N` removed (from the folder held, wherever it is now)."""
    path = ckpt_root.path if isinstance(ckpt_root, Root) else Path(ckpt_root)
    try:
        with holding(ckpt_root) as root:
            try:
                return _save(root, step, weights, optimizer, meta, keep_last, extra)
            except BaseException:
                root.discard(f".tmp-step_{step:08d}")
                raise
    except (OSError, SafetensorError, CheckpointError) as e:  # a full disk, a file-size limit, a lost directory
        raise CheckpointError(
            f"cannot write the checkpoint of step {step} in {path}: {failure_reason(e)}; "
            "the earlier checkpoints are intact"
        ) from None


def _save(root: Root, step: int, weights, optimizer, meta: dict, keep_last: int, extra: dict | None) -> Path:
    final, tmp = f"step_{step:08d}", f".tmp-step_{step:08d}"
    root.begin(tmp)
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    files = {"model.safetensors": weights}
    if optimizer is not None:
        sd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        opt_tensors, opt_meta = _optimizer_tensors(sd)
        files["optimizer.safetensors"] = opt_tensors
        meta = {**meta, "optimizer": opt_meta}
    if extra:
        files["extra.safetensors"] = extra
    with open_dir(root.path / tmp, root) as dir_fd:
        listing = {name: write_tensors(tensors, root.path / tmp / name, dir_fd) for name, tensors in files.items()}
        meta = {**meta, "step": step, "format": META_FORMAT, "files": listing}
        meta["meta_sha256"] = meta_digest(meta)
        write_new(root.path / tmp / "meta.json", (json.dumps(meta, indent=2) + "\n").encode("utf-8"), dir_fd)
        os.fsync(dir_fd)
    path = root.commit(tmp, final)
    root.prune(keep_last)
    return path


def _optimizer_tensors(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
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


# -- reading -----------------------------------------------------------------------------------------------
def verify(ckpt: Path) -> dict:
    """A full checkpoint's meta.json, after checking it and every file it lists against their SHA-256."""
    meta = read_meta(ckpt)
    if "meta_sha256" in meta and meta["meta_sha256"] != meta_digest(meta):
        raise CheckpointError(f"{ckpt / 'meta.json'} does not match its own checksum (corrupted)")
    if is_step_dir(ckpt) and meta["step"] != step_of(ckpt):
        raise CheckpointError(f"{ckpt / 'meta.json'} says step {meta['step']}, its directory {ckpt.name}")
    for name, want in meta.get("files", {}).items():
        if name not in ("model.safetensors", "optimizer.safetensors", "extra.safetensors"):
            raise CheckpointError(f"{ckpt / 'meta.json'} lists an unexpected file {name!r}")
        check_file(ckpt / name, want)
    if "files" in meta and "model.safetensors" not in meta["files"]:
        raise CheckpointError(f"{ckpt / 'meta.json'} lists no model.safetensors")
    return meta


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(ckpt / "model.safetensors")


def load_optimizer_state(ckpt: Path, meta: dict) -> dict | None:
    """The optimizer's state_dict (integer keys), or None for a weights-only checkpoint."""
    if "optimizer" not in meta:
        return None
    tensors = read_safetensors(ckpt / "optimizer.safetensors")
    try:
        return _optimizer_state(tensors, meta["optimizer"])
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{ckpt}: the optimizer state is malformed ({type(e).__name__}: {e})") from None


# -- the whole state of a plain, DDP or FSDP2 model ---------------------------------------------------------
def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its state_dict's integer order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict | None]:
    """(weights, optimizer state_dict with integer keys), full tensors on the CPU; under FSDP a
    collective whose result only rank 0 gets (the others get empty dicts)."""
    if not sharded(model):
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else None
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    if optimizer is None:
        return weights, None
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not osd:
        return weights, {}
    index = {name: i for i, name in enumerate(param_names(model, optimizer))}
    return weights, {
        "state": {index[name]: st for name, st in osd["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]],
    }


def load_full_state(model: torch.nn.Module, optimizer, weights: dict, optim_state: dict | None) -> None:
    """Load full tensors (as written by `full_state`) into a plain or sharded model and its optimizer.
    The optimizer keeps its own implementation flags (models/optimizer.py), whatever the state's say."""
    flags = implementation(optimizer) if optimizer is not None else None
    if not sharded(model):
        model.load_state_dict(weights)
        if optim_state is not None:
            optimizer.load_state_dict(optim_state)
            restore_implementation(optimizer, flags)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=opts)
    if optim_state is not None:
        names = param_names(model, optimizer)
        groups = optim_state["param_groups"]
        osd = {
            "state": {names[int(i)]: st for i, st in optim_state["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in groups],
        }
        # Not strict: parameters that never get a gradient (layer 0's frozen att.v0/v1/v2) have no state.
        set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True, strict=False))
        restore_implementation(optimizer, flags)
