"""WKV4 `chunked` backend: the stabilised recurrence as per-chunk log-sum-exps,
pure torch, differentiated by autograd.

The state (aa, bb, pp) is a log-sum-exp in disguise: after step t it holds every
earlier token i with log-weight l_i = k_i + (t-1-i) w (and the initial state with
log-weight pp0 + t w), pp = max l, aa = Σ e^{l - pp} v, bb = Σ e^{l - pp}. So,
over chunks of L steps, all at once:

1. intra-chunk sums from an empty state, for every t of the chunk:
   m_t = max_{i<=t} l_ti, num_t = Σ e^{l_ti - m_t} v_i, den_t = Σ e^{l_ti - m_t},
   with l_ti = k_i + (t-1-i) w for i < t and the bonus l_tt = u + k_t;
   and the chunk's own end state (p_c, a_c, b_c) over l_i = k_i + (L-1-i) w;
2. a scan over chunks (T/L sequential steps, no exp of a positive number):
   pp' = max(pp + L w, p_c), aa' = aa e^{pp + Lw - pp'} + a_c e^{p_c - pp'} (bb alike);
3. every output from its chunk's start state (a0, b0, p0) and step 1's sums:
   M = max(p0 + t w, m_t), y_t = (a0 e^{p0 + tw - M} + num_t e^{m_t - M}) / (b0 e^{..} + den_t e^{..}).

Every exponent is <= 0. y does not depend on the shifts m_t and M (numerator and
denominator scale together), so they are detached; the final pp keeps its
gradient (it is an output). Pairwise log-weights cost [L, L, C] per chunk.

Document starts, exactly: with c_t the number of starts at or before t in its chunk,
token i reaches t (and the chunk's end state) only where no start lies in (i, t], i.e.
c_i = c_t; the other log-weights are -inf (weight 0, no gradient). The chunk's start
state reaches t only where c_t = 0, and in the scan a chunk with a start gives the
carried state the log-weight -inf, so the state after it is its own (p_c, a_c, b_c),
which holds only the tokens from its last start. The masks are [L, L] per chunk and
row, shared by the channels; the scan takes one more op per chunk.
"""

from __future__ import annotations

import torch

CHUNK = 16


def _intra(w, u, k, v, count):
    """Step 1 on chunks k, v [B, n, L, C], with `count` [B, n, L] the starts at or before each t in
    its chunk (None: no starts): (m, num, den) [B, n, L, C], (p_c, a_c, b_c) [B, n, C]."""
    L = k.shape[2]
    i = torch.arange(L, device=k.device)
    lag = (i[:, None] - 1 - i[None, :]).to(k.dtype)  # [t, i]
    l_prev = k[:, :, None, :, :] + lag[:, :, None] * w  # [B, n, t, i, C]
    bonus = (u + k)[:, :, :, None, :]  # l_tt, broadcast over i
    neg_inf = torch.tensor(float("-inf"), dtype=k.dtype, device=k.device)
    before, diag = i[None, :] < i[:, None], (i[None, :] == i[:, None])[:, :, None]
    if count is not None:  # i reaches t only within t's document
        before = before & (count[:, :, :, None] == count[:, :, None, :])
    logits = torch.where(before[..., None], l_prev, torch.where(diag, bonus, neg_inf))
    m = logits.amax(dim=3).detach()
    e = torch.exp(logits - m[:, :, :, None, :])
    num = (e * v[:, :, None, :, :]).sum(dim=3)
    den = e.sum(dim=3)
    l_end = k + (L - 1 - i).to(k.dtype)[:, None] * w  # [B, n, L, C]
    if count is not None:  # the end state holds the tokens from the chunk's last start on
        l_end = torch.where((count == count[:, :, -1:])[..., None], l_end, neg_inf)
    p_c = l_end.amax(dim=2)
    e_end = torch.exp(l_end - p_c[:, :, None, :])
    return (m, num, den), (p_c, (e_end * v).sum(dim=2), e_end.sum(dim=2))


def _run(w, u, k, v, aa, bb, pp, L, starts):
    """k, v [B, n*L, C] in chunks of exactly L steps, starts [B, n*L] or None; returns y and the
    state after them."""
    B, T, C = k.shape
    n = T // L
    k, v = k.reshape(B, n, L, C), v.reshape(B, n, L, C)
    count = None if starts is None else starts.reshape(B, n, L).cumsum(dim=2)
    (m, num, den), (p_c, a_c, b_c) = _intra(w, u, k, v, count)
    reset = None if count is None else (count[:, :, -1] > 0)[:, :, None]  # [B, n, 1]: the chunk has a start
    entry = []  # the state before each chunk
    Lw = L * w
    for j in range(n):
        entry.append((aa, bb, pp))
        ww = pp + Lw
        if reset is not None:  # the carried state's weight e^{-inf - pp'} is 0
            ww = torch.where(reset[:, j], float("-inf"), ww)
        with torch.no_grad():  # (pp + Lw) - ww exactly (TwoSum), folded into aa and bb: see the cpu kernel
            bp = ww - pp
            err = torch.where(ww >= p_c[:, j], (pp - (ww - bp)) + (Lw - bp), 0.0)
        p_new = torch.maximum(ww, p_c[:, j])
        f1, f2 = torch.exp(ww - p_new), torch.exp(p_c[:, j] - p_new)
        aa, bb, pp = f1 * aa + f2 * a_c[:, j], f1 * bb + f2 * b_c[:, j], p_new
        aa, bb = aa + aa * err, bb + bb * err
    a0, b0, p0 = (torch.stack(s, dim=1)[:, :, None, :] for s in zip(*entry, strict=True))  # [B, n, 1, C]
    s = p0 + torch.arange(L, device=k.device).to(k.dtype)[:, None] * w  # the initial state's log-weight
    if count is not None:  # it reaches t only before the chunk's first start
        s = torch.where((count == 0)[..., None], s, float("-inf"))
    M = torch.maximum(s, m).detach()
    e1, e2 = torch.exp(s - M), torch.exp(m - M)
    y = (a0 * e1 + num * e2) / (b0 * e1 + den * e2)
    return y.reshape(B, T, C), (aa, bb, pp)


def wkv4_chunked(w, u, k, v, state, *, starts=None):
    """starts: bool [B, T] or None (docs/operators.md#document-starts)."""
    B, T, H, N = k.shape
    cdt = torch.float64 if k.dtype == torch.float64 else torch.float32
    w_, u_ = w.to(cdt).reshape(H * N), u.to(cdt).reshape(H * N)
    k_, v_ = k.to(cdt).reshape(B, T, H * N), v.to(cdt).reshape(B, T, H * N)
    aa, bb, pp = (s.to(cdt).reshape(B, H * N) for s in state)
    main = T - T % CHUNK
    ys = []
    for lo, hi, L in ((0, main, CHUNK), (main, T, T - main)):
        if hi > lo:
            part = None if starts is None else starts[:, lo:hi]
            y, (aa, bb, pp) = _run(w_, u_, k_[:, lo:hi], v_[:, lo:hi], aa, bb, pp, L, part)
            ys.append(y)
    y = torch.cat(ys, dim=1).reshape(B, T, H, N).to(k.dtype)
    return y, tuple(s.reshape(B, H, N) for s in (aa, bb, pp))
