"""Crash-safe file writes: a reader sees the old file or the whole new one, never half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rwkvx_cli.errors import RwkvxError, UsageError


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def fsync_file(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """Flush a file that was written by someone else (safetensors, torch.save) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    # Makes the renames durable; not every platform lets a directory be opened.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            fsync_file(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: Path | None, data) -> None:
    """An output option's JSON (`--json PATH`), written atomically; nothing when `path` is None."""
    if path is None:
        return
    try:
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise RwkvxError(f"cannot write {path}: {e.strerror}") from None


# -- directories rwkvx may write into ------------------------------------------------------------
# rwkvx writes only into a directory that is new, empty, or marked as its own (a marker file
# it leaves there), so that a mistyped path never replaces a user's files.
RUN_MARKER = ".rwkvx-run"
DATA_MARKER = ".rwkvx-data"


class NotOurDirectory(UsageError):
    """A directory rwkvx must not write into; the message says why (a one-line user error)."""


def check_writable_dir(path: str | os.PathLike, marker: str, ours=None, what: str = "directory") -> Path:
    """Refuse `path` unless rwkvx may write there: it does not exist yet, or is an empty directory,
    or holds `marker`, or `ours(path)` recognises a directory made by an older rwkvx. Never the
    filesystem root, the empty path, a file, or a path under a file. Returns the path."""
    if str(path).strip() == "":
        raise NotOurDirectory(f"the {what} path is empty")
    path = Path(path)
    resolved = Path(os.path.abspath(path))
    if resolved == Path(resolved.anchor):
        raise NotOurDirectory(f"{what} {path}: refusing to write into the filesystem root")
    for parent in [resolved, *resolved.parents]:
        if parent.exists() and not parent.is_dir():
            where = "is a file" if parent == resolved else f"is under a file ({parent})"
            raise NotOurDirectory(f"{what} {path} {where}")
    if not resolved.exists():
        return path
    try:
        names = sorted(os.listdir(resolved))
    except OSError as e:
        raise NotOurDirectory(f"{what} {path} cannot be read: {e.strerror}") from None
    if not names or marker in names or (ours is not None and ours(resolved)):
        return path
    shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    raise NotOurDirectory(
        f"{what} {path} already holds files rwkvx did not write ({shown}); choose a new or empty directory "
        f"(if rwkvx made it, create an empty {marker} file in it)"
    )


def claim_dir(path: str | os.PathLike, marker: str) -> None:
    """Create `path` (after check_writable_dir) and leave the marker that makes it rwkvx's."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / marker).exists():
        atomic_write_text(path / marker, "written by rwkvx: it may write and replace files here\n")
