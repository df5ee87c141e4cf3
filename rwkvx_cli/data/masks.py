"""Loss masks beside binidx: `PREFIX.mask` holds one byte per token of `PREFIX.bin`, 1 where the token carries
loss as a target (predicted from the tokens before it), 0 where it is only read. `prepare` writes them for a corpus
of conversations (template.py); meta.json then records them ("mask") with each split's count of loss tokens
(`loss_tokens`). A split without a mask file trains every token, as before masks existed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from rwkvx_cli.data.errors import DataError
from rwkvx_cli.fsio import fsync_dir, temp_path

SUFFIX = ".mask"
_SCAN = 1 << 24  # bytes per step of `count`


def mask_path(prefix: str | os.PathLike) -> Path:
    p = os.fspath(prefix)
    if p.endswith((".bin", ".idx")):
        p = p[:-4]
    return Path(p + SUFFIX)


@contextlib.contextmanager
def replacing_mask(prefix: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write PREFIX.mask at, renamed over it when the block ends, removed when it raises."""
    path = mask_path(prefix)
    tmp = temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def open_mask(prefix: str | os.PathLike, n_tokens: int) -> np.ndarray:
    """PREFIX.mask memory-mapped (uint8, one per token); DataError when it is missing or its size is not
    `n_tokens`."""
    path = mask_path(prefix)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path} is missing: meta.json says the split has a loss mask; prepare the data again") \
            from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    if size != n_tokens:
        raise DataError(
            f"{path} holds {size} bytes for {n_tokens} tokens (one each; edited or damaged?); prepare the data again"
        )
    if n_tokens == 0:
        return np.zeros(0, dtype=np.uint8)
    try:
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(n_tokens,))
    except OSError as e:
        raise DataError(f"cannot map {path}: {e.strerror}") from None


def count(mask, what: str) -> int:
    """The tokens that carry loss in `mask` (reads all of it); DataError naming `what` at a byte other than 0 or 1."""
    total = 0
    for a in range(0, len(mask), _SCAN):
        part = np.asarray(mask[a : a + _SCAN])
        counts = np.bincount(part, minlength=2)
        if len(counts) > 2:
            pos = a + int(np.flatnonzero(part > 1)[0])
            raise DataError(f"{what}: byte {int(part[pos - a])} at position {pos} is not 0 or 1 (damaged?)")
        total += int(counts[1])
    return total


def ones(n: int) -> np.ndarray:
    """The mask of a split without one (every token carries loss), read-only and taking no memory."""
    return np.broadcast_to(np.uint8(1), (n,))
