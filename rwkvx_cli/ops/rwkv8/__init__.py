"""rwkv8: the normalized decayed recurrence the seed calls "RWKV-8" (BDH's attention;
docs/operators.md#rwkv8). Per (batch, head), with eps = 1e-6:

    q̃_t   = q_t / (Σ_l q_t[l] + eps)
    y_t[e] = Σ_l q̃_t[l] ρ_{t-1}[l, e] / (n_{t-1}[l] + eps)     (reads the state BEFORE step t)
    ρ_t    = d ⊙ ρ_{t-1} + q_t ⊗ v_t ,   n_t = d ⊙ n_{t-1} + q_t

With `starts` (bool [B, T]), (ρ_{t-1}, n_{t-1}) is the zero state where it is True, so y_t = 0
there (docs/operators.md#document-starts). The decay d is per (head, latent), not per token, so
no input rewrite can reset the state: every backend takes `starts` itself.

Layout, the project's [B, T, H, ·] (the seed's is [B, H, T, ·]):
    q [B, T, H, L]    <- seed q [B, H, T, L]     (non-negative features, L = latent size)
    v [B, T, Hv, E]   <- seed v [B, Hv, T, E]    (Hv = 1: one value head shared by every head)
    d [H, L]          <- seed decay [1, H, L]    (in (0, 1], constant over time and batch)
    rho [B, H, L, E], rho_norm [B, H, L]: the state, fp32 (fp64 for fp64 inputs), zero by default
    y [B, T, H, E]    <- seed output [B, H, T, E]
i.e. `seed_q = q.transpose(1, 2)`, `y = seed_y.transpose(1, 2)`.

In the registry (gradcheck, bench) the dims are B, T, H, N with N = L; the value
size E (default N) and the value heads Hv (default H) are case options; the
registry entry (backends, gradient-check sampler and cases) is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_starts, check_state
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("q", "v", "d")
STATES = ("rho", "rho_norm")


def rwkv8(
    q: torch.Tensor,
    v: torch.Tensor,
    d: torch.Tensor,
    rho: torch.Tensor | None = None,
    rho_norm: torch.Tensor | None = None,
    *,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the recurrence; returns (y [B,T,H,E], rho_out [B,H,L,E], rho_norm_out [B,H,L]).

    Differentiable with respect to q, v, d, the initial rho and rho_norm (either
    may be None: zeros), and through the final state, so segments can be chained.
    `d` may have another floating dtype than q and v (an fp32 parameter with bf16
    activations); its gradient comes back in its own dtype. `starts` (bool [B, T]): where
    True, the state before that token is the zero state (a document starts).
    """
    for name, x in (("q", q), ("v", v), ("d", d)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must have 4 dimensions [B, T, H, L], got shape {tuple(q.shape)}")
    B, T, H, L = q.shape
    if min(B, T, H, L) < 1:
        raise ValueError(f"rwkv8 needs every dimension >= 1, got q [B, T, H, L] = {list(q.shape)}")
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T) or v.shape[2] not in (1, H) or v.shape[3] < 1:
        raise ValueError(f"v must have shape ({B}, {T}, 1 or {H}, E >= 1), got {tuple(v.shape)}")
    if v.dtype != q.dtype:
        raise ValueError(f"v has dtype {v.dtype} but q has {q.dtype}")
    for name, x in (("v", v), ("d", d)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if tuple(d.shape) != (H, L):
        raise ValueError(f"d must have shape ({H}, {L}), got {tuple(d.shape)}")
    E = v.shape[3]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if rho is None:
        rho = torch.zeros(B, H, L, E, dtype=state_dtype, device=q.device)
    else:
        check_state("rho", rho, (B, H, L, E), q.device)
    if rho_norm is None:
        rho_norm = torch.zeros(B, H, L, dtype=state_dtype, device=q.device)
    else:
        check_state("rho_norm", rho_norm, (B, H, L), q.device)
    starts = check_starts(starts, B, T, q.device)
    spec = get_op("rwkv8")
    bk = resolve_backend(spec, backend, q.device)
    if q.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of rwkv8 does not support float64 inputs")
    x, extra = spec.with_starts(bk, dict(zip(INPUTS, (q, v, d), strict=True)), starts)
    y, (rho_out, norm_out) = bk.fn(*x.values(), (rho, rho_norm), **extra)
    return y, rho_out, norm_out
