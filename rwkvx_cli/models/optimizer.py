"""The trainer's optimizer: AdamW over RWKV-LM's parameter groups (models.parameter_groups), run by torch's
fused kernel, one pass over each tensor, where it can: the for-loop form torch picks by default
on the CPU dispatches some 15 small ops per parameter tensor (25 ms of a 190 ms tiny RWKV-7 step
on the 2-core development VM against 2 ms fused; docs/benchmarks.md). Under FSDP2, whose
parameters are sharded DTensors, the multi-tensor (foreach) form. The same math either way; the
rounding differs by the order of operations."""

from __future__ import annotations

import torch

# How torch computes the update, not what it computes: a checkpoint's saved groups carry them, but
# the process that loads the state keeps its own (distributed.load_full_state), and a resume never
# compares them (checkpointer.check_optimizer_state).
IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})


def adamw(groups: list[dict], lr: float, betas, eps: float, sharded: bool = False) -> torch.optim.AdamW:
    impl = {"foreach": True} if sharded else {"fused": True}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **impl)


def implementation(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's implementation flags, to put back after a load_state_dict overwrote them."""
    return [{k: g[k] for k in IMPLEMENTATION if k in g} for g in optimizer.param_groups]


def restore_implementation(optimizer: torch.optim.Optimizer, flags: list[dict]) -> None:
    for g, f in zip(optimizer.param_groups, flags, strict=True):
        g.update(f)
