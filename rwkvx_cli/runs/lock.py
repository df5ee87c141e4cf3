"""One writer per run directory: an advisory lock on <run>/.rwkvx-lock, held while a process
trains or initialises the run.

The lock is `flock` on an open file, so the kernel releases it when the holder dies (even
by `kill -9`): a stale lock file from a dead process is simply taken over. The file also
records the holder's pid and host, for the refusal message of a second process.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from rwkvx_cli.errors import RwkvxError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None

LOCK_NAME = ".rwkvx-lock"


class RunLocked(RwkvxError):
    """Another process holds the run directory."""


def lock_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / LOCK_NAME


@contextlib.contextmanager
def hold_run(run_dir: Path | str) -> Iterator[None]:
    """Hold `run_dir` for this process, or raise RunLocked naming the holder. The directory must exist."""
    path = lock_path(run_dir)
    if fcntl is None:  # pragma: no cover
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RwkvxError(f"cannot lock the run directory {run_dir}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise RunLocked(
                f"the run directory {run_dir} is in use by {holder}; wait for it to finish or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
