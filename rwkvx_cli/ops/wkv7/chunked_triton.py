"""WKV7 `triton_chunked` backend: the chunked (WY / DPLR) matmul form in Triton,
forward and hand-written backward.

Chunks of L = 16 steps. Per (batch, head) and chunk, from the chunk's start state
S0 ([value, key]), with u_t = S_{t-1} a_t and G[t, s] = Σ_{s<r<=t} w_r (log decay):

    A_ab[t,s] = Σ_j a_tj b_sj e^{G[t-1,s]_j}  (s < t)     A_rb[t,s] = Σ_j r_tj b_sj e^{G[t,s]_j}  (s <= t)
    A_ak, A_rk likewise with k in place of b
    Ã_t = a_t e^{Σ_{r<t} w}   R̃_t = r_t e^{Σ_{r<=t} w}   B̂_s, K̂_s = b_s, k_s e^{Σ_{r>s} w}
    U   = (I - A_ab)⁻¹ (Ã S0ᵀ + A_ak V)                                  # the WY step
    Y   = R̃ S0ᵀ + A_rb U + A_rk V
    S_L = S0 diag(e^{Σ_r w}) + Uᵀ B̂ + Vᵀ K̂

(I - A_ab)⁻¹ = (I + A)(I + A²)(I + A⁴)(I + A⁸) since A_ab is strictly lower (nilpotent).

Decays stay finite for any w_eff in (0, 1]: every exponent is a sum of the log-decays
of exactly the steps a factor spans, formed in fp32 as its own cumulative sum (the
pairwise G by a scan over t of a [key, t, s] tile; the exclusive and the tail sums
from the inputs loaded one step shifted), never as a difference of two cumulative sums
and never as exp(-cumsum): all exponents are <= 0, so every factor lies in [0, 1], and
a factor's rounding error is relative to its own span (a difference of cumsums is off
by eps·|cumsum|, which is large after a near-0 decay). w is clamped at W_MIN = -60
(e^-60 ≈ 1e-26, invisible next to any fp32 sum it enters) so that log(0) = -inf or
huge negative inputs stay finite; a clamped step gets dw = 0 (the clamp's gradient).

Backward, chunks in reverse with dS = dL/dS_L carried (the incoming grad of the final
state first); with dX = (I - A_ab)⁻ᵀ (A_rbᵀ dY + B̂ dSᵀ):

    dS0 = dYᵀ R̃ + dS diag(e^{Σ w}) + dXᵀ Ã        dV = A_rkᵀ dY + A_akᵀ dX + K̂ dSᵀ
    dR̃ = dY S0, dÃ = dX S0, dB̂ = U dS, dK̂ = V dS, dA_rb = dY Uᵀ, dA_ab = dX Uᵀ, ...

then dr, da, db, dk through the pairwise factors. dw_r is the sum of every decay
product whose span contains step r (masked matmuls over the chunk, never the
cancelling "reverse cumsum of q·dq - k·dk" form, which loses all precision when the
decay is near 0).

Kernels: `_intra_kernel` (parallel over chunks) forms the chunk matrices and the
decayed inputs; `_fwd_state_kernel` walks the chunks per (batch, head, value-row
block) for y and the state; the backward reruns `_intra_kernel`, walks the chunks in
reverse (`_bwd_state_kernel`: dS carry, dv, U and dX), then forms the key-side
gradients in parallel over chunks and key blocks (`_bwd_intra_kernel`).
Saved for backward: the inputs and the NC + 1 chunk-boundary states, so memory is
O(B·H·(T/L)·N² + B·T·H·N); the chunk matrices and U are recomputed.

fp32 state and accumulation; inputs fp32, bf16 (or fp64, computed in fp64). Any T
(ragged last chunk masked) and any N (tiles padded to a power of two >= 16 and
masked); offsets are int64 (program ids cast), so large B·T·H·N cannot overflow them.
Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (the test suite).

The forward's launches (`_intra_kernel`, `_fwd_state_kernel`) are the torch op
`torch.ops.rwkvx.wkv7_triton_chunked_fwd`, the backward's (`_intra_kernel`, `_bwd_state_kernel`,
`_bwd_intra_kernel`) `torch.ops.rwkvx.wkv7_triton_chunked_bwd`
(docs/operators.md#the-triton-kernels-as-torch-ops), so torch.compile traces the
autograd.Function around them with no graph break.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import CHUNK, tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)

__all__ = ["CHUNK", "unavailable", "wkv7_triton_chunked"]

LOG2_CHUNK = CHUNK.bit_length() - 1  # the (I - A)⁻¹ product's squarings
W_MIN = -60.0
# tl.dot precision for fp32 data: "tf32x3" runs on tensor cores with three TF32 products
# (~fp32 accuracy; a torch emulation of it gives the same gate-A margins as exact fp32,
# plain "tf32" fails them); "ieee" is exact fp32 on CUDA cores, and spills heavily.
# The interpreter computes every dot exactly whatever this says.
DOT_PRECISION = "tf32x3"
# CUDA's limit on a launch grid's y and z sides (x reaches 2^31 - 1).
GRID_YZ_MAX = 65535
# The pairwise [key, t, s] tiles are register-heavy: 8 warps keep ptxas spills small (sm_90).
PAIRWISE_WARPS = 8
# Value columns `_bwd_intra_kernel` reads at a time (its value-side tiles are [L, VALUE_BLOCK]).
VALUE_BLOCK = 32


if triton is not None:

    @triton.jit
    def _key_tiles(w, a, b, k, r, bi, h, t, tp, tn, j, T, H, N: tl.constexpr, DT: tl.constexpr, W_MIN: tl.constexpr):
        """The chunk's [key j, time t] tiles of the inputs, zero outside 0 <= t < T, j < N:
        w as given, w clamped at t, t - 1 and t + 1 (tp, tn), and a, b, k, r."""
        base = (bi * T * H + h) * N + j[:, None]
        mj = (j < N)[:, None]
        m = mj & (t < T)[None, :]
        off = base + t[None, :] * (H * N)
        w_raw = tl.load(w + off, mask=m, other=0.0).to(DT)
        mp = mj & (tp >= 0)[None, :]
        wp = tl.load(w + base + tp[None, :] * (H * N), mask=mp, other=0.0).to(DT)
        mn = mj & (tn < T)[None, :]
        wn = tl.load(w + base + tn[None, :] * (H * N), mask=mn, other=0.0).to(DT)
        at = tl.load(a + off, mask=m, other=0.0).to(DT)
        bt = tl.load(b + off, mask=m, other=0.0).to(DT)
        kt = tl.load(k + off, mask=m, other=0.0).to(DT)
        rt = tl.load(r + off, mask=m, other=0.0).to(DT)
        wt = tl.maximum(w_raw, W_MIN)
        return w_raw, wt, tl.maximum(wp, W_MIN), tl.maximum(wn, W_MIN), at, bt, kt, rt

    @triton.jit
    def _chunk_decays(w, wp, wn, L: tl.constexpr):
        """Log-decay sums of one chunk from w, wp, wn [key, t] (w at t, t-1, t+1; zero outside).

        Returns c = Σ_{r<=t} w, cp = Σ_{r<t} w, tail = Σ_{r>t} w, cL = Σ_r w, and the
        pairwise factors [key, t, s] Ei = e^{Σ_{s<r<=t} w} (s <= t) and Ep = e^{Σ_{s<r<t} w}
        (s < t), zero elsewhere. Each sum covers exactly its span (see the module doc)."""
        c = tl.cumsum(w, axis=1)
        cp = tl.cumsum(wp, axis=1)
        tail = tl.cumsum(wn, axis=1, reverse=True)
        cL = tl.sum(w, axis=1)
        tt = tl.arange(0, L)[:, None]
        ss = tl.arange(0, L)[None, :]
        G = tl.cumsum(tl.where((tt > ss)[None, :, :], w[:, :, None], 0.0), axis=1)
        Gp = tl.cumsum(tl.where((tt - 1 > ss)[None, :, :], wp[:, :, None], 0.0), axis=1)
        Ei = tl.where((tt >= ss)[None, :, :], tl.exp(G), 0.0)
        Ep = tl.where((tt > ss)[None, :, :], tl.exp(Gp), 0.0)
        return c, cp, tail, cL, Ei, Ep

    @triton.jit
    def _shifted_times(ic, T, L: tl.constexpr):
        """Time indices of the chunk's steps, and of the step before / after each one inside
        the chunk (-1 or T, which the loads mask, where there is none)."""
        i = tl.arange(0, L)
        t = ic * L + i
        tp = tl.where((i >= 1) & (t < T), t - 1, -1)
        tn = tl.where(i < L - 1, t + 1, T)
        return t, tp, tn

    @triton.jit
    def _intra_kernel(
        w, a, b, k, r,
        inv_p, aak_p, arb_p, ark_p, at_p, rt_p, bh_p, kh_p, ecl_p,
        T, H, NC,
        N: tl.constexpr, L: tl.constexpr, LOG2L: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr, W_MIN: tl.constexpr,
    ):  # fmt: skip
        """One chunk's matrices [L, L] (I - A_ab)⁻¹, A_ak, A_rb, A_rk, its decayed inputs
        Ã, R̃, B̂, K̂ [L, N] and e^{Σ w} [N]."""
        ic = tl.program_id(0).to(tl.int64)
        bh = tl.program_id(1).to(tl.int64)
        bi = bh // H
        h = bh % H
        i = tl.arange(0, L)
        t, tp, tn = _shifted_times(ic, T, L)
        rows = bh * NC * L + ic * L + i  # rows of the [B*H, NC*L, N] buffers
        A_ab = tl.zeros((L, L), DT)
        A_ak = tl.zeros((L, L), DT)
        A_rb = tl.zeros((L, L), DT)
        A_rk = tl.zeros((L, L), DT)
        for kb in tl.static_range(0, BK, BKC):
            j = kb + tl.arange(0, BKC)
            _, wt, wp, wn, at, bt, kt, rt = _key_tiles(w, a, b, k, r, bi, h, t, tp, tn, j, T, H, N, DT, W_MIN)
            c, cp, tail, cL, Ei, Ep = _chunk_decays(wt, wp, wn, L)
            A_ab += tl.sum(at[:, :, None] * bt[:, None, :] * Ep, axis=0)
            A_ak += tl.sum(at[:, :, None] * kt[:, None, :] * Ep, axis=0)
            A_rb += tl.sum(rt[:, :, None] * bt[:, None, :] * Ei, axis=0)
            A_rk += tl.sum(rt[:, :, None] * kt[:, None, :] * Ei, axis=0)
            off = rows[None, :] * N + j[:, None]
            m = (j < N)[:, None]
            tl.store(at_p + off, at * tl.exp(cp), mask=m)
            tl.store(rt_p + off, rt * tl.exp(c), mask=m)
            tl.store(bh_p + off, bt * tl.exp(tail), mask=m)
            tl.store(kh_p + off, kt * tl.exp(tail), mask=m)
            tl.store(ecl_p + (bh * NC + ic) * N + j, tl.exp(cL), mask=j < N)
        # (I - A)⁻¹ = (I + A)(I + A²)(I + A⁴)... for strictly lower A
        inv = (i[:, None] == i[None, :]).to(DT) + A_ab
        power = A_ab
        for _ in tl.static_range(LOG2L - 1):
            power = tl.dot(power, power, input_precision=PREC)
            inv += tl.dot(inv, power, input_precision=PREC)
        moff = ((bh * NC + ic) * L + i[:, None]) * L + i[None, :]
        tl.store(inv_p + moff, inv)
        tl.store(aak_p + moff, A_ak)
        tl.store(arb_p + moff, A_rb)
        tl.store(ark_p + moff, A_rk)

    @triton.jit
    def _chunk_consts(inv_p, aak_p, arb_p, ark_p, at_p, rt_p, bh_p, kh_p, ecl_p, bh, ic, NC,
                      N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """Load what `_intra_kernel` stored for chunk ic: four [L, L], four [L, BK], one [BK]."""
        i = tl.arange(0, L)
        cols = tl.arange(0, BK)
        moff = ((bh * NC + ic) * L + i[:, None]) * L + i[None, :]
        roff = (bh * NC * L + ic * L + i[:, None]) * N + cols[None, :]
        rm = (cols < N)[None, :]
        return (
            tl.load(inv_p + moff),
            tl.load(aak_p + moff),
            tl.load(arb_p + moff),
            tl.load(ark_p + moff),
            tl.load(at_p + roff, mask=rm, other=0.0),
            tl.load(rt_p + roff, mask=rm, other=0.0),
            tl.load(bh_p + roff, mask=rm, other=0.0),
            tl.load(kh_p + roff, mask=rm, other=0.0),
            tl.load(ecl_p + (bh * NC + ic) * N + cols, mask=cols < N, other=0.0),
        )

    @triton.jit
    def _fwd_state_kernel(
        v, s0,
        inv_p, aak_p, arb_p, ark_p, at_p, rt_p, bh_p, kh_p, ecl_p,
        y, snaps, s_out,
        T, H, NC,
        N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """Walk the chunks for BV value rows of one (batch, head) state: y and the state,
        saving the state at every chunk start and the end."""
        bh = tl.program_id(0).to(tl.int64)
        iv = tl.program_id(1).to(tl.int64)
        bi = bh // H
        h = bh % H
        rows = iv * BV + tl.arange(0, BV)
        cols = tl.arange(0, BK)
        i = tl.arange(0, L)
        mr = rows < N
        m2 = mr[:, None] & (cols < N)[None, :]
        off2 = rows[:, None] * N + cols[None, :]
        S = tl.load(s0 + bh * N * N + off2, mask=m2, other=0.0).to(DT)
        for ic in range(NC):
            tl.store(snaps + (bh * (NC + 1) + ic) * N * N + off2, S, mask=m2)
            t = ic * L + i
            xoff = ((bi * T + t[:, None]) * H + h) * N + rows[None, :]
            xm = (t < T)[:, None] & mr[None, :]
            vt = tl.load(v + xoff, mask=xm, other=0.0).to(DT)
            inv, A_ak, A_rb, A_rk, At, Rt, Bh, Kh, ecl = _chunk_consts(
                inv_p, aak_p, arb_p, ark_p, at_p, rt_p, bh_p, kh_p, ecl_p, bh, ic, NC, N, L, BK
            )
            St = tl.trans(S)
            U = tl.dot(At, St, input_precision=PREC) + tl.dot(A_ak, vt, input_precision=PREC)
            U = tl.dot(inv, U, input_precision=PREC)
            yt = tl.dot(Rt, St, input_precision=PREC) + tl.dot(A_rb, U, input_precision=PREC)
            yt += tl.dot(A_rk, vt, input_precision=PREC)
            tl.store(y + xoff, yt, mask=xm)
            S = S * ecl[None, :] + tl.dot(tl.trans(U), Bh, input_precision=PREC)
            S += tl.dot(tl.trans(vt), Kh, input_precision=PREC)
        tl.store(snaps + (bh * (NC + 1) + NC) * N * N + off2, S, mask=m2)
        tl.store(s_out + bh * N * N + off2, S, mask=m2)

    @triton.jit
    def _bwd_state_kernel(
        v, dy, snaps, ds_out,
        inv_p, aak_p, arb_p, ark_p, at_p, rt_p, bh_p, kh_p, ecl_p,
        u_p, dx_p, dv, dsnaps, ds0,
        T, H, NC,
        N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """Walk the chunks in reverse for BV value rows: carry dS, write dv, and U, dX and
        each chunk's end-state gradient for `_bwd_intra_kernel`. Each chunk constant is
        loaded where it is first used (and Ã again for the carry) so that few [L, BK]
        tiles are live at once."""
        bh = tl.program_id(0).to(tl.int64)
        iv = tl.program_id(1).to(tl.int64)
        bi = bh // H
        h = bh % H
        rows = iv * BV + tl.arange(0, BV)
        cols = tl.arange(0, BK)
        i = tl.arange(0, L)
        mr = rows < N
        m2 = mr[:, None] & (cols < N)[None, :]
        off2 = rows[:, None] * N + cols[None, :]
        rm = (cols < N)[None, :]
        dS = tl.load(ds_out + bh * N * N + off2, mask=m2, other=0.0).to(DT)
        for cc in range(NC):
            ic = NC - 1 - cc
            tl.store(dsnaps + (bh * NC + ic) * N * N + off2, dS, mask=m2)
            t = ic * L + i
            moff = ((bh * NC + ic) * L + i[:, None]) * L + i[None, :]
            roff = (bh * NC * L + t[:, None]) * N + cols[None, :]
            xoff = ((bi * T + t[:, None]) * H + h) * N + rows[None, :]
            xm = (t < T)[:, None] & mr[None, :]
            vt = tl.load(v + xoff, mask=xm, other=0.0).to(DT)
            S0 = tl.load(snaps + (bh * (NC + 1) + ic) * N * N + off2, mask=m2, other=0.0)
            At = tl.load(at_p + roff, mask=rm, other=0.0)
            A_ak = tl.load(aak_p + moff)
            inv = tl.load(inv_p + moff)
            U = tl.dot(At, tl.trans(S0), input_precision=PREC) + tl.dot(A_ak, vt, input_precision=PREC)
            U = tl.dot(inv, U, input_precision=PREC)
            dyt = tl.load(dy + xoff, mask=xm, other=0.0).to(DT)
            Bh = tl.load(bh_p + roff, mask=rm, other=0.0)
            dSt = tl.trans(dS)
            dX = tl.dot(tl.trans(tl.load(arb_p + moff)), dyt, input_precision=PREC)
            dX += tl.dot(Bh, dSt, input_precision=PREC)
            dX = tl.dot(tl.trans(inv), dX, input_precision=PREC)
            dvt = tl.dot(tl.trans(tl.load(ark_p + moff)), dyt, input_precision=PREC)
            dvt += tl.dot(tl.trans(A_ak), dX, input_precision=PREC)
            Kh = tl.load(kh_p + roff, mask=rm, other=0.0)
            dvt += tl.dot(Kh, dSt, input_precision=PREC)
            tl.store(dv + xoff, dvt, mask=xm)
            boff = (bh * NC * L + t[:, None]) * N + rows[None, :]
            tl.store(u_p + boff, U, mask=mr[None, :])
            tl.store(dx_p + boff, dX, mask=mr[None, :])
            ecl = tl.load(ecl_p + (bh * NC + ic) * N + cols, mask=cols < N, other=0.0)
            Rt = tl.load(rt_p + roff, mask=rm, other=0.0)
            dS = dS * ecl[None, :] + tl.dot(tl.trans(dyt), Rt, input_precision=PREC)
            dS += tl.dot(tl.trans(dX), tl.load(at_p + roff, mask=rm, other=0.0), input_precision=PREC)
        tl.store(ds0 + bh * N * N + off2, dS, mask=m2)

    @triton.jit
    def _bwd_intra_kernel(
        w, a, b, k, r, v, dy,
        u_p, dx_p, snaps, dsnaps,
        dr, dw, dk, da, db,
        T, H, NC,
        N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BVC: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr, W_MIN: tl.constexpr,
    ):  # fmt: skip
        """dr, dw, dk, da, db of one chunk over BKC key columns. Value-side tiles [t, value]
        and [value, key] are read BVC value columns at a time; key-side tiles are [key, t]
        and [key, t, s], the Ep ones formed and consumed before the Ei ones."""
        ic = tl.program_id(0).to(tl.int64)
        bh = tl.program_id(1).to(tl.int64)
        kb = tl.program_id(2).to(tl.int64)
        bi = bh // H
        h = bh % H
        i = tl.arange(0, L)
        t, tp, tn = _shifted_times(ic, T, L)
        j = kb * BKC + tl.arange(0, BKC)
        mj = j < N
        tt = i[:, None]
        ss = i[None, :]
        # value side, summed over BVC-column blocks: the chunk matrices' gradients [t, s],
        # the decayed inputs' gradients [key, t] and Σ_value dS_L ⊙ S0 [key]
        dA_rb = tl.zeros((L, L), DT)
        dA_rk = tl.zeros((L, L), DT)
        dA_ab = tl.zeros((L, L), DT)
        dA_ak = tl.zeros((L, L), DT)
        dRt = tl.zeros((BKC, L), DT)  # (dY S0)ᵀ
        dAt = tl.zeros((BKC, L), DT)  # (dX S0)ᵀ
        dBh = tl.zeros((BKC, L), DT)  # (U dS_L)ᵀ
        dKh = tl.zeros((BKC, L), DT)  # (V dS_L)ᵀ
        sds = tl.zeros((BKC,), DT)
        xbase = ((bi * T + t[:, None]) * H + h) * N
        bbase = (bh * NC * L + t[:, None]) * N
        s0base = (bh * (NC + 1) + ic) * N * N
        dsbase = (bh * NC + ic) * N * N
        for vb in range(0, BK, BVC):
            vals = vb + tl.arange(0, BVC)
            mv = vals < N
            xm = (t < T)[:, None] & mv[None, :]
            dyt = tl.load(dy + xbase + vals[None, :], mask=xm, other=0.0).to(DT)
            vt = tl.load(v + xbase + vals[None, :], mask=xm, other=0.0).to(DT)
            U = tl.load(u_p + bbase + vals[None, :], mask=mv[None, :], other=0.0)
            dX = tl.load(dx_p + bbase + vals[None, :], mask=mv[None, :], other=0.0)
            dA_rb += tl.dot(dyt, tl.trans(U), input_precision=PREC)
            dA_rk += tl.dot(dyt, tl.trans(vt), input_precision=PREC)
            dA_ab += tl.dot(dX, tl.trans(U), input_precision=PREC)
            dA_ak += tl.dot(dX, tl.trans(vt), input_precision=PREC)
            soff = vals[:, None] * N + j[None, :]
            sm = mv[:, None] & mj[None, :]
            S0t = tl.trans(tl.load(snaps + s0base + soff, mask=sm, other=0.0))
            dSLt = tl.trans(tl.load(dsnaps + dsbase + soff, mask=sm, other=0.0))
            dRt += tl.dot(S0t, tl.trans(dyt), input_precision=PREC)
            dAt += tl.dot(S0t, tl.trans(dX), input_precision=PREC)
            dBh += tl.dot(dSLt, tl.trans(U), input_precision=PREC)
            dKh += tl.dot(dSLt, tl.trans(vt), input_precision=PREC)
            sds += tl.sum(dSLt * S0t, axis=1)
        dA_rb = tl.where(tt >= ss, dA_rb, 0.0)
        dA_rk = tl.where(tt >= ss, dA_rk, 0.0)
        dA_ab = tl.where(tt > ss, dA_ab, 0.0)
        dA_ak = tl.where(tt > ss, dA_ak, 0.0)
        # key side: the decayed inputs' part, then the pairwise Ep part, then the Ei part
        w_raw, wt, wp, wn, at, bt, kt, rt = _key_tiles(w, a, b, k, r, bi, h, t, tp, tn, j, T, H, N, DT, W_MIN)
        ea = tl.exp(tl.cumsum(wp, axis=1))  # Σ_{r<t} w
        er = tl.exp(tl.cumsum(wt, axis=1))  # Σ_{r<=t} w
        eb = tl.exp(tl.cumsum(wn, axis=1, reverse=True))  # Σ_{r>t} w
        da_ = dAt * ea
        dr_ = dRt * er
        db_ = dBh * eb
        dk_ = dKh * eb
        # dw_q: the terms whose decay spans step q. Ã_t spans r < t, R̃_t spans r <= t,
        # B̂_s and K̂_s span r > s, e^{Σ w} every r, Ep[t, s] s < r < t, Ei[t, s] s < r <= t.
        dw_ = tl.dot(da_ * at, (tt > ss).to(DT), input_precision=PREC)  # Σ_{t > q}
        dw_ += tl.dot(dr_ * rt, (tt >= ss).to(DT), input_precision=PREC)  # Σ_{t >= q}
        dw_ += tl.dot(db_ * bt + dk_ * kt, (tt < ss).to(DT), input_precision=PREC)  # Σ_{s < q}
        dw_ += (sds * tl.exp(tl.sum(wt, axis=1)))[:, None]
        # Ep[t, s] = e^{Σ_{s<r<t} w} (s < t): A_ab, A_ak
        Gp = tl.cumsum(tl.where((tt - 1 > ss)[None, :, :], wp[:, :, None], 0.0), axis=1)
        Ep = tl.where((tt > ss)[None, :, :], tl.exp(Gp), 0.0)
        Wab = dA_ab[None, :, :] * Ep  # [key, t, s]
        Wak = dA_ak[None, :, :] * Ep
        Pa = Wab * bt[:, None, :] + Wak * kt[:, None, :]
        da_ += tl.sum(Pa, axis=2)
        db_ += tl.sum(Wab * at[:, :, None], axis=1)
        dk_ += tl.sum(Wak * at[:, :, None], axis=1)
        # Σ_{s<q} Σ_{t>q} Pa[t, s] a_t: the Σ_{t>=Q} scan, summed over s < Q - 1, moved to q = Q - 1
        span = tl.cumsum(Pa * at[:, :, None], axis=1, reverse=True)  # [key, Q, s]
        span_q = tl.sum(tl.where((ss < tt - 1)[None, :, :], span, 0.0), axis=2)  # [key, Q]
        dw_ += tl.sum(tl.where((tt == ss + 1)[None, :, :], span_q[:, :, None], 0.0), axis=1)
        # Ei[t, s] = e^{Σ_{s<r<=t} w} (s <= t): A_rb, A_rk
        G = tl.cumsum(tl.where((tt > ss)[None, :, :], wt[:, :, None], 0.0), axis=1)
        Ei = tl.where((tt >= ss)[None, :, :], tl.exp(G), 0.0)
        Wrb = dA_rb[None, :, :] * Ei
        Wrk = dA_rk[None, :, :] * Ei
        Pr = Wrb * bt[:, None, :] + Wrk * kt[:, None, :]
        dr_ += tl.sum(Pr, axis=2)
        db_ += tl.sum(Wrb * rt[:, :, None], axis=1)
        dk_ += tl.sum(Wrk * rt[:, :, None], axis=1)
        # Σ_{s<q} Σ_{t>=q} Pr[t, s] r_t
        span = tl.cumsum(Pr * rt[:, :, None], axis=1, reverse=True)  # [key, q, s]
        dw_ += tl.sum(tl.where((ss < tt)[None, :, :], span, 0.0), axis=2)
        dw_ = tl.where(w_raw >= W_MIN, dw_, 0.0)  # the clamp's gradient
        goff = ((bi * T + t[None, :]) * H + h) * N + j[:, None]
        gm = (t < T)[None, :] & mj[:, None]
        tl.store(dr + goff, dr_, mask=gm)
        tl.store(dw + goff, dw_, mask=gm)
        tl.store(dk + goff, dk_, mask=gm)
        tl.store(da + goff, da_, mask=gm)
        tl.store(db + goff, db_, mask=gm)


def _blocks(N: int) -> tuple[int, int, int]:
    """BK (the padded head, a power of two >= 16 for tl.dot), BKC (key columns per
    pairwise tile), BV (value rows per state-walking program: 16, tl.dot's least, keeps
    the [BV, BK] state tiles small enough not to spill at N = 128)."""
    BK = max(16, triton.next_power_of_2(N))
    return BK, min(BK, 32), 16


def _dot_precision(dtype: torch.dtype) -> str:
    """Exact dots for fp64 inputs (the gradient checks), DOT_PRECISION otherwise."""
    return "ieee" if dtype == torch.float64 else DOT_PRECISION


def _intra(ins, NC: int, cdt: torch.dtype, DT, prec: str) -> list[torch.Tensor]:
    """Run `_intra_kernel`: (I - A_ab)⁻¹, A_ak, A_rb, A_rk, Ã, R̃, B̂, K̂, e^{Σ w} per chunk."""
    r, w, k, _, a, b = ins
    B, T, H, N = r.shape
    BK, BKC, _ = _blocks(N)
    empty = tr.compute_empty(cdt, r.device)
    mats = [empty(B * H, NC, CHUNK, CHUNK) for _ in range(4)]
    rows = [empty(B * H, NC * CHUNK, N) for _ in range(4)]
    ecl = empty(B * H, NC, N)
    wrap_triton(_intra_kernel)[(NC, B * H)](
        w, a, b, k, r, *mats, *rows, ecl, T, H, NC, N, CHUNK, LOG2_CHUNK, BK, BKC, DT, prec, W_MIN,
        num_warps=PAIRWISE_WARPS,
    )  # fmt: skip
    return [*mats, *rows, ecl]


def index_offsets(B: int, T: int, H: int, N: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index (int64 bases: every program id is
    widened); refuses sizes they cannot index."""
    BK, BKC, BV = _blocks(N)
    NC = triton.cdiv(T, CHUNK)
    buffers = {
        "inputs": (B, T, H, N),
        "chunk matrices": (B * H, NC, CHUNK, CHUNK),
        "chunk rows": (B * H, NC * CHUNK, N),
        "state snapshots": (B, H, NC + 1, N, N),
    }
    if B * H > GRID_YZ_MAX:  # the kernels put B * H on the grid's y axis
        raise ValueError(f"wkv7 triton_chunked: B * H = {B * H} passes the CUDA grid's {GRID_YZ_MAX} on its y axis")
    return tr.check_offsets("wkv7 triton_chunked", buffers, tile=N * N)


@triton_op("rwkvx::wkv7_triton_chunked_fwd")
def wkv7_triton_chunked_fwd(
    r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, s0: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernels: r..b [B, T, H, N] in one dtype (w the log decay), s0 [B, H, N, N]
    in the compute dtype. Returns (y in the compute dtype, the NC + 1 chunk-boundary states
    [B, H, NC + 1, N, N], state_out)."""
    B, T, H, N = r.shape
    r, w, k, v, a, b, s0 = (x.contiguous() for x in (r, w, k, v, a, b, s0))
    ins = (r, w, k, v, a, b)
    cdt, DT = tr.compute_dtype(r.dtype)
    prec = _dot_precision(r.dtype)
    BK, _, BV = _blocks(N)
    NC = triton.cdiv(T, CHUNK)
    consts = _intra(ins, NC, cdt, DT, prec)
    # y in the compute dtype, rounded to the input dtype by torch (round-to-nearest-even;
    # Triton's interpreter truncates fp32 -> bf16)
    y = tr.compute_empty(cdt, r.device)(B, T, H, N)
    snaps = s0.new_empty(B, H, NC + 1, N, N)
    s_out = torch.empty_like(s0)
    wrap_triton(_fwd_state_kernel)[(B * H, triton.cdiv(N, BV))](
        v, s0, *consts, y, snaps, s_out, T, H, NC, N, CHUNK, BK, BV, DT, prec
    )
    return y, snaps, s_out


@triton_op("rwkvx::wkv7_triton_chunked_bwd")
def wkv7_triton_chunked_bwd(
    r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, snaps: Tensor, dy: Tensor, ds_out: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernels: the forward's inputs and chunk-boundary states, the cotangents of
    y and state_out in the compute dtype. Returns (dr, dw, dk, dv, da, db, dstate) in the
    compute dtype."""
    B, T, H, N = r.shape
    r, w, k, v, a, b, snaps, dy, ds_out = (x.contiguous() for x in (r, w, k, v, a, b, snaps, dy, ds_out))
    cdt, DT = tr.compute_dtype(r.dtype)
    prec = _dot_precision(r.dtype)
    BK, BKC, BV = _blocks(N)
    NC = triton.cdiv(T, CHUNK)
    consts = _intra((r, w, k, v, a, b), NC, cdt, DT, prec)
    empty = tr.compute_empty(cdt, r.device)
    U = empty(B * H, NC * CHUNK, N)
    dX = empty(B * H, NC * CHUNK, N)
    dsnaps = empty(B, H, NC, N, N)
    dv = empty(B, T, H, N)
    ds0 = empty(B, H, N, N)
    wrap_triton(_bwd_state_kernel)[(B * H, triton.cdiv(N, BV))](
        v, dy, snaps, ds_out, *consts, U, dX, dv, dsnaps, ds0,
        T, H, NC, N, CHUNK, BK, BV, DT, prec,
    )  # fmt: skip
    dr, dw, dk, da, db = (empty(B, T, H, N) for _ in range(5))
    wrap_triton(_bwd_intra_kernel)[(NC, B * H, triton.cdiv(N, BKC))](
        w, a, b, k, r, v, dy, U, dX, snaps, dsnaps, dr, dw, dk, da, db,
        T, H, NC, N, CHUNK, BK, BKC, min(BK, VALUE_BLOCK), DT, prec, W_MIN,
        num_warps=PAIRWISE_WARPS,
    )  # fmt: skip
    return dr, dw, dk, dv, da, db, ds0


class _WKV7TritonChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, w, k, v, a, b, state):
        B, T, H, N = r.shape
        index_offsets(B, T, H, N)  # before any copy or allocation
        ins, (s0,), _, _ = tr.prepare((r, w, k, v, a, b), (state,), r.dtype)
        y, snaps, s_out = torch.ops.rwkvx.wkv7_triton_chunked_fwd(*ins, s0)
        ctx.save_for_backward(*ins, snaps)
        ctx.state_dtype = state.dtype
        return y.to(r.dtype), s_out

    @staticmethod
    def backward(ctx, dy, ds_out):
        *ins, snaps = ctx.saved_tensors
        r = ins[0]
        (dy,), (ds_out,), _, _ = tr.prepare((dy,), (ds_out,), r.dtype)
        grads = torch.ops.rwkvx.wkv7_triton_chunked_bwd(*ins, snaps, dy, ds_out)
        return tr.cast_back(grads, (r.dtype,) * 6 + (ctx.state_dtype,))


def wkv7_triton_chunked(r, w, k, v, a, b, state):
    return _WKV7TritonChunked.apply(r, w, k, v, a, b, state)
