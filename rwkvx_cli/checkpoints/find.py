"""The checkpoint to read, in either format (full.py, sharded.py: told apart by meta.json):
verified against every file's SHA-256, the newest good one of a run found past damaged newer ones
(reported, and on a resume set aside), and its weights opened tensor by tensor. Every reader of a
checkpoint starts here: `rwkvx eval`, `explain`, `export`, `init --from` (runs/opening.py,
runs/weights.py) and the trainer's resume (manager.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rwkvx_cli.checkpoints import full, sharded
from rwkvx_cli.checkpoints.store import is_step_dir, read_meta, set_aside, step_dirs
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.formats.tensors import SafetensorsFiles, TensorSource


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` looks like one checkpoint (meta.json beside its weights: model.safetensors, or a
    sharded checkpoint's index.json), not a run directory or checkpoints folder; nothing is verified."""
    path = Path(path)
    return (path / "meta.json").is_file() and any((path / n).is_file() for n in ("model.safetensors", "index.json"))


def verify(ckpt: Path) -> dict:
    """meta.json, after checking it and every file it lists against their SHA-256 (a sharded
    checkpoint's index and shards too)."""
    if sharded.is_sharded(read_meta(ckpt)):
        return sharded.verify(ckpt)[0]
    return full.verify(ckpt)


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
    """(checkpoint directory, its verified meta.json) from a checkpoint directory itself (a `step_N`
    directory is one, whatever it lacks: that is named), or the newest good one of a run directory or
    checkpoints folder."""
    path = Path(path)
    if is_checkpoint_dir(path) or (is_step_dir(path) and path.is_dir()):
        return path, verify_step(path)
    for root in (path / "checkpoints", path):
        if step_dirs(root):
            found = latest_good(root, on_skip)
            if found is None:
                raise CheckpointError(f"every checkpoint in {root} is damaged")
            return found
    raise CheckpointError(f"no checkpoint found at {path}")


def open_weights(ckpt: Path, meta: dict) -> TensorSource:
    """The weights of a verified checkpoint (`meta`: its meta.json) as a TensorSource, read tensor by
    tensor: model.safetensors memory-mapped, or a sharded checkpoint's rows gathered from its shards
    one tensor at a time, so that neither is ever held whole besides the model it goes into."""
    if sharded.is_sharded(meta):
        return sharded.ShardedSource(ckpt, sharded.read_index(ckpt, meta), "model/")
    return SafetensorsFiles([ckpt / "model.safetensors"])
