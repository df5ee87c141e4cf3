"""One writer per run directory, held while a process trains or initialises the run.

The lock is `flock` on the run directory itself (an open descriptor of the directory), so it
cannot be deleted or replaced from under its holder the way a lock file can, and the kernel
releases it when the holder dies, even by `kill -9`. `<run>/.rwkvx-lock` only records the
holder's pid and host, for the refusal message of a second process; it is written atomically
and never through a symbolic link. Before each checkpoint the holder checks that the path still
names the directory it locked (`RunLock.check`): a run directory moved or replaced meanwhile
stops the run instead of letting two writers share one path.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.fsio import atomic_write_text

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None

LOCK_NAME = ".rwkvx-lock"


class RunLocked(RwkvxError):
    """Another process holds the run directory."""


class RunLockLost(RwkvxError):
    """The locked run directory is no longer at its path."""


def lock_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / LOCK_NAME


class RunLock:
    """The held lock of one run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self._fd = Path(run_dir), fd
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)

    def check(self) -> tuple[int, int]:
        """Raise RunLockLost when `run_dir` no longer names the directory this process locked; else
        return that directory's (st_dev, st_ino), which a checkpoints folder held open must be in
        (checkpoints/store.py's Root.check)."""
        try:
            st = os.stat(self.run_dir)
            here = (st.st_dev, st.st_ino)
        except OSError:
            here = None
        if here != self._identity:
            raise RunLockLost(
                f"the run directory {self.run_dir} was moved, deleted or replaced while this process held it; "
                "stopping without writing a checkpoint there"
            )
        return self._identity


@contextlib.contextmanager
def hold_run(run_dir: Path | str) -> Iterator[RunLock]:
    """Hold `run_dir` for this process, or raise RunLocked naming the holder. The directory must exist."""
    run_dir = Path(run_dir)
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise RwkvxError(f"cannot lock the run directory {run_dir}: {e.strerror}") from None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _holder(run_dir)
                raise RunLocked(
                    f"the run directory {run_dir} is in use by {holder}; wait for it to finish or stop it first"
                ) from None
        atomic_write_text(lock_path(run_dir), f"pid {os.getpid()} on {socket.gethostname()}\n")
        yield RunLock(run_dir, fd)
    finally:
        os.close(fd)  # releases the lock


def _holder(run_dir: Path) -> str:
    path = lock_path(run_dir)
    if path.is_symlink() or not path.is_file():
        return "another process"
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()[:200] or "another process"
    except OSError:
        return "another process"
