"""wkv7: the RWKV-7 "Goose" generalized delta rule (docs/operators.md#wkv7).

    sa  = S a_t ;  S = S diag(exp(w_t)) + sa b_tᵀ + v_t k_tᵀ ;  y_t = S r_t

Inputs are [B, T, H, N]; `w` is the log of the effective decay (<= 0); the
state is [B, H, N, N] in the [value, key] orientation, fp32 (fp64 when the
inputs are fp64). With `starts` (bool [B, T]) the state before a token that
starts a document is the zero state. The registry entry (backends,
gradient-check cases) is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_same_layout, check_starts, check_state
from rwkvx_cli.ops._resets import RESET_LOG_DECAY, at_starts
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("r", "w", "k", "v", "a", "b")


def forget_at_starts(inputs: dict[str, torch.Tensor], starts: torch.Tensor) -> dict[str, torch.Tensor]:
    """wkv7's inputs rewritten so that every backend's recurrence forgets its state where `starts`
    is True: there the decay is 0 and a = 0, so S_{t-1} enters nothing, S_t = v_t k_tᵀ, and w_t and
    a_t, which then touch nothing, get zero gradients, as they should (OpSpec.reset_inputs)."""
    return {**inputs, "w": at_starts(inputs["w"], starts, RESET_LOG_DECAY), "a": at_starts(inputs["a"], starts, 0.0)}


def wkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the WKV7 recurrence; returns (y [B,T,H,N], state_out [B,H,N,N]).

    Differentiable with respect to every input, the initial state, and through
    `state_out`, so consecutive segments can be chained. `starts` (bool [B, T]):
    where True, the state before that token is the zero state (a document starts).
    """
    check_same_layout(INPUTS, (r, w, k, v, a, b), ndim=4)
    B, T, H, N = r.shape
    if min(B, T, H, N) < 1:
        raise ValueError(f"wkv7 needs every dimension >= 1, got [B, T, H, N] = {list(r.shape)}")
    if state is not None:
        check_state("state", state, (B, H, N, N), r.device)
    starts = check_starts(starts, B, T, r.device)
    spec = get_op("wkv7")
    bk = resolve_backend(spec, backend, r.device)
    if r.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of wkv7 does not support float64 inputs")
    if state is None and not bk.optional_state:
        state_dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
        state = torch.zeros(B, H, N, N, dtype=state_dtype, device=r.device)
    x, extra = spec.with_starts(bk, dict(zip(INPUTS, (r, w, k, v, a, b), strict=True)), starts)
    return bk.fn(*x.values(), state, **extra)
