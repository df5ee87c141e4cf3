"""Data parallelism under torchrun: process group, model wrapping (DDP or FSDP2), and the
few collectives the trainer needs. Without torchrun every function here is a no-op on
a single process, so the trainer has one code path.

Each rank reads rows rank, rank + N, ... of the step's global batch (a function of seed
and step), so the global batch, and with it the loss, does not depend on N. A checkpoint gathers
and sets the state itself (checkpoints/full.py: whole tensors; checkpoints/sharded.py: each rank's
rows): either loads into any number of ranks and either mode.

No rank is left waiting for one that stopped: start-up work that one rank does alone (rank 0
claims the run directory, checks the data, writes the run files) or that may fail on one rank
only runs through `agreed`, so a refusal there is every rank's one-line error; and a collective
that finds another rank gone anyway is one line too (`peer_loss_in_one_line`), never a traceback.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from rwkvx_cli.checkpoints.ranks import all_gather, one_line
from rwkvx_cli.config import ConfigError
from rwkvx_cli.errors import RwkvxError

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # started by torchrun (a process group exists)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistInfo()


def from_env(env=os.environ) -> DistInfo:
    """The rank layout torchrun exports (RANK, WORLD_SIZE, LOCAL_RANK); a single process without it."""
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return SINGLE
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun)") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK {rank} is not in 0..{world - 1} (WORLD_SIZE {world})")
    return DistInfo(rank, world, local, launched=True)


def init(info: DistInfo, device: torch.device) -> None:
    """Join the process group on this rank's resolved device (nccl on CUDA, gloo on CPU)."""
    if info.launched and not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(minutes=30),
            device_id=device if cuda else None,
        )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_initialized()


class RankStopped(RwkvxError):
    """Another rank's error, on a rank that did not fail itself: that error's one line and exit code."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def agreed(fn: Callable[[], T]) -> T:
    """Run `fn` on every rank (work for one rank alone: `fn` tests the rank) and agree on the outcome
    (checkpoints/ranks.py's all_gather), in place of a barrier: this rank's result when every rank succeeded;
    else every rank raises, the ones that failed their own error (a bug with its traceback), the others
    RankStopped with the first failing rank's one line and exit code ("rank r: " before it but for
    rank 0's). `fn` must not communicate itself: a rank failing before a collective would leave the
    others waiting in it. One process: `fn()`."""
    result, own, report = None, None, None
    try:
        result = fn()
    except RwkvxError as e:
        own, report = e, (str(e), e.exit_code)
    except (OSError, MemoryError) as e:  # as the command line renders them (render.console.reports_errors)
        memory = "out of memory; make the model, batch or shape smaller"
        own, report = e, (one_line(e) if isinstance(e, OSError) else memory, 1)
    except Exception as e:  # a bug: its traceback stays on this rank
        own, report = e, (f"{type(e).__name__}: {one_line(e)} (a bug: see that rank's traceback)", 1)
    reports = all_gather(report)
    if own is not None:
        raise own
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if failed:
        rank, (message, code) = failed[0]
        raise RankStopped(message if rank == 0 else f"rank {rank}: {message}", code)
    return result


def lost_peer(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another rank is gone (it exited after its own error,
    was killed, or stopped answering), rather than a bug: torch's DistError, or gloo's transport
    error (a plain RuntimeError: "Connection closed by peer", "Connection reset by peer", a timeout)."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo/transport" in str(e))


@contextlib.contextmanager
def peer_loss_in_one_line():
    """Inside, a collective that finds another rank gone (`lost_peer`: one that stopped outside an
    agreement, or was killed) raises RankStopped, one line saying so, instead of torch's traceback."""
    try:
        yield
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        reason = one_line(e)
        if reason.startswith("[") and "] " in reason:  # gloo: "[.../pair.cc:553] Connection closed by peer [...]. This"
            reason = reason.split("] ", 1)[1].split(". ")[0]
        raise RankStopped(f"another rank of this run stopped ({reason}); its own message says why") from None


def wrap(
    model: torch.nn.Module, mode: str, device: torch.device, precision: str = "fp32", trains: bool = True
) -> torch.nn.Module:
    """The module the training step calls. DDP returns a wrapper; FSDP2 shards `model` in place
    (each block, then the root), so `model` itself becomes the sharded module; under bf16-mixed
    (`precision`, resolved: runs/runtime.py) with bf16 compute parameters, fp32 gradient
    reduction and fp32 sharded master weights. `trains` false (state tuning: every weight frozen):
    DDP has nothing to reduce and is left out (the state's gradients: `average_grads`); FSDP2 still
    shards the frozen weights, each rank holding its share."""
    if not active() or (mode == "ddp" and not trains):
        return model
    if mode == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        policy = fsdp_policy(precision)
        kwargs = {} if policy is None else {"mp_policy": policy}
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # Every parameter that requires a gradient gets one in each step (layer 0's unused value-residual
    # weights att.v0/v1/v2 are frozen: models/layers/rwkv7.py), so DDP needs no find_unused_parameters.
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def fsdp_policy(precision: str):
    """FSDP2's MixedPrecisionPolicy for a resolved precision: under bf16-mixed, bf16 parameters in the
    forward and backward, gradients reduced in fp32, the sharded master weights fp32; None (FSDP's
    default, all fp32) otherwise."""
    if precision != "bf16-mixed":
        return None
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def grad_sync(wrapped: torch.nn.Module, mode: str, sync: bool):
    """Reduce gradients across ranks only on a step's last micro-batch; the others accumulate locally."""
    if not active():
        return contextlib.nullcontext()
    if mode == "fsdp":
        wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync or not hasattr(wrapped, "no_sync") else wrapped.no_sync()


def average_grads(module: torch.nn.Module) -> None:
    """The mean over the ranks of `module`'s gradients, in place (what DDP does for the modules it wraps),
    in one all-reduce; a parameter without a gradient gets zeros first (every rank reduces the same)."""
    if not active():
        return
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad.copy_(g.view_as(p))


def sum_all(t: torch.Tensor) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(*flags: bool, device: torch.device) -> bool | tuple[bool, ...]:
    """Each flag true on every rank when it is true on one (stop requests must agree), in one
    all-reduce; one flag gives a bool, several a tuple."""
    if active():
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flags = tuple(bool(x) for x in t.tolist())
    return flags[0] if len(flags) == 1 else tuple(flags)


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients in place to a total norm of at most `max_norm`; returns the total norm
    before clipping, the same on every rank."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
