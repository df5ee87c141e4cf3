"""Which block kinds have LRP rules, and the recurrences' rules written out explicitly.

Each layer's rule is its own forward read through LRP's modified graph (graph.py: the
quantities the rule holds constant detached, `lrp_eps` at each sum, `wkv4_lrp` / `wkv7_lrp` for
the recurrences). Here: `wkv4_relevance` / `wkv7_relevance`, which run the recurrences' ε-rule as
explicit relevance splits with the state-relevance carry backward over time (seed 004's form).
They are the reference the gradient form is tested against, as an op's reference.py is for its
fast paths (docs/explain.md#the-method).
"""

from __future__ import annotations

import torch

from rwkvx_cli.errors import UsageError
from rwkvx_cli.ops.wkv4 import FRESH_PP

SUPPORTED_KINDS = ("rwkv4", "rwkv7")


class UnsupportedModelError(UsageError):
    """The model has a block kind without LRP rules."""


def check_supported(kinds: list[str]) -> None:
    bad = [(i, k) for i, k in enumerate(kinds) if k not in SUPPORTED_KINDS]
    if bad:
        where = ", ".join(f"block {i} is {k}" for i, k in bad[:3]) + (" ..." if len(bad) > 3 else "")
        raise UnsupportedModelError(
            f"explain has LRP rules for {' and '.join(SUPPORTED_KINDS)} blocks only; this model's {where}"
        )


def _stab(z: torch.Tensor, eps: float) -> torch.Tensor:
    """z + ε·sign z (sign 0 = +1): the ε-rule's denominator."""
    return z + eps * torch.where(z >= 0, 1.0, -1.0).to(z.dtype)


def _ratio(num: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """num / (z ± ε), 0 where that is 0 (a node with nothing in it hands nothing on)."""
    den = _stab(z, eps)
    return torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, torch.ones_like(den), den))


def wkv4_relevance(
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r_y: torch.Tensor,
    eps: float = 0.0,
    stabilised: bool = True,
) -> torch.Tensor:
    """Seed 004's rule for WKV4 from a fresh state, as explicit splits: the relevance of v
    [B, T, H, N] given that of y (`r_y`, same shape). `w` (log decay) and `u` are [H, N].

    Per step the forward is two weighted sums of the carried state s and v_t (graph.wkv4_lrp):
    y_t = c1 s_{t-1} + c2 v_t and s_t = f1 s_{t-1} + f2 v_t. `stabilised`: s is the op's aa
    (c1 = e1/den, c2 = e2/den, f1, f2 with the running maximum); else the seed's plain
    a_t (c1 = 1/den, c2 = e^{u+k}/den, f1 = e^w, f2 = e^k). At ε = 0 the two give the same
    relevance (the running maximum changes no share)."""
    w, u, k, v, r_y = (t.detach() for t in (w, u, k, v, r_y))
    B, T, H, N = k.shape
    s = k.new_zeros(B, H, N)
    den_state = k.new_zeros(B, H, N)
    pp = torch.full_like(s, FRESH_PP)
    steps = []  # (c1, c2, f1, f2, s_{t-1}, y_t, s_t)
    for t in range(T):
        k_t, v_t = k[:, t], v[:, t]
        if stabilised:
            q = torch.maximum(pp, u + k_t)
            e1, e2 = torch.exp(pp - q), torch.exp(u + k_t - q)
            c1, c2 = e1 / (e1 * den_state + e2), e2 / (e1 * den_state + e2)
            q = torch.maximum(pp + w, k_t)
            f1, f2 = torch.exp(pp + w - q), torch.exp(k_t - q)
            pp = q
        else:
            e = torch.exp(u + k_t)
            c1, c2 = 1 / (den_state + e), e / (den_state + e)
            f1, f2 = torch.exp(w).expand_as(k_t), torch.exp(k_t)
        y_t, s_t = c1 * s + c2 * v_t, f1 * s + f2 * v_t
        steps.append((c1, c2, f1, f2, s, y_t, s_t))
        s, den_state = s_t, f1 * den_state + f2
    r_v = torch.zeros_like(v)
    carry = torch.zeros_like(s)  # R(s_t), from y_{t+1} and s_{t+1}
    for t in reversed(range(T)):
        c1, c2, f1, f2, s_prev, y_t, s_t = steps[t]
        dy, ds = _ratio(r_y[:, t], y_t, eps), _ratio(carry, s_t, eps)
        r_v[:, t] = c2 * v[:, t] * dy + f2 * v[:, t] * ds
        carry = c1 * s_prev * dy + f1 * s_prev * ds
    return r_v


def wkv7_relevance(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    r_y: torch.Tensor,
    eps: float = 0.0,
) -> torch.Tensor:
    """The WKV7 rule derived in graph.wkv7_lrp, from a zero state, as explicit splits: the
    relevance of v [B, T, H, N] given that of y (`r_y`). `w` is the log decay."""
    r, w, k, v, a, b, r_y = (t.detach() for t in (r, w, k, v, a, b, r_y))
    B, T, H, N = r.shape
    eye = torch.eye(N, dtype=r.dtype)
    S = r.new_zeros(B, H, N, N)
    steps = []  # (M_t, S_{t-1}, S_t, y_t)
    for t in range(T):
        M = torch.exp(w[:, t])[..., None, :] * eye + a[:, t, :, :, None] * b[:, t, :, None, :]  # [B, H, m, j]
        S_t = S @ M + v[:, t, :, :, None] * k[:, t, :, None, :]
        steps.append((M, S, S_t, S_t @ r[:, t, :, :, None]))
        S = S_t
    r_v = torch.zeros_like(v)
    carry = torch.zeros_like(S)  # R(S_t) from S_{t+1}
    for t in reversed(range(T)):
        M, S_prev, S_t, y_t = steps[t]
        from_y = S_t * r[:, t, :, None, :] * _ratio(r_y[:, t], y_t[..., 0], eps)[..., None]
        d = _ratio(carry + from_y, S_t, eps)  # R(S_t[i,j]) / (S_t[i,j] ± ε)
        r_v[:, t] = v[:, t] * (d * k[:, t, :, None, :]).sum(-1)
        carry = S_prev * (d @ M.transpose(-1, -2))  # R(S_{t-1}[i,m]) = S_{t-1}[i,m] Σ_j M[m,j] d[i,j]
    return r_v
