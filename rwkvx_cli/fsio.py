"""Crash-safe file writes: a reader sees the old file or the whole new one, never half of one;
and no write goes through a symbolic link rwkvx did not make (a link planted where rwkvx writes
would otherwise have its target overwritten)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from pathlib import Path

from rwkvx_cli.errors import RwkvxError, UsageError


class LinkRefused(RwkvxError):
    """A path rwkvx writes to is a symbolic link."""

    def __init__(self, path: Path | str):
        super().__init__(f"{path} is a symbolic link; rwkvx never writes through a link it did not make (remove it)")


# The errors of a write that the disk refused (full, over quota, past a file-size limit, read-only): never of a read.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class WriteFailed(RwkvxError):
    """A write the disk refused, naming the file being written and what is intact (as the checkpoint writer says
    "the earlier checkpoints are intact")."""

    def __init__(self, path: Path | str, reason: str, intact: str):
        super().__init__(f"cannot write {path}: {reason}; {intact}")


def write_failure(e: OSError, default: Path | str, intact: str) -> WriteFailed | None:
    """A WriteFailed for an OSError of WRITE_ERRNOS (its file, else `default`), or None for any other error."""
    if e.errno not in WRITE_ERRNOS:
        return None
    return WriteFailed(e.filename or default, e.strerror or str(e), intact)


@contextlib.contextmanager
def names_file(path: Path | str):
    """An OSError raised inside names `path` when it names no file (a write() on an open file does not)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def open_no_follow(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """os.open that refuses a symbolic link at `path` (LinkRefused) instead of following it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LinkRefused(path) from None
        raise


def create_new(path: Path | str, dir_fd: int | None = None):
    """A new file at `path`, open for writing (binary): the one way rwkvx creates a file it writes into
    a directory of its own. Whatever entry is at the name (a stale file, a planted link) is unlinked
    first and the file made with O_EXCL|O_NOFOLLOW, so nothing is ever written through a link. With
    `dir_fd` (an open directory: `path`'s parent when it was opened) the file is made in that directory
    wherever it is now, by `path`'s last component; `path` then only names it in errors."""
    name = os.path.basename(path) if dir_fd is not None else path
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    except OSError as e:  # EEXIST: planted again since the unlink
        e.filename = str(path)  # the whole path, not the name relative to dir_fd
        raise
    return os.fdopen(fd, "wb")


def remove_entry(path: Path | str, dir_fd: int | None = None) -> None:
    """Remove what is at `path` (relative to `dir_fd` when given), never following a link: a link or a
    file is unlinked, a directory removed with everything in it. Nothing there is no error."""
    try:
        st = os.lstat(path, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, dir_fd=dir_fd)  # fd-based: a link inside is unlinked, never followed
    else:
        os.unlink(path, dir_fd=dir_fd)


def create_temp(path: Path):
    """(temp path, binary file) of a new file beside `path` (temp_path's name), made by create_new: an
    entry already there (a stale one of this pid, or a planted link) is removed, never written through."""
    tmp = temp_path(Path(path))
    return tmp, create_new(tmp)


def open_append(path: Path | str):
    """A text file opened for appending, created if needed; a symbolic link is refused."""
    return os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


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
    tmp, f = create_temp(path)
    try:
        with names_file(path), f:
            f.write(data)
            fsync_file(f)
        try:
            os.replace(tmp, path)  # replaces a link at `path` itself, never its target
        except OSError as e:  # (a directory there): the file being written, not the temporary name no one gave
            e.filename, e.filename2 = str(path), None
            raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


# -- files a user names on the command line (--json, --html, --png, --output, export --out) -------
# A run's own files: an output option never replaces them, even with --force.
RUN_FILES = ("config.yaml", "tokenizer.json", "metrics.jsonl", ".rwkvx-run", ".rwkvx-lock", "source.json")


def check_place(path: Path | str, flag: str = "--out") -> None:
    """Refuse an output (file or directory) that would land inside a checkpoint, a run's checkpoints
    folder or a prepared-data directory, or under a file."""
    full = Path(os.path.abspath(path))
    for d in full.parents:
        in_root = d == full.parent and any(d.glob("step_*/meta.json"))  # a run's checkpoints folder
        weights = (d / "model.safetensors").is_file() or (d / "index.json").is_file()  # full or sharded
        if in_root or (d / "meta.json").is_file() and weights:
            raise UsageError(f"{flag} {path} is inside a checkpoint ({d}); write it elsewhere")
        if (d / DATA_MARKER).exists():
            raise UsageError(f"{flag} {path} is inside a prepared-data directory ({d}); write it elsewhere")
        if d.exists() and not d.is_dir():
            raise UsageError(f"{flag} {path} is under a file ({d})")


def check_output(path: Path | str, force: bool = False, flag: str = "--out") -> Path:
    """Refuse an output file that would destroy something: a directory, a path inside a checkpoint
    or a run's checkpoints folder or a prepared-data directory, a run's own files, a path under a
    file, or (without `force`) any existing file. Returns the path."""
    path = Path(path)
    if str(path).strip() == "" or path.is_dir() or str(path).endswith(os.sep):
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    check_place(path, flag)
    full = Path(os.path.abspath(path))
    if full.name in RUN_FILES and (full.parent / RUN_MARKER).exists():
        raise UsageError(f"{flag} {path} is one of the run's own files; write it elsewhere")
    if (path.exists() or path.is_symlink()) and not force:
        raise UsageError(f"{flag} {path} already exists; pass --force to replace it")
    return path


def write_output(path: Path, data: bytes | str, *, force: bool = False, flag: str = "--out") -> Path:
    """A user-named output file, checked (check_output) and written atomically; returns its path."""
    check_output(path, force, flag)
    try:
        atomic_write_bytes(path, data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as e:
        before = "the file that was there is unchanged" if Path(path).exists() else "nothing was written there"
        raise RwkvxError(f"cannot write {path}: {e.strerror or e}; {before}") from None
    return Path(path)


def write_json(path: Path | None, data, *, force: bool = False, flag: str = "--json") -> None:
    """An output option's JSON (`--json PATH`), guarded as every output file; nothing when `path` is None."""
    if path is not None:
        write_output(path, json.dumps(data, indent=2) + "\n", force=force, flag=flag)


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
    if path.is_symlink() and not path.exists():
        raise NotOurDirectory(f"{what} {path} is a symbolic link to {os.readlink(path)}, which does not exist")
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
