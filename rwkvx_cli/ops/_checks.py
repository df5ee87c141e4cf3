"""Argument checks shared by every op's public function.

They raise ValueError with a message naming the offending argument, so a bad
call fails at the API boundary instead of deep inside a kernel.
"""

from __future__ import annotations

import torch


def check_same_layout(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], ndim: int) -> None:
    """All tensors: floating point, `ndim` dimensions, one shape, dtype and device."""
    first_name, first = names[0], tensors[0]
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.shape != first.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but {first_name} has {tuple(first.shape)}")
        if t.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_state(name: str, state: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(state, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(state).__name__}")
    if tuple(state.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(state.shape)}")
    if not state.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {state.dtype}")
    if state.device != device:
        raise ValueError(f"{name} is on {state.device} but the inputs are on {device}")


def check_rows(name: str, x: torch.Tensor, ndim: int) -> None:
    """A floating-point tensor of `ndim` dimensions, each >= 1."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if min(x.shape) < 1:
        raise ValueError(f"{name} needs every dimension >= 1, got shape {tuple(x.shape)}")


def per_channel(name: str, x: torch.Tensor, C: int, device: torch.device) -> torch.Tensor:
    """A per-channel parameter of any shape holding C values ([C], [1, 1, C], [H, N]) as [C]. It may
    have another floating dtype than the activations (fp32 parameters with bf16 activations)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.numel() != C:
        raise ValueError(f"{name} must hold {C} values (one per channel), got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the inputs are on {device}")
    return x.reshape(C)


def check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or eps != eps or eps == float("inf"):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    return float(eps)


def check_starts(starts: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor | None:
    """Document starts (docs/operators.md#document-starts): None, or a bool [B, T], True where a token
    begins a document (the state before it is the zero state). On another device it is moved (it is
    small); its values are not read here, so a GPU call does not wait on them."""
    if starts is None:
        return None
    if not isinstance(starts, torch.Tensor):
        raise ValueError(f"starts must be a torch.Tensor, got {type(starts).__name__}")
    if starts.dtype != torch.bool:
        raise ValueError(f"starts must be a bool tensor, got {starts.dtype}")
    if tuple(starts.shape) != (B, T):
        raise ValueError(f"starts must have shape {(B, T)} ([B, T]), got {tuple(starts.shape)}")
    return starts.to(device)
