"""wkv4: RWKV-4 time mixing, in RWKV-LM v4neo's stabilised form (docs/operators.md#wkv4).

Per channel c, with decay w_c < 0 (log space) and bonus u_c:

    y_t = (Σ_{i<t} e^{(t-1-i)w + k_i} v_i + e^{u + k_t} v_t) / (Σ_{i<t} e^{(t-1-i)w + k_i} + e^{u + k_t})

k and v are [B, T, H, N]; `w` and `u` are per channel, [H, N] (or [C] with
C = H*N). `w` is the log of the per-step decay, like wkv7's `w`: RWKV-4's
`time_decay` parameter enters as `w = -torch.exp(time_decay)`, and `u` is
`time_first` itself. The state is (aa, bb, pp), each [B, H, N], fp32 (fp64 for
fp64 inputs): the running sums A = aa e^pp, B = bb e^pp with pp their running
maximum log-weight, so every exponent the op takes is <= 0 and no T or k
overflows. A fresh state is (0, 0, -1e38). With `starts` (bool [B, T]) the state
before a token that starts a document is the fresh state, and no gradient reaches
back past it (docs/operators.md#document-starts). The decay is per channel, not per
token, so no rewrite of the inputs can reset the state: every backend takes `starts`
itself (Backend.resets).

Gradient of pp: not zero. A state is defined up to the shift (aa e^c, bb e^c, pp - c),
which leaves every output unchanged, so dL/dpp = aa dL/daa + bb dL/dbb + D, where D
is non-zero only when a loss on the final pp reaches back through an initial pp that
stays the running maximum for the whole segment (gradcheck's "init_state" case). For
a fresh state all three are exactly 0 (pp = -1e38 carries no weight), so the fresh
state cannot pass the non-vacuity rule: every gradient-check case starts from a live
state (a previous segment's (aa, bb, pp)), and all three state gradients are checked.

Numerics (fp32): exponents are formed as differences first, (pp - k) + w, exact for
close large values; where pp' = pp + w is rounded, the rounding error (TwoSum) is
folded into aa and bb, so a long run of small decays on a large pp does not drift
(T = 1e5, |w| = 1e-4, pp = 90: 4e-6 instead of 1e-3 relative error in y).

The registry entry (backends, gradient-check sampler and cases) is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_same_layout, check_starts, check_state
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("w", "u", "k", "v")
STATES = ("aa", "bb", "pp")
FRESH_PP = -1e38

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def wkv4(
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: State | None = None,
    *,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, State]:
    """Run the WKV4 recurrence; returns (y [B,T,H,N], (aa, bb, pp) each [B,H,N]).

    Differentiable with respect to w, u, k, v and the initial state, and through
    the final state, so consecutive segments can be chained. w and u may have
    another floating dtype than k and v (e.g. fp32 parameters with bf16
    activations); their gradients come back in their own dtype. `starts` (bool
    [B, T]): where True, the state before that token is the fresh state (a document
    starts).
    """
    check_same_layout(("k", "v"), (k, v), ndim=4)
    B, T, H, N = k.shape
    if min(B, T, H, N) < 1:
        raise ValueError(f"wkv4 needs every dimension >= 1, got [B, T, H, N] = {list(k.shape)}")
    w = _per_channel("w", w, H, N, k.device)
    u = _per_channel("u", u, H, N, k.device)
    state_dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    if state is None:
        zeros = torch.zeros(B, H, N, dtype=state_dtype, device=k.device)
        state = (zeros, zeros.clone(), torch.full_like(zeros, FRESH_PP))
    else:
        if not isinstance(state, (tuple, list)) or len(state) != 3:
            raise ValueError(f"state must be a tuple (aa, bb, pp) of 3 tensors, got {type(state).__name__}")
        for name, s in zip(STATES, state, strict=True):
            check_state(f"state {name}", s, (B, H, N), k.device)
        state = tuple(state)
    starts = check_starts(starts, B, T, k.device)
    spec = get_op("wkv4")
    bk = resolve_backend(spec, backend, k.device)
    if k.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of wkv4 does not support float64 inputs")
    x, extra = spec.with_starts(bk, dict(zip(INPUTS, (w, u, k, v), strict=True)), starts)
    return bk.fn(*x.values(), state, **extra)


def _per_channel(name: str, x: torch.Tensor, H: int, N: int, device: torch.device) -> torch.Tensor:
    """A per-channel parameter as [H, N]; [C] = [H*N] is accepted too."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if tuple(x.shape) not in ((H, N), (H * N,)):
        raise ValueError(f"{name} must have shape ({H}, {N}) or ({H * N},), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but k is on {device}")
    return x.reshape(H, N)
