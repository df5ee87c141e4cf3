"""How many ops a block dispatches in one training step (forward and backward): the figure that
says how much a block pays in kernel launches and round trips through memory, besides its FLOPs.

Counted with torch.profiler over one step (the loss, `backward()`; not the optimizer): every
top-level call into the dispatcher (an `aten::` or `rwkvx::` op with no such op around it, in the
forward or in the autograd engine's backward), except the calls that only describe memory
(views, reshapes and transposes, `select` / `slice` / `split` / `unbind`, `detach`, `alias`,
`expand`) or allocate it without writing (`empty*`), and casts and `contiguous()` calls that
copied nothing. A reshape, cast or `contiguous()` that did copy counts. A block's count is the
difference between a 3-block and a 1-block model of the config's block kind, over two: the
embedding, the head, the loss and ln0 cancel out, and the two blocks counted are middle blocks
(RWKV-7's first block, without a value residual, is the one left out).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from rwkvx_cli.runs.runtime import profiler_quiet

# Ops that only alias or reshape memory, or allocate without writing: not counted.
NOT_COUNTED = frozenset(
    f"aten::{name}"
    for name in (
        "view", "view_as", "reshape", "_reshape_alias", "_unsafe_view", "flatten", "unflatten", "t", "transpose",
        "permute", "expand", "expand_as", "as_strided", "select", "slice", "narrow", "split", "split_with_sizes",
        "chunk", "unbind", "squeeze", "unsqueeze", "detach", "alias", "lift_fresh", "numpy_T", "result_type",
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
    )
)  # fmt: skip
# Ops that may or may not copy: counted when they did (an op that copies under them).
MAYBE_COPY = frozenset({"aten::to", "aten::contiguous", "aten::reshape", "aten::flatten"})
COPIES = frozenset({"aten::_to_copy", "aten::clone", "aten::copy_"})


def _is_op(name: str) -> bool:
    return name.startswith(("aten::", "rwkvx::"))


def _copied(event, children: dict[int, list]) -> bool:
    stack = list(children.get(id(event), ()))
    while stack:
        e = stack.pop()
        if e.name in COPIES:
            return True
        stack.extend(children.get(id(e), ()))
    return False


def count_ops(run: Callable[[], None]) -> Counter:
    """The ops `run()` dispatches, by name, counted as the module docstring says."""
    with profiler_quiet(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = prof.events()
    children: dict[int, list] = {}
    for e in events:
        if e.cpu_parent is not None:
            children.setdefault(id(e.cpu_parent), []).append(e)
    counts: Counter = Counter()
    for e in events:
        if not _is_op(e.name):
            continue
        parent = e.cpu_parent
        while parent is not None and not _is_op(parent.name):
            parent = parent.cpu_parent
        if parent is not None:
            continue  # inside another op: part of its work
        if e.name in MAYBE_COPY:
            if _copied(e, children):
                counts[e.name] += 1
        elif e.name not in NOT_COUNTED:
            counts[e.name] += 1
    return counts


def ops_per_block(step_of: Callable[[int], Callable[[], None]]) -> tuple[float, dict[str, float]]:
    """(ops per block, by op name) from `step_of(n)`, a training step of a model of n blocks: the
    difference of 3 blocks and 1, over two. Each step runs once before it is counted (first-call
    work: kernel builds, caches)."""
    counts = {}
    for n in (1, 3):
        step = step_of(n)
        step()
        counts[n] = count_ops(step)
    diff = Counter(counts[3])
    diff.subtract(counts[1])
    by_op = {name: c / 2 for name, c in sorted(diff.items(), key=lambda kv: (-kv[1], kv[0])) if c}
    return sum(diff.values()) / 2, by_op
