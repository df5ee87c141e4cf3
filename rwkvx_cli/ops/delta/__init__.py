"""The gated delta rule, written once for the `gdn` and `kda` ops
(docs/operators.md#gated-delta-rule-gdn-and-kda).

Per (batch, head), state S is [N_k, N_v] (row = key channel), A_t = exp(g_t):

    P   = A_t ⊙ S_{t-1}      # gdn: one g_t per head; kda: g_t[i] per key row
    u_t = β_t (v_t - Pᵀ k_t)
    S_t = P + k_t u_tᵀ
    y_t = c S_tᵀ q_t          # c = 1/sqrt(N) unless given; on q only

With `starts` (bool [B, T]) S_{t-1} is the zero state where it is True; every
backend but the reference gets it as g = RESET_LOG_DECAY there (A_t = 0).

gdn is kda with its gate broadcast over the key rows, so every kernel here takes
the gate as g [B, T, H, G] with G = 1 (gdn) or G = N (kda) and the ops differ
only in the gate's shape at their API. This package holds the kernels
(reference.py, chunked.py, cpu.py + csrc/, fused_triton.py), the argument checks
and `run` (here), and the spec both ops register (spec.py, `make_spec`).
The ops take q and k as given; the models L2-normalize them.
"""

from __future__ import annotations

import math

import torch

from rwkvx_cli.ops._checks import check_same_layout, check_starts, check_state
from rwkvx_cli.ops._resets import RESET_LOG_DECAY, at_starts
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("q", "k", "v", "g", "beta")


def _check_tensor(name: str, t, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"{name} must have shape {shape} ([B, T, H{', N' if len(shape) == 4 else ''}]), got {tuple(t.shape)}"
        )
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dtype != like.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but q has {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but q is on {like.device}")


def default_scale(N: int) -> float:
    return 1.0 / math.sqrt(N)


def forget_at_starts(inputs: dict[str, torch.Tensor], starts: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inputs rewritten so that every backend's recurrence forgets its state where `starts` is
    True: the gate A_t = e^g there is 0, so P = 0 and S_t = β_t k_t v_tᵀ (OpSpec.reset_inputs)."""
    return {**inputs, "g": at_starts(inputs["g"], starts, RESET_LOG_DECAY)}


def run(
    op: str, q, k, v, g, beta, state, scale, backend: str, per_channel: bool, starts=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a public call of gdn (per_channel=False) or kda and run the chosen backend."""
    spec = get_op(op)
    check_same_layout(("q", "k", "v"), (q, k, v), ndim=4)
    B, T, H, N = q.shape
    if min(B, T, H, N) < 1:
        raise ValueError(f"{spec.name} needs every dimension >= 1, got [B, T, H, N] = {list(q.shape)}")
    _check_tensor("g", g, (B, T, H, N) if per_channel else (B, T, H), q)
    _check_tensor("beta", beta, (B, T, H), q)
    if state is None:
        state = torch.zeros(
            B, H, N, N, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device
        )
    else:
        check_state("state", state, (B, H, N, N), q.device)
    if scale is None:
        scale = default_scale(N)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number (default 1/sqrt(N)), got {scale!r}")
    starts = check_starts(starts, B, T, q.device)
    bk = resolve_backend(spec, backend, q.device)
    if q.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of {spec.name} does not support float64 inputs")
    x, extra = spec.with_starts(bk, dict(zip(INPUTS, (q, k, v, g, beta), strict=True)), starts)
    return bk.fn(*x.values(), state, scale=float(scale), **extra)
