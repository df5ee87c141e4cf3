"""shift_mix `triton` backend: LayerNorm, token shift and M lerps, forward and backward.

The rows are the B·T tokens of x [B, T, C]. Every kernel walks C in blocks of BC columns, so its
registers do not grow with the model width. The shift reads x̂ of the row before (the backward,
dy of the row after): the kernels load that row too (the tile shifted by one row: cache hits)
and recompute its LayerNorm, and take the state at t = 0.

Forward, one kernel: per tile of BT rows, a pass over C for the statistics of the tile's rows and
of the rows before (per-block mean and M2, merged by Chan's formula), then a pass writing the M
outputs (the second pass finds the tile's rows in cache); it saves the statistics [B, T].

Backward, two kernels. `_bwd_rows_kernel` sums per row what LayerNorm's backward needs, Σ_c g and
Σ_c g n; then `_bwd_kernel`, one program per block of BC columns and run of rows, writes dx and
the state's gradient and keeps the sums over rows of dweight, dbias and dmix in registers
(per-program partials, summed by torch). With n = (x - mean) rstd, x̂ = n weight + bias,
y_m[t] = x̂[t] (1 - mix_m) + x̂[t-1] mix_m and g = dx̂ weight:

    dx̂[t]  = Σ_m dy_m[t] (1 - mix_m) + dy_m[t+1] mix_m          (+ dstate_out at t = T-1)
    dmix_m = Σ dy_m[t] (x̂[t-1] - x̂[t])     dstate = Σ_m dy_m[0] mix_m
    dx     = rstd (g - Σ_c g / C - n Σ_c g n / C)                  (+ dx_add)

dx_add is channel_mix's residual gradient (ops/channel_mix/fused.py). The M outputs are separate
tensors, passed to the kernels as eight pointer arguments (M constexpr; unused slots repeat one),
and a backward given None for some outputs' gradients runs on the others only.

The launches are torch ops, `torch.ops.rwkvx.shift_mix_triton_fwd` and `_bwd`
(docs/operators.md#the-triton-kernels-as-torch-ops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)
from rwkvx_cli.ops.shift_mix import mix_grads, mix_rows

SLOTS = 8  # pointer arguments for the outputs, their gradients and the lerp weights (shift_mix.MAX_MIXES)
# Warps per program; the column-block backward takes twice as many past 6 lerps (half the
# elements per thread): at M = 8 with 4 warps it spills 8 bytes on sm_80 (bf16).
WARPS = 4

if triton is not None:

    @triton.jit
    def _pick(m: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
        """The m-th of eight pointer arguments, chosen at compile time."""
        p = p0
        if m == 1:
            p = p1
        if m == 2:
            p = p2
        if m == 3:
            p = p3
        if m == 4:
            p = p4
        if m == 5:
            p = p5
        if m == 6:
            p = p6
        if m == 7:
            p = p7
        return p

    @triton.jit
    def _starts(starts, rows, ok, HAS_STARTS: tl.constexpr):
        """Whether each row starts a document (bool [R] `starts`; all False without)."""
        if HAS_STARTS:
            return tl.load(starts + rows, mask=ok, other=0).to(tl.int1)
        return rows < 0

    @triton.jit
    def _stats(x, rows, ok, C, eps, BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
        """Mean and 1/std over C of rows of x [R, C] (masked by ok), one pass: each block's mean and
        M2, merged by Chan's pairwise update (no E[x²] - E[x]² cancellation)."""
        base = rows.to(tl.int64) * C
        mean = tl.zeros([BT], dtype=DT)
        m2 = tl.zeros([BT], dtype=DT)
        na = tl.zeros([1], dtype=DT)
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            mc = cols < C
            m = ok[:, None] & mc[None, :]
            xt = tl.load(x + base[:, None] + cols[None, :], mask=m, other=0.0).to(DT)
            nb = tl.sum(mc.to(DT), axis=0)
            bmean = tl.sum(xt, axis=1) / nb
            d = tl.where(m, xt - bmean[:, None], 0.0)
            tot = na + nb
            delta = bmean - mean
            mean = mean + delta * (nb / tot)
            m2 = m2 + tl.sum(d * d, axis=1) + delta * delta * (na * nb / tot)
            na = tot
        return mean, 1.0 / tl.sqrt(m2 / C + eps)

    @triton.jit
    def _fwd_kernel(
        x, weight, bias, mx0, mx1, mx2, mx3, mx4, mx5, mx6, mx7, state, starts,
        y0, y1, y2, y3, y4, y5, y6, y7, s_out, mean_out, rstd_out,
        R, T, C, eps,
        M: tl.constexpr, HAS_STARTS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        ok = rows < R
        t = rows % T
        start = _starts(starts, rows, ok, HAS_STARTS)  # x̂[t-1] = 0 there
        has_prev = ok & (t > 0) & ~start
        first = ok & (t == 0) & ~start
        last = ok & (t == T - 1)
        mean, rstd = _stats(x, rows, ok, C, eps, BT, BC, DT)
        pmean, prstd = _stats(x, rows - 1, has_prev, C, eps, BT, BC, DT)
        tl.store(mean_out + rows, mean, mask=ok)
        tl.store(rstd_out + rows, rstd, mask=ok)
        base = rows.to(tl.int64) * C
        sbase = (rows // T).to(tl.int64) * C
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            mc = cols < C
            m = ok[:, None] & mc[None, :]
            w = tl.load(weight + cols, mask=mc, other=0.0).to(DT)[None, :]
            b = tl.load(bias + cols, mask=mc, other=0.0).to(DT)[None, :]
            off = base[:, None] + cols[None, :]
            soff = sbase[:, None] + cols[None, :]
            xn = (tl.load(x + off, mask=m, other=0.0).to(DT) - mean[:, None]) * rstd[:, None] * w + b
            xp = tl.load(x + off - C, mask=has_prev[:, None] & mc[None, :], other=0.0).to(DT)
            xp = (xp - pmean[:, None]) * prstd[:, None] * w + b
            s0 = tl.load(state + soff, mask=first[:, None] & mc[None, :], other=0.0).to(DT)
            dd = tl.where(first[:, None], s0, tl.where(start[:, None], 0.0, xp)) - xn
            for i in tl.static_range(M):
                mx = tl.load(_pick(i, mx0, mx1, mx2, mx3, mx4, mx5, mx6, mx7) + cols, mask=mc, other=0.0)
                mx = mx.to(DT)[None, :]
                y = _pick(i, y0, y1, y2, y3, y4, y5, y6, y7)
                tl.store(y + off, (xn + dd * mx).to(y.dtype.element_ty), mask=m)
            tl.store(s_out + soff, xn, mask=last[:, None] & mc[None, :])

    @triton.jit
    def _bwd_rows_kernel(
        dy0, dy1, dy2, dy3, dy4, dy5, dy6, dy7, ds, x, weight, mx0, mx1, mx2, mx3, mx4, mx5, mx6, mx7, mean, rstd,
        sums, starts,
        R, T, C,
        M: tl.constexpr, HAS_DS: tl.constexpr, HAS_STARTS: tl.constexpr,
        BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        ok = rows < R
        t = rows % T
        nxt = ok & (t < T - 1)
        nxt = nxt & ~_starts(starts, rows + 1, nxt, HAS_STARTS)  # the next row's x̂[t-1] is not this row's
        last = ok & (t == T - 1)
        mu = tl.load(mean + rows, mask=ok, other=0.0)
        rs = tl.load(rstd + rows, mask=ok, other=0.0)
        base = rows.to(tl.int64) * C
        sbase = (rows // T).to(tl.int64) * C
        sg = tl.zeros([BT, BC], dtype=DT)
        sgn = tl.zeros([BT, BC], dtype=DT)
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            mc = cols < C
            m = ok[:, None] & mc[None, :]
            off = base[:, None] + cols[None, :]
            n = (tl.load(x + off, mask=m, other=0.0).to(DT) - mu[:, None]) * rs[:, None]
            dxn = tl.zeros([BT, BC], dtype=DT)
            for i in tl.static_range(M):
                mx = tl.load(_pick(i, mx0, mx1, mx2, mx3, mx4, mx5, mx6, mx7) + cols, mask=mc, other=0.0)
                mx = mx.to(DT)[None, :]
                dy = _pick(i, dy0, dy1, dy2, dy3, dy4, dy5, dy6, dy7)
                g0 = tl.load(dy + off, mask=m, other=0.0).to(DT)
                g1 = tl.load(dy + off + C, mask=nxt[:, None] & mc[None, :], other=0.0).to(DT)
                dxn += g0 + (g1 - g0) * mx
            if HAS_DS:
                dxn += tl.load(ds + sbase[:, None] + cols[None, :], mask=last[:, None] & mc[None, :], other=0.0).to(DT)
            g = dxn * tl.load(weight + cols, mask=mc, other=0.0).to(DT)[None, :]
            sg += g
            sgn += g * n
        tl.store(sums + rows, tl.sum(sg, axis=1), mask=ok)
        tl.store(sums + R + rows, tl.sum(sgn, axis=1), mask=ok)

    @triton.jit
    def _bwd_kernel(
        dy0, dy1, dy2, dy3, dy4, dy5, dy6, dy7, ds, dx_add, x, weight, bias,
        mx0, mx1, mx2, mx3, mx4, mx5, mx6, mx7, state, mean, rstd, sums, starts,
        dx, dstate, dw_p, db_p, dmix_p,
        R, T, C, RP,
        M: tl.constexpr, HAS_DS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_STARTS: tl.constexpr,
        BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(0)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        mc = cols < C
        w = tl.load(weight + cols, mask=mc, other=0.0).to(DT)[None, :]
        b = tl.load(bias + cols, mask=mc, other=0.0).to(DT)[None, :]
        acc_w = tl.zeros([BT, BC], dtype=DT)
        acc_b = tl.zeros([BT, BC], dtype=DT)
        a0 = tl.zeros([BT, BC], dtype=DT)  # dmix_m's partial sums (those past M are never used)
        a1 = tl.zeros([BT, BC], dtype=DT)
        a2 = tl.zeros([BT, BC], dtype=DT)
        a3 = tl.zeros([BT, BC], dtype=DT)
        a4 = tl.zeros([BT, BC], dtype=DT)
        a5 = tl.zeros([BT, BC], dtype=DT)
        a6 = tl.zeros([BT, BC], dtype=DT)
        a7 = tl.zeros([BT, BC], dtype=DT)
        for r0 in range(p * RP, p * RP + RP, BT):
            rows = r0 + tl.arange(0, BT)
            ok = rows < R
            t = rows % T
            start = _starts(starts, rows, ok, HAS_STARTS)
            has_prev = ok & (t > 0) & ~start
            first = ok & (t == 0)
            nxt = ok & (t < T - 1)
            nxt = nxt & ~_starts(starts, rows + 1, nxt, HAS_STARTS)
            m = ok[:, None] & mc[None, :]
            mu = tl.load(mean + rows, mask=ok, other=0.0)[:, None]
            rs = tl.load(rstd + rows, mask=ok, other=0.0)[:, None]
            pmu = tl.load(mean + rows - 1, mask=has_prev, other=0.0)[:, None]
            prs = tl.load(rstd + rows - 1, mask=has_prev, other=0.0)[:, None]
            sg = tl.load(sums + rows, mask=ok, other=0.0)[:, None] / C
            sgn = tl.load(sums + R + rows, mask=ok, other=0.0)[:, None] / C
            off = rows.to(tl.int64)[:, None] * C + cols[None, :]
            soff = (rows // T).to(tl.int64)[:, None] * C + cols[None, :]
            n = (tl.load(x + off, mask=m, other=0.0).to(DT) - mu) * rs
            xn = n * w + b
            xp = (tl.load(x + off - C, mask=has_prev[:, None] & mc[None, :], other=0.0).to(DT) - pmu) * prs * w + b
            s0 = tl.load(state + soff, mask=(first & ~start)[:, None] & mc[None, :], other=0.0).to(DT)
            diff = tl.where(first[:, None], s0, tl.where(start[:, None], 0.0, xp)) - xn
            dxn = tl.zeros([BT, BC], dtype=DT)
            dst = tl.zeros([BT, BC], dtype=DT)
            for i in tl.static_range(M):
                mx = tl.load(_pick(i, mx0, mx1, mx2, mx3, mx4, mx5, mx6, mx7) + cols, mask=mc, other=0.0)
                mx = mx.to(DT)[None, :]
                dy = _pick(i, dy0, dy1, dy2, dy3, dy4, dy5, dy6, dy7)
                g0 = tl.load(dy + off, mask=m, other=0.0).to(DT)
                g1 = tl.load(dy + off + C, mask=nxt[:, None] & mc[None, :], other=0.0).to(DT)
                dxn += g0 + (g1 - g0) * mx
                dst += g0 * mx
                c = g0 * diff
                if i == 0:
                    a0 += c
                if i == 1:
                    a1 += c
                if i == 2:
                    a2 += c
                if i == 3:
                    a3 += c
                if i == 4:
                    a4 += c
                if i == 5:
                    a5 += c
                if i == 6:
                    a6 += c
                if i == 7:
                    a7 += c
            if HAS_DS:
                dxn += tl.load(ds + soff, mask=(ok & (t == T - 1))[:, None] & mc[None, :], other=0.0).to(DT)
            acc_w += dxn * n
            acc_b += dxn
            g = dxn * w
            d = rs * (g - sg - n * sgn)
            if HAS_ADD:
                d += tl.load(dx_add + off, mask=m, other=0.0).to(DT)
            tl.store(dx + off, d.to(dx.dtype.element_ty), mask=m)
            tl.store(dstate + soff, tl.where(start[:, None], 0.0, dst), mask=first[:, None] & mc[None, :])
        pc = p.to(tl.int64) * C + cols
        tl.store(dw_p + pc, tl.sum(acc_w, axis=0), mask=mc)
        tl.store(db_p + pc, tl.sum(acc_b, axis=0), mask=mc)
        pm = p.to(tl.int64) * M * C + cols
        if M > 0:
            tl.store(dmix_p + pm, tl.sum(a0, axis=0), mask=mc)
        if M > 1:
            tl.store(dmix_p + pm + C, tl.sum(a1, axis=0), mask=mc)
        if M > 2:
            tl.store(dmix_p + pm + 2 * C, tl.sum(a2, axis=0), mask=mc)
        if M > 3:
            tl.store(dmix_p + pm + 3 * C, tl.sum(a3, axis=0), mask=mc)
        if M > 4:
            tl.store(dmix_p + pm + 4 * C, tl.sum(a4, axis=0), mask=mc)
        if M > 5:
            tl.store(dmix_p + pm + 5 * C, tl.sum(a5, axis=0), mask=mc)
        if M > 6:
            tl.store(dmix_p + pm + 6 * C, tl.sum(a6, axis=0), mask=mc)
        if M > 7:
            tl.store(dmix_p + pm + 7 * C, tl.sum(a7, axis=0), mask=mc)


def _tiles(C: int) -> tuple[int, int, int]:
    """The column block and the rows per tile: (BC, rows of the forward's and the row sums' tiles
    (512 elements), rows of the column-block kernel's (256: it keeps M + 2 accumulator tiles)).
    Twice as large, the forward and the row sums take ~130 registers and the column-block kernel
    spills (sm_80, bf16); these take 32..100 (the compile gate, M <= 8)."""
    BC = min(triton.next_power_of_2(C), 256)
    return BC, min(16, 512 // BC), min(16, 256 // BC)


def _slots(tensors: list[Tensor], fill: Tensor) -> list[Tensor]:
    return [*tensors, *[tensors[0] if tensors else fill] * (SLOTS - len(tensors))]


def index_offsets(B: int, T: int, C: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index (int64 row bases; the statistics
    [2, B, T] and the partials are smaller)."""
    return tr.check_offsets("shift_mix triton", {"x, y, dy": (B, T, C)})


@triton_op("rwkvx::shift_mix_triton_fwd")
def shift_mix_triton_fwd(
    x: Tensor, weight: Tensor, bias: Tensor, mix: list[Tensor], state: Tensor, eps: float, starts: Tensor | None = None
) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """The forward kernel: x [B, T, C], weight and bias [C], mix M lerp weights of C values each (any
    floating dtypes), the state [B, C] in the compute dtype, starts bool [B, T] or None. Returns
    ([y_0 .. y_{M-1}] in x's dtype, state_out [B, C], and the LayerNorm's mean and 1/std [B, T], in
    the compute dtype)."""
    B, T, C = x.shape
    M = len(mix)
    x, weight, bias, state = (t.contiguous() for t in (x, weight, bias, state))
    mix = [m.contiguous() for m in mix]
    cdt, DT = tr.compute_dtype(x.dtype)
    BC, BT, _ = _tiles(C)
    ys = [torch.empty_like(x) for _ in range(M)]
    s_out = torch.empty_like(state)
    mean, rstd = (torch.empty(B, T, dtype=cdt, device=x.device) for _ in range(2))
    flags = x if starts is None else starts.contiguous()
    wrap_triton(_fwd_kernel)[(triton.cdiv(B * T, BT),)](
        x, weight, bias, *_slots(mix, x), state, flags, *_slots(ys, x), s_out, mean, rstd,
        B * T, T, C, eps, M, starts is not None, BT, BC, DT, num_warps=WARPS,
    )  # fmt: skip
    return ys, s_out, mean, rstd


@triton_op("rwkvx::shift_mix_triton_bwd")
def shift_mix_triton_bwd(
    dys: list[Tensor],
    ds_out: Tensor | None,
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    mix: list[Tensor],
    state: Tensor,
    mean: Tensor,
    rstd: Tensor,
    dx_add: Tensor | None,
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernels: the cotangents of M outputs [B, T, C] (one dtype), with mix the M lerp
    weights of those M (C values each); the state_out cotangent [B, C] (or None); the forward's
    inputs and statistics; dx_add [B, T, C] added into dx (or None); the forward's starts. Returns
    (dx in x's dtype, then dweight, dbias [C], dmix [M, C], dstate [B, C] in the compute dtype)."""
    B, T, C = x.shape
    M, R = len(dys), B * T
    dys = [g.contiguous() for g in dys]
    x, weight, bias, state, mean, rstd = (t.contiguous() for t in (x, weight, bias, state, mean, rstd))
    mix = [m.contiguous() for m in mix]
    ds = x if ds_out is None else ds_out.contiguous()
    add = x if dx_add is None else dx_add.contiguous()
    cdt, DT = tr.compute_dtype(x.dtype)
    BC, BT, BT2 = _tiles(C)
    NCB = triton.cdiv(C, BC)
    P, RP = tr.row_chunks(R, BT2, NCB)
    empty = tr.compute_empty(cdt, x.device)
    sums = empty(2, R)
    dx = torch.empty_like(x)
    dstate = empty(B, C)
    dw_p, db_p, dmix_p = empty(P, C), empty(P, C), empty(P, M, C)
    slots = _slots(dys, x)
    flags = x if starts is None else starts.contiguous()
    wrap_triton(_bwd_rows_kernel)[(triton.cdiv(R, BT),)](
        *slots, ds, x, weight, *_slots(mix, x), mean, rstd, sums, flags,
        R, T, C, M, ds_out is not None, starts is not None, BT, BC, DT, num_warps=WARPS,
    )  # fmt: skip
    wrap_triton(_bwd_kernel)[(P, NCB)](
        *slots, ds, add, x, weight, bias, *_slots(mix, x), state, mean, rstd, sums, flags,
        dx, dstate, dw_p, db_p, dmix_p,
        R, T, C, RP, M, ds_out is not None, dx_add is not None, starts is not None, BT2, BC, DT,
        num_warps=WARPS if M <= 6 else 2 * WARPS,
    )  # fmt: skip
    return dx, dw_p.sum(0), db_p.sum(0), dmix_p.sum(0), dstate


class _ShiftMixTriton(torch.autograd.Function):
    """Inputs (x, weight, bias, state, starts, eps, residual, *mix): mix one [M, C] tensor, or M tensors
    of C values each (the kernels take M pointers either way: no cat of the model's parameters)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, starts, eps, residual, *mix):
        B, T, C = x.shape
        index_offsets(B, T, C)
        cdt, _ = tr.compute_dtype(x.dtype)
        ins = [t.detach() for t in (x, weight, bias)]
        rows = mix_rows(mix)
        s0 = state.detach().to(cdt)
        ys, s_out, mean, rstd = torch.ops.rwkvx.shift_mix_triton_fwd(*ins, rows, s0, eps, starts)
        ctx.save_for_backward(*ins, s0, starts, mean, rstd, *rows)
        ctx.dtypes = (weight.dtype, bias.dtype, state.dtype)
        ctx.mix_like = [(m.shape, m.dtype) for m in mix]
        ctx.residual = residual
        return (*ys, s_out, *((x,) if residual else ()))  # x as is: autograd views it

    @staticmethod
    def backward(ctx, *grads):
        x, weight, bias, s0, starts, mean, rstd, *rows = ctx.saved_tensors
        dres = grads[-1] if ctx.residual else None  # the residual stream's gradient: added into dx by the kernel
        *dys, ds_out = grads[:-1] if ctx.residual else grads
        kept = [i for i, g in enumerate(dys) if g is not None]  # the outputs a loss reached
        dx, dw, db, dmix_k, dstate = torch.ops.rwkvx.shift_mix_triton_bwd(
            [dys[i] for i in kept], ds_out, x, weight, bias, [rows[i] for i in kept], s0, mean, rstd, dres, starts
        )
        if len(kept) < len(dys):
            dmix = dmix_k.new_zeros(len(dys), dmix_k.shape[1])
            dmix[kept] = dmix_k
        else:
            dmix = dmix_k
        wdt, bdt, sdt = ctx.dtypes
        dmixes = mix_grads(dmix, ctx.mix_like)
        return dx, dw.to(wdt).view_as(weight), db.to(bdt).view_as(bias), dstate.to(sdt), None, None, None, *dmixes


def shift_mix_triton(x, weight, bias, mix, state, *, eps: float = 1e-5, residual: bool = False, starts=None):
    mixes = (mix,) if isinstance(mix, torch.Tensor) else tuple(mix)
    outs = _ShiftMixTriton.apply(x, weight, bias, state, starts, eps, residual, *mixes)
    if residual:
        *ys, s_out, x_out = outs
        return tuple(ys), s_out, x_out
    *ys, s_out = outs
    return tuple(ys), s_out
