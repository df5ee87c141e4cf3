"""The checkpoints folder on disk, whichever format: tensors in safetensors, everything else in JSON;
never pickle.

    <run>/checkpoints/
        step_00000100/         one checkpoint: full.py's files or sharded.py's, and meta.json
        .tmp-step_00000200/    a save being written (removed by the next save if it was killed)
        corrupt-step_00000150/ a damaged checkpoint set aside: never deleted, never counted again

A checkpoint is written under a temporary name, its files fsynced, then the directory is renamed
into place, so a crash never leaves a partial checkpoint under a real name. `meta.json` is written
last and lists every file's size and SHA-256 (`file_entry`, `check_file`) with a checksum of its own
(`meta_digest`): a checkpoint counts only when meta.json is complete (`list_checkpoints`), and it is
used only when every file matches (find.py). keep_last removes the oldest complete ones
(`Root.prune`); a damaged one is renamed `corrupt-step_...` (`set_aside`).

A save writes into a checkpoints folder held open (`Root`): `.tmp-step_N`, every file in it, the
rename into place and keep_last's removals are relative to the open folder, never through its path,
so a run directory moved or replaced during a save receives nothing and a planted link is never
followed (every file is made new: fsio.create_new).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.formats import write
from rwkvx_cli.formats.tensors import DictSource
from rwkvx_cli.fsio import LinkRefused, create_new, fsync_file, remove_entry

META_FORMAT = 2  # 2: meta.json lists files with sizes and SHA-256; 1 (no "files"): checked by loading


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


# -- the checkpoints folder a save writes into -----------------------------------------------------------
def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError raised inside names `path` (an operation relative to a directory descriptor names only
    the last component)."""
    try:
        yield
    except OSError as e:
        e.filename = str(path)
        raise


def check_root(path: Path) -> None:
    """Refuse a checkpoints folder that is a symbolic link (rwkvx never makes one, and writes through
    none) or not a directory, in one line; a missing one is made by the first save (Root.open)."""
    path = Path(path)
    if path.is_symlink():
        raise CheckpointError(str(LinkRefused(path)))
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")


class Root:
    """A checkpoints folder held open while saves go into it (a training run holds its own from its first
    save on: manager.py).

    The folder's parent (the run directory) is opened, the folder made inside it with a plain mkdir
    (never a run directory that was moved away) and opened without following a link: a symbolic link
    there is refused. Every entry a save makes, renames or removes is then named relative to the open
    folder (`dir_fd=`), so the save lands in the folder that was opened, never in one put at its path
    meanwhile. `check()` raises when the run directory or the folder is no longer at its path (moved,
    deleted or replaced): `begin` and `commit` call it, before a save makes anything and before it
    renames `.tmp-step_N` into place; the failed save then removes `.tmp-step_N` from where it is."""

    def __init__(self, path: Path, parent_fd: int, fd: int):
        self.path, self.parent_fd, self.fd = Path(path), parent_fd, fd
        self._closer = weakref.finalize(self, _close, parent_fd, fd)

    @classmethod
    def open(cls, path: Path | str, parents: bool = False) -> Root:
        """Open the checkpoints folder `path`, made if missing. `parents`: make the directories above it
        too (a tool's or a test's own folder; a run's is made only inside its existing run directory)."""
        path = Path(path)
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        with _naming(path.parent):
            parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with _naming(path):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path.name, dir_fd=parent_fd)
                if stat.S_ISLNK(os.lstat(path.name, dir_fd=parent_fd).st_mode):
                    raise CheckpointError(str(LinkRefused(path)))
                fd = os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
        except BaseException:
            _close(parent_fd)
            raise
        return cls(path, parent_fd, fd)

    def close(self) -> None:
        self._closer()

    def check(self, locked: tuple[int, int] | None = None) -> None:
        """Raise CheckpointError unless the run directory held is still at its path (and, given
        `locked`, the (st_dev, st_ino) of the directory this process locked: runs/lock.py, is that
        one) and the folder held still in it."""

        def at(name, dir_fd=None, follow=False):
            try:
                return _identity(os.stat(name, dir_fd=dir_fd, follow_symlinks=follow))
            except OSError:
                return None

        run = _identity(os.fstat(self.parent_fd))
        if at(self.path.parent, follow=True) != run or locked not in (None, run):  # a link run directory: its target
            raise CheckpointError(
                f"the run directory {self.path.parent} was moved, deleted or replaced while this process held it; "
                "stopping without writing a checkpoint there"
            )
        if at(self.path.name, self.parent_fd) != _identity(os.fstat(self.fd)):
            raise CheckpointError(f"{self.path} was moved, deleted or replaced during the run; stopping")

    def begin(self, tmp: str) -> None:
        """After check(): remove every `.tmp-step_*` a killed save left (a link there unlinked, never
        followed: a run has at most one save in flight), then make `tmp` (`.tmp-step_N`) new."""
        self.check()
        for name in os.listdir(self.fd):
            if name.startswith(".tmp-step_"):
                with _naming(self.path / name):
                    remove_entry(name, self.fd)
        with _naming(self.path / tmp):
            os.mkdir(tmp, dir_fd=self.fd)

    def discard(self, tmp: str) -> None:
        """Remove a failed save's `tmp`, wherever the folder is now; nothing raised."""
        with contextlib.suppress(OSError):
            remove_entry(tmp, self.fd)

    def commit(self, tmp: str, final: str) -> Path:
        """After check(): rename the written `tmp` to `final` and make the rename durable. What is
        already under `final` is kept aside when it holds anything (a damaged checkpoint: a good one
        would have been resumed from), removed when it is an empty directory or a link."""
        self.check()
        with _naming(self.path / final):
            try:
                st = os.lstat(final, dir_fd=self.fd)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                os.unlink(final, dir_fd=self.fd)
            elif st is not None:
                try:
                    os.rmdir(final, dir_fd=self.fd)  # empty: nothing to keep
                except OSError:
                    set_aside(Path(final), self.fd)
            os.replace(tmp, final, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        with contextlib.suppress(OSError):
            os.fsync(self.fd)
        return self.path / final

    def prune(self, keep_last: int) -> None:
        """Remove all but the newest `keep_last` complete checkpoints (list_checkpoints' rule, over the
        folder held: a link is neither counted nor followed)."""
        complete = []
        for name in os.listdir(self.fd):
            try:
                real = stat.S_ISDIR(os.lstat(name, dir_fd=self.fd).st_mode)
                real = real and stat.S_ISREG(os.lstat(f"{name}/meta.json", dir_fd=self.fd).st_mode)
            except OSError:
                continue
            if real and is_step_dir(Path(name)):
                complete.append(name)
        for name in sorted(complete, key=lambda n: step_of(Path(n)))[:-keep_last]:
            with contextlib.suppress(OSError):
                remove_entry(name, self.fd)


@contextlib.contextmanager
def open_dir(path: Path, root: Root | None = None) -> Iterator[int]:
    """A descriptor of the directory `path` (a save's `.tmp-step_N`), not followed if it is a link: in
    `root`'s folder held open when given, else by path (a rank that holds no Root). Closed after."""
    with _naming(path):
        fd = os.open(
            path.name if root else path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root.fd if root else None
        )
    try:
        yield fd
    finally:
        os.close(fd)


def write_tensors(tensors: dict[str, torch.Tensor], path: Path, dir_fd: int, metadata: dict | None = None) -> dict:
    """Write `tensors` to a new safetensors file `path` in the open directory `dir_fd` (its parent), the
    largest item size first (each tensor aligned to it), each copied to the CPU as it is written, and
    fsync it; returns meta.json's record of it (file_entry's), hashed as written."""
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    digest = hashlib.sha256()
    meta = {"format": "pt", **(metadata or {})}
    write.write_safetensors(DictSource(tensors), path, order, meta, digest, dir_fd)
    with _naming(path):
        size = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False).st_size
    return {"bytes": size, "sha256": digest.hexdigest()}


def write_new(path: Path, data: bytes, dir_fd: int) -> dict:
    """Write `data` to a new file `path` in the open directory `dir_fd` (fsio.create_new) and fsync it;
    returns meta.json's record of it."""
    with create_new(path, dir_fd) as f:
        f.write(data)
        fsync_file(f)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@contextlib.contextmanager
def holding(ckpt_root: Path | Root) -> Iterator[Root]:
    """`ckpt_root` itself when it is a Root, else one opened (with its parents made) for the block."""
    if isinstance(ckpt_root, Root):
        yield ckpt_root
        return
    root = Root.open(ckpt_root, parents=True)
    try:
        yield root
    finally:
        root.close()


def failure_reason(e: BaseException) -> str:
    """A failed save's error in a few words: the file it names, if any, and why."""
    if isinstance(e, OSError):
        return f"{str(e.filename) + ': ' if e.filename else ''}{io_reason(e)}"
    return io_reason(e)


def io_reason(e: Exception) -> str:
    """An I/O failure in a few words: OSError's strerror, or the OS message inside a SafetensorError."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    found = re.search(r'message: "([^"]+)"|I/O error: (.+?) \(os error', str(e))
    if found:
        return found.group(1) or found.group(2)
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


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


def set_aside(path: Path, dir_fd: int | None = None) -> Path:
    """Rename a damaged checkpoint corrupt-step_... (corrupt-step_...-2, ... if taken): never deleted,
    and neither listed nor counted by keep_last again. With `dir_fd`, `path` is a name in that open
    directory."""

    def taken(p: Path) -> bool:
        try:
            os.lstat(p, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        return True

    target = path.with_name(f"corrupt-{path.name}")
    n = 1
    while taken(target):
        n += 1
        target = path.with_name(f"corrupt-{path.name}-{n}")
    os.rename(path, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
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


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file; anything unreadable is a CheckpointError."""
    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from None


def load_extra(ckpt: Path) -> dict[str, torch.Tensor]:
    if not (ckpt / "extra.safetensors").is_file():
        return {}
    return read_safetensors(ckpt / "extra.safetensors")


