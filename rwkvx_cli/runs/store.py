"""The checkpoint store: tensors in safetensors, everything else in JSON; never pickle.

Layout: <run>/checkpoints/step_00000100/{model.safetensors, optimizer.safetensors,
[extra.safetensors], meta.json}, or a sharded checkpoint's shards and index (runs/sharded.py,
told apart by its meta.json: `is_sharded`; verified, listed, kept and set aside here as a full
one). A checkpoint is written under a temporary name, its files fsynced, then the directory is
renamed into place, so a crash never leaves a partial checkpoint under a real name. `meta.json`
is written last and lists every file's size and SHA-256: a checkpoint counts only when meta.json
is complete, and it is used only when every file matches. Loading takes the newest such
checkpoint and falls back to older ones past a damaged one (which is renamed `corrupt-step_...`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.fsio import atomic_write_text, fsync_dir, fsync_path

META_FORMAT = 2  # 2: meta.json lists files with sizes and SHA-256; 1 (no "files"): checked by loading


class CheckpointError(RwkvxError):
    pass


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


def file_entry(path: Path) -> dict:
    """meta.json's record of one written file: its size and SHA-256 (checked by `check_file`)."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def check_file(path: Path, want: dict) -> None:
    """The file matches its meta.json record `want` (file_entry): a one-line CheckpointError if not."""
    try:
        size = path.stat().st_size
    except OSError:
        raise CheckpointError(f"{path} is missing") from None
    if size != want["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes, but meta.json says {want['bytes']} (truncated?)")
    if _sha256(path) != want["sha256"]:
        raise CheckpointError(f"{path} does not match its SHA-256 in meta.json (corrupted)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def meta_digest(meta: dict) -> str:
    """SHA-256 of meta.json's own content (without this field), so a damaged but parseable one is caught."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def save_checkpoint(
    ckpt_root: Path, step: int, weights, optimizer, meta: dict, keep_last: int, extra: dict | None = None
) -> Path:
    """`weights`: a module or its state_dict; `optimizer`: an optimizer, its state_dict, or None.
    `extra`: more tensors to keep (e.g. the TBPTT carry), written to extra.safetensors."""
    try:
        return _save(ckpt_root, step, weights, optimizer, meta, keep_last, extra)
    except (OSError, SafetensorError) as e:  # a full disk, a file-size limit, a read-only directory
        shutil.rmtree(ckpt_root / f".tmp-step_{step:08d}", ignore_errors=True)
        raise CheckpointError(
            f"cannot write the checkpoint of step {step} in {ckpt_root}: {io_reason(e)}; "
            "the earlier checkpoints are intact"
        ) from None


def io_reason(e: Exception) -> str:
    """An I/O failure in a few words: OSError's strerror, or the OS message inside a SafetensorError."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    found = re.search(r'message: "([^"]+)"|I/O error: (.+?) \(os error', str(e))
    if found:
        return found.group(1) or found.group(2)
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _save(ckpt_root: Path, step: int, weights, optimizer, meta: dict, keep_last: int, extra: dict | None) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".tmp-step_*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-step_{step:08d}"
    tmp.mkdir()
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    files = {"model.safetensors": _cpu(weights)}
    if optimizer is not None:
        sd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        opt_tensors, opt_meta = _optimizer_tensors(sd)
        files["optimizer.safetensors"] = opt_tensors
        meta = {**meta, "optimizer": opt_meta}
    if extra:
        files["extra.safetensors"] = _cpu(extra)
    listing = {}
    for name, tensors in files.items():
        save_file(tensors, tmp / name)
        fsync_path(tmp / name)
        listing[name] = file_entry(tmp / name)
    meta = {**meta, "step": step, "format": META_FORMAT, "files": listing}
    meta["meta_sha256"] = meta_digest(meta)
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=2) + "\n")
    if final.exists():  # a damaged one left under this name (a good one would have been resumed from)
        if any(final.iterdir()):
            set_aside(final)
        else:
            final.rmdir()  # empty: nothing to keep
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def is_step_dir(p: Path) -> bool:
    name = p.name
    return name.startswith("step_") and len(name) >= 13 and name[5:].isdigit()


def step_dirs(ckpt_root: Path) -> list[Path]:
    """Every step_* directory that holds anything, complete or not (a missing meta.json beside
    other files is damage: rwkvx renames a checkpoint into place only once it is whole), oldest
    first. An empty one holds nothing to keep or resume from, and is not listed."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.glob("step_*") if is_step_dir(p) and p.is_dir() and any(p.iterdir())]
    return sorted(found, key=step_of)


def had_checkpoints(ckpt_root: Path) -> bool:
    """Whether a run has saved checkpoints: step directories, or damaged ones set aside."""
    return bool(step_dirs(ckpt_root)) or (ckpt_root.is_dir() and any(ckpt_root.glob("corrupt-step_*")))


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint corrupt-step_... (corrupt-step_...-2, ... if taken): never deleted,
    and neither listed nor counted by keep_last again."""
    target = path.with_name(f"corrupt-{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"corrupt-{path.name}-{n}")
    os.rename(path, target)
    return target


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (those with meta.json), oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.glob("step_*") if is_step_dir(p) and (p / "meta.json").is_file()]
    return sorted(found, key=step_of)


def read_meta(ckpt: Path) -> dict:
    """meta.json, checked to have the fields every reader relies on."""
    path = ckpt / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path} is unreadable: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is unreadable: nested too deeply") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    step, config = meta.get("step"), meta.get("config")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: 'step' is missing or not a non-negative integer")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: 'config' is missing or not an object")
    files = meta.get("files")
    if "files" in meta and not (
        isinstance(files, dict)
        and all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
    ):
        raise CheckpointError(f"{path}: 'files' is not a list of sizes and checksums")
    return meta


def is_sharded(meta: dict) -> bool:
    """Whether a checkpoint's meta.json is a sharded checkpoint's (runs/sharded.py)."""
    from rwkvx_cli.runs import sharded  # sharded builds on this module: imported when used

    return sharded.is_sharded(meta)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` looks like one checkpoint (meta.json beside its weights: model.safetensors, or a
    sharded checkpoint's index.json), not a run directory or checkpoints folder; nothing is verified."""
    path = Path(path)
    return (path / "meta.json").is_file() and any((path / n).is_file() for n in ("model.safetensors", "index.json"))


def verify(ckpt: Path) -> dict:
    """meta.json, after checking it and every file it lists against their SHA-256 (a sharded
    checkpoint's index and shards too: runs/sharded.py)."""
    meta = read_meta(ckpt)
    if is_sharded(meta):
        from rwkvx_cli.runs import sharded

        return sharded.verify(ckpt)[0]
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


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file; anything unreadable is a CheckpointError."""
    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from None


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(ckpt / "model.safetensors")


def open_weights(ckpt: Path, meta: dict):
    """The weights of a verified checkpoint (`meta`: its meta.json) as a TensorSource, read tensor by
    tensor: model.safetensors memory-mapped, or a sharded checkpoint's rows gathered from its shards
    one tensor at a time, so that neither is ever held whole besides the model it goes into."""
    if is_sharded(meta):
        from rwkvx_cli.runs import sharded

        return sharded.ShardedSource(ckpt, sharded.read_index(ckpt, meta), "model/")
    from rwkvx_cli.runs.formats.tensors import SafetensorsFiles

    return SafetensorsFiles([ckpt / "model.safetensors"])


def load_extra(ckpt: Path) -> dict[str, torch.Tensor]:
    if not (ckpt / "extra.safetensors").is_file():
        return {}
    return read_safetensors(ckpt / "extra.safetensors")


def load_optimizer_state(ckpt: Path, meta: dict) -> dict | None:
    """The optimizer's state_dict (integer keys), or None for a weights-only checkpoint."""
    if "optimizer" not in meta:
        return None
    tensors = read_safetensors(ckpt / "optimizer.safetensors")
    try:
        return _optimizer_state(tensors, meta["optimizer"])
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{ckpt}: the optimizer state is malformed ({type(e).__name__}: {e})") from None


def verify_step(path: Path) -> dict:
    """`verify` for a step directory, which may lack meta.json (a damaged one: rwkvx renames a
    checkpoint into place only once it is whole)."""
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"{path / 'meta.json'} is missing")
    return verify(path)


def latest_good(
    ckpt_root: Path,
    on_skip: Callable[[Path, str], None] | None = None,
    quarantine: bool = False,
    check: Callable[[Path], dict] = verify_step,
    paths: list[Path] | None = None,
):
    """(path, meta) of the newest checkpoint that `check` passes, or None. Each damaged newer one (a
    step directory without meta.json included) is reported to `on_skip(path, reason)` and, with
    `quarantine`, set aside (`set_aside`). `paths`: the candidates, newest first (None: the step
    directories of `ckpt_root`)."""
    for path in reversed(step_dirs(ckpt_root)) if paths is None else paths:
        try:
            return path, check(path)
        except CheckpointError as e:
            if on_skip:
                on_skip(path, str(e))
            if quarantine:
                set_aside(path)
    return None


def resolve_checkpoint(path: Path, on_skip: Callable[[Path, str], None] | None = None) -> tuple[Path, dict]:
    """(checkpoint directory, its verified meta.json) from a checkpoint directory itself, or the newest
    good one of a run directory or checkpoints folder."""
    path = Path(path)
    if is_checkpoint_dir(path):
        return path, verify(path)
    for root in (path / "checkpoints", path):
        if step_dirs(root):
            found = latest_good(root, on_skip)
            if found is None:
                raise CheckpointError(f"every checkpoint in {root} is damaged")
            return found
    raise CheckpointError(f"no checkpoint found at {path}")
