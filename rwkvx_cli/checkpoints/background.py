"""Checkpoints written in the background: staged copies of the state, and the thread that writes them.

An asynchronous save (train.async_checkpoint) copies what it writes first, so that the step loop
can go on changing the weights and optimizer state while a writer thread writes the copy: the
copy is the only part of a save the loop waits for. The copies go to CPU buffers that are kept
from one checkpoint to the next (a run has at most one save in flight, so a buffer is free again
when the next save stages): after the first save no memory is allocated, and none is faulted in.
On CUDA the buffers are pinned and the copies asynchronous, waited for once, at the end of the
staging (torchtitan stages the same way). The price is memory: one more copy of each rank's share
of the state, for the whole run.

`Writer` runs one write on a thread and hands its outcome to the loop's thread, agreed between
ranks; `writer_group()` is the process group a sharded write agrees over (sharded.py's
`write_sharded(..., group=)`), so that the thread's collectives never interleave with training's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from rwkvx_cli.checkpoints.ranks import EXPECTED, all_gather, one_line
from rwkvx_cli.errors import CheckpointError


class Staging:
    """Copies into reused CPU buffers: `begin()`, `copy(key, tensor)` (or `tree(obj)`) for each
    tensor to keep, then `finish()`, after which the copies are complete and the buffers that this
    staging did not use are released."""

    def __init__(self):
        self._buffers: dict[object, torch.Tensor] = {}
        self._used: set = set()
        self._cuda = False

    def begin(self) -> None:
        self._used, self._cuda = set(), False

    def copy(self, key, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of `t` in the buffer kept under `key` (hashable, unique within a staging)."""
        if key in self._used:
            raise ValueError(f"staging {key!r} twice")
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        self._cuda |= t.is_cuda
        self._used.add(key)
        return buf

    def tree(self, obj, key: tuple = ()):
        """`obj` (dicts, lists and tuples of tensors and plain values) with every tensor copied."""
        if isinstance(obj, torch.Tensor):
            return self.copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.tree(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.tree(v, (*key, i)) for i, v in enumerate(obj))
        return obj

    def finish(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        for key in set(self._buffers) - self._used:
            del self._buffers[key]

    @property
    def bytes(self) -> int:
        """The memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class Writer:
    """One checkpoint written by a thread (started at once). Every rank makes one for the same step, and
    later calls `wait()` at the same step: it joins the thread and agrees on the outcome (a collective
    over the default process group), raising one CheckpointError on every rank when a rank's write
    failed ("cannot write the checkpoint of step N in ...: why; the earlier checkpoints are intact")."""

    def __init__(self, step: int, write: Callable[[], Path | None]):
        self.step, self.error = step, None

        def run() -> None:
            try:
                write()
            except BaseException as e:  # taken by wait(), on the loop's thread
                self.error = e

        self.thread = threading.Thread(target=run, name=f"rwkvx-checkpoint-{step}", daemon=True)
        self.thread.start()

    @property
    def writing(self) -> bool:
        """Still being written on this rank."""
        return self.thread.is_alive()

    def wait(self) -> None:
        self.thread.join()
        error = self.error
        lines = all_gather(None if error is None else one_line(error))
        if error is not None and not isinstance(error, EXPECTED):
            raise error  # a bug, with its traceback, on the rank that hit it
        first = next((line for line in lines if line is not None), None)
        if first is not None:
            raise CheckpointError(first)

    def close(self) -> None:
        """After an error elsewhere: let the write finish (its checkpoint is good), without raising what
        it may raise, and without a collective (the other ranks may be gone)."""
        self.thread.join()


def writer_group():
    """A new gloo process group of every rank, for a writer thread's agreements (a collective: every rank
    creates it, at the same point); None in one plain process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")
