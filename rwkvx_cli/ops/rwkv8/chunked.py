"""rwkv8 `chunked` backend: the recurrence in matmul form over chunks of C steps,
pure torch, differentiated by autograd.

With the decay constant over time, the state before step t of a chunk that
starts from (ρ0, n0) is, with δ^j = d^j per latent (formed as exp(j log d), so
every power is <= 1 and finite for any d in (0, 1]):

    ρ_{t-1} = δ^t ⊙ ρ0 + Σ_{s<t} δ^{t-1-s} ⊙ q_s v_sᵀ,   n_{t-1} = δ^t ⊙ n0 + Σ_{s<t} δ^{t-1-s} ⊙ q_s

so with z_t = q_t / ((Σ q_t + eps)(n_{t-1} + eps)):

    Y = (Z ⊙ δ^t) ρ0 + A V,   A_ts = Σ_l z_tl δ_l^{t-1-s} q_sl  (s < t)

and the chunk's end state is δ^C ⊙ ρ0 + (Q ⊙ δ^{C-1-s})ᵀ V. The pairwise decays
are [H, C, C, L], shared by every batch row and chunk; n_{t-1} (needed inside z)
comes from the same pairwise decays. A value head shared by all heads (Hv = 1)
broadcasts in the matmuls.

Document starts reset inside a chunk exactly, by masks (never by differences of
states, which would cancel): with a_t the chunk's last start at or before t,
s reaches the state before t only if s >= a_t (no start in (s, t]), and the
carried (ρ0, n0) only if no start lies in 0..t. The mask differs per batch row,
so n_{t-1}'s intra-chunk sum forms a [B, H, c, c, L] product (saved for the
backward) where the shared decays alone need none: what starts cost this form
(at B = 8, T = 256, H = 4, L = 64 the memory it keeps grows by half).
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops.rwkv8.reference import EPS

CHUNK = 16


def _decays(log_d: torch.Tensor, c: int):
    """Pairwise δ^{t-1-s} (s < t, else 0) [H, c, c, L], δ^t [H, c, L], δ^{c-1-s} [H, c, L], δ^c [H, L]."""
    i = torch.arange(c, device=log_d.device, dtype=log_d.dtype)
    lag = i[:, None] - 1 - i[None, :]  # [t, s]
    expo = lag[None, :, :, None] * log_d[:, None, None, :]
    neg_inf = torch.tensor(float("-inf"), dtype=log_d.dtype, device=log_d.device)
    pair = torch.exp(torch.where((lag >= 0)[None, :, :, None], expo, neg_inf))
    pow_t = torch.exp(i[None, :, None] * log_d[:, None, :])
    pow_end = torch.exp((c - 1 - i)[None, :, None] * log_d[:, None, :])
    return pair, pow_t, pow_end, torch.exp(c * log_d)


def _masks(starts: torch.Tensor, dtype):
    """A chunk's starts [B, c] as masks in `dtype`: reach [B, c, c] (s reaches the state before t:
    no start in (s, t]), carry [B, c] (the chunk's initial state reaches t: no start in 0..t), and
    for the end state reach_end [B, c] (no start in (s, c-1]) and carry_end [B]."""
    c = starts.shape[1]
    i = torch.arange(c, device=starts.device)
    last = torch.where(starts, i, -1).cummax(dim=1).values  # [B, c]: the last start at or before t
    reach = i[None, None, :] >= last[:, :, None]
    return reach.to(dtype), (last < 0).to(dtype), (i >= last[:, -1:]).to(dtype), (last[:, -1] < 0).to(dtype)


def _chunk(q, v, rho, norm, decays, starts=None):
    """One chunk: q [B, H, c, L], v [B, Hv, c, E], rho [B, H, L, E], norm [B, H, L], starts [B, c] or None."""
    pair, pow_t, pow_end, pow_c = decays
    q_end, keep = q * pow_end, pow_c
    if starts is None:
        n_intra = torch.einsum("htsl,bhsl->bhtl", pair, q)
    else:
        reach, carry, reach_end, carry_end = _masks(starts, q.dtype)
        pow_t = pow_t * carry[:, None, :, None]  # [B, H, c, L]
        q_end = q_end * reach_end[:, None, :, None]
        keep = keep * carry_end[:, None, None]  # [B, H, L]
        n_intra = torch.einsum("htsl,bts,bhsl->bhtl", pair, reach, q)
    n_prev = pow_t * norm[:, :, None, :] + n_intra
    z = q / ((q.sum(dim=-1, keepdim=True) + EPS) * (n_prev + EPS))
    A = torch.einsum("bhtl,htsl,bhsl->bhts", z, pair, q)
    if starts is not None:
        A = A * reach[:, None]
    y = (z * pow_t) @ rho + A @ v
    rho = keep[..., None] * rho + q_end.transpose(-1, -2) @ v
    norm = keep * norm + q_end.sum(dim=2)
    return y, rho, norm


def rwkv8_chunked(q, v, d, state, *, starts=None):
    """starts: bool [B, T] or None (docs/operators.md#document-starts)."""
    B, T, H, L = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_ = q.to(cdt).transpose(1, 2)  # [B, H, T, L]
    v_ = v.to(cdt).transpose(1, 2)  # [B, Hv, T, E]
    log_d = torch.log(d.to(cdt))
    rho, norm = (s.to(cdt) for s in state)
    decays = {}
    ys = []
    for t0 in range(0, T, CHUNK):
        c = min(CHUNK, T - t0)
        if c not in decays:
            decays[c] = _decays(log_d, c)
        st = None if starts is None else starts[:, t0 : t0 + c]
        y, rho, norm = _chunk(q_[:, :, t0 : t0 + c], v_[:, :, t0 : t0 + c], rho, norm, decays[c], st)
        ys.append(y)
    y = torch.cat(ys, dim=2).transpose(1, 2)
    return y.to(q.dtype), (rho, norm)
