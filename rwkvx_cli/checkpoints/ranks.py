"""The ranks of a run around a checkpoint: which rank this is, what each holds, and how they agree.

A save or a load is work every rank does its share of; a rank that fails must not leave the others
waiting in a collective, so each step runs through `together`: every rank reports its outcome
(one line, or its result) and all raise the same CheckpointError when one failed. Without a process
group every function here is the one-process case. The objects exchanged are our own in-memory
values, pickled only over the process group, never read from a file.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from safetensors import SafetensorError

from rwkvx_cli.checkpoints.store import io_reason
from rwkvx_cli.errors import CheckpointError


def _active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(this rank, the number of ranks); (0, 1) without a process group."""
    import torch.distributed as dist

    if _active():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sharded(model) -> bool:
    """Whether each rank holds only its own rows of the model's parameters (FSDP2 sharded them in place)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def all_gather(obj, group=None) -> list:
    """Every rank's `obj`. `group`: a process group of every rank (None: the default one)."""
    import torch.distributed as dist

    rank, world = rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank."""
    import torch.distributed as dist

    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_rows(local: torch.Tensor, world_size: int) -> torch.Tensor:
    """The global-batch tensor from every rank's rows (rank r holds global rows r, r + N, ...: the
    trainer's layout, train/distributed.py)."""
    import torch.distributed as dist

    if not _active():
        return local
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.stack(parts, dim=1).reshape(-1, *local.shape[1:])


def local_rows(global_t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of a global-batch tensor (gather_rows' inverse)."""
    return global_t[rank::world_size]


# The failures a rank reports as one line; anything else is a bug, raised with its traceback on the rank
# that hit it (the other ranks still stop, with a CheckpointError naming that rank, rather than hang).
EXPECTED = (CheckpointError, OSError, SafetensorError, ValueError)


def one_line(e: BaseException) -> str:
    if isinstance(e, OSError):
        return f"{str(e.filename) + ': ' if e.filename else ''}{io_reason(e)}"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def together(
    fn: Callable[[], object],
    fail: Callable[[str], str],
    on_failure: Callable[[], None] | None = None,
    share: bool = False,
    group=None,
):
    """Run `fn` on every rank and agree on the outcome: when every rank succeeded, this rank's result
    (with `share`, every rank's, in rank order: keep those small, they travel); otherwise every rank
    raises CheckpointError(fail(the first failing rank's one-line error)), after rank 0 ran
    `on_failure` (removing a partial directory). Only the errors travel without `share`. `group`: the
    process group they agree over (None: the default one; a checkpoint writer thread has its own)."""
    rank, world = rank_world()
    result, error, unexpected = None, None, None
    try:
        result = fn()
    except EXPECTED as e:
        error = one_line(e)
    except Exception as e:  # a bug: re-raised here with its traceback once the others know
        error, unexpected = f"{type(e).__name__}: {one_line(e)}", e
    reports = all_gather((error, result if share else None), group)
    failed = [(r, err) for r, (err, _) in enumerate(reports) if err is not None]
    if not failed:
        return [res for _, res in reports] if share else result
    if rank == 0 and on_failure is not None:
        on_failure()
    if unexpected is not None:
        raise unexpected
    r, err = failed[0]
    raise CheckpointError(fail(f"rank {r}: {err}" if world > 1 else err))
