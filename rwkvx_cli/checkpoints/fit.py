"""Whether weights fit a model: every missing, unexpected or mis-shaped tensor named (`mismatch`), and
no NaN or infinity (`check_finite`), checked before anything is loaded (manager.py, sharded.py, and
runs/weights.py's strict `load_into`)."""

from __future__ import annotations

import torch

from rwkvx_cli.errors import CheckpointError


def check_finite(weights: dict[str, torch.Tensor], source: str) -> None:
    for name, t in weights.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{source}: {name} holds non-finite values")


def mismatch(own: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> str:
    """What differs between two state dicts' names and shapes ("" when nothing)."""
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(weights))
        if tuple(weights[k].shape) != tuple(own[k].shape)
    ]
    problems = [
        f"{what} {_first_five(names)}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
        if names
    ]
    return "; ".join(problems)


def _first_five(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
