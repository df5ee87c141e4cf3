"""WKV4 `triton` backend: fused recurrent Triton kernels, forward and backward.

Each program owns a block of BC channels of one batch row (channels are
independent) and walks the sequence with the stabilised state (aa, bb, pp) in
fp32 registers (fp64 for fp64 inputs); see reference.py for the step and
csrc/wkv4_cpu.cpp for the backward's formulas (the
state gradients (ga, gb, gp) carried with D = gp - ga aa - gb bb). The forward saves the state
every CHUNK steps; the backward recomputes each chunk's states into a scratch
buffer and runs the reverse scan. dw and du are written per batch row and
summed by torch. With document starts (HAS_STARTS, one byte per batch row and
step) every kernel sets the state to the fresh one before a start's step, and
the backward zeroes the state gradients there (docs/operators.md#document-starts).

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (how the test suite
checks it). Inputs fp32 or bf16; state and accumulation fp32.

The two launches are torch ops, `torch.ops.rwkvx.wkv4_triton_fwd` and
`torch.ops.rwkvx.wkv4_triton_bwd` (docs/operators.md#the-triton-kernels-as-torch-ops), so
torch.compile traces the autograd.Function around them with no graph break.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)

if triton is not None:

    @triton.jit
    def _fresh(starts, i, ok):
        """Whether step i (an offset into bool `starts`, read where the scalar ok) starts a document."""
        return tl.load(starts + i, mask=ok, other=0).to(tl.int1)

    @triton.jit
    def _reset(a, b, p, fresh):
        """The state, or the fresh state (0, 0, -1e38) where a document starts."""
        return tl.where(fresh, 0.0, a), tl.where(fresh, 0.0, b), tl.where(fresh, -1e38, p)

    @triton.jit
    def _update(a, b, p, wv, kt, vt):
        """One step of the state: pp' = max(pp + w, k); also returns s = [pp + w >= k], f1, f2, err.
        Exponents are differences first, (pp - k) + w, exact for close large pp and k."""
        d = (p - kt) + wv
        s = d >= 0
        f = tl.exp(-tl.abs(d))
        f1 = tl.where(s, 1.0, f)
        f2 = tl.where(s, f, 1.0)
        # err = (pp + w) - fl(pp + w) exactly (TwoSum), folded into aa and bb (see csrc/wkv4_cpu.cpp)
        sm = p + wv
        bp = sm - p
        err = tl.where(s, (p - (sm - bp)) + (wv - bp), 0.0)
        a_new = f1 * a + f2 * vt
        b_new = f1 * b + f2
        return a_new + a_new * err, b_new + b_new * err, tl.where(s, sm, kt), s, f1, f2, err

    @triton.jit
    def _output(a, b, p, uv, kt, vt):
        """y_t from the state before step t, with e1, e2 and 1 / den for the backward."""
        d = (p - kt) - uv
        e = tl.exp(-tl.abs(d))
        s2 = d >= 0
        e1 = tl.where(s2, 1.0, e)
        e2 = tl.where(s2, e, 1.0)
        inv = 1.0 / (e1 * b + e2)
        return (e1 * a + e2 * vt) * inv, e1, e2, inv

    @triton.jit
    def _fwd_kernel(
        w, u, k, v, aa0, bb0, pp0, starts,
        y, aaT, bbT, ppT, snaps,
        T, C,
        BC: tl.constexpr, CHUNK: tl.constexpr, NC, HAS_STARTS: tl.constexpr, DT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)  # i64: (b * T + t) * C passes 2^31 at production sizes
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        mc = cols < C
        wv = tl.load(w + cols, mask=mc, other=0.0).to(DT)
        uv = tl.load(u + cols, mask=mc, other=0.0).to(DT)
        a = tl.load(aa0 + b * C + cols, mask=mc, other=0.0).to(DT)
        bs = tl.load(bb0 + b * C + cols, mask=mc, other=0.0).to(DT)
        p = tl.load(pp0 + b * C + cols, mask=mc, other=0.0).to(DT)
        for t in range(T):
            if HAS_STARTS:  # before the snapshot: the backward's recomputation starts there
                a, bs, p = _reset(a, bs, p, _fresh(starts, b * T + t, t < T))
            if t % CHUNK == 0:
                snap = snaps + (b * NC + t // CHUNK) * 3 * C + cols
                tl.store(snap, a, mask=mc)
                tl.store(snap + C, bs, mask=mc)
                tl.store(snap + 2 * C, p, mask=mc)
            base = (b * T + t) * C + cols
            kt = tl.load(k + base, mask=mc, other=0.0).to(DT)
            vt = tl.load(v + base, mask=mc, other=0.0).to(DT)
            yt, _, _, _ = _output(a, bs, p, uv, kt, vt)
            tl.store(y + base, yt.to(y.dtype.element_ty), mask=mc)
            a, bs, p, _, _, _, _ = _update(a, bs, p, wv, kt, vt)
        tl.store(aaT + b * C + cols, a, mask=mc)
        tl.store(bbT + b * C + cols, bs, mask=mc)
        tl.store(ppT + b * C + cols, p, mask=mc)

    @triton.jit
    def _bwd_kernel(
        w, u, k, v, aaT, bbT, snaps, starts, dy, daaT, dbbT, dppT,
        scratch,
        dk, dv, daa0, dbb0, dpp0, dw_rows, du_rows,
        T, C,
        BC: tl.constexpr, CHUNK: tl.constexpr, NC, HAS_STARTS: tl.constexpr, DT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)  # i64: (b * T + t) * C passes 2^31 at production sizes
        ic = tl.program_id(1)
        lane = tl.arange(0, BC)
        cols = ic * BC + lane
        mc = cols < C
        wv = tl.load(w + cols, mask=mc, other=0.0).to(DT)
        uv = tl.load(u + cols, mask=mc, other=0.0).to(DT)
        st = b * C + cols
        ga = tl.load(daaT + st, mask=mc, other=0.0).to(DT)
        gb = tl.load(dbbT + st, mask=mc, other=0.0).to(DT)
        gp = tl.load(dppT + st, mask=mc, other=0.0).to(DT)
        # D = gp - ga aa - gb bb: the part of pp's gradient the gauge identity does not give
        D = gp - ga * tl.load(aaT + st, mask=mc, other=0.0) - gb * tl.load(bbT + st, mask=mc, other=0.0)
        gw = tl.zeros([BC], dtype=DT)
        gu = tl.zeros([BC], dtype=DT)
        scr = scratch + (b * tl.num_programs(1) + ic) * CHUNK * 3 * BC + lane  # [CHUNK, 3, BC]
        for cc in range(NC):
            c = NC - 1 - cc
            t0 = c * CHUNK
            snap = snaps + (b * NC + c) * 3 * C + cols
            a = tl.load(snap, mask=mc, other=0.0)
            bs = tl.load(snap + C, mask=mc, other=0.0)
            p = tl.load(snap + 2 * C, mask=mc, other=0.0)
            for i in range(CHUNK):  # recompute the chunk's states before each step
                ok = mc & ((cols * 0 + t0 + i) < T)  # the last chunk may be partial
                base = (b * T + t0 + i) * C + cols
                if HAS_STARTS:
                    a, bs, p = _reset(a, bs, p, _fresh(starts, b * T + t0 + i, t0 + i < T))
                tl.store(scr + i * 3 * BC, a)
                tl.store(scr + i * 3 * BC + BC, bs)
                tl.store(scr + i * 3 * BC + 2 * BC, p)
                kt = tl.load(k + base, mask=ok, other=0.0).to(DT)
                vt = tl.load(v + base, mask=ok, other=0.0).to(DT)
                a, bs, p, _, _, _, _ = _update(a, bs, p, wv, kt, vt)
            for j in range(CHUNK):  # the reverse scan
                i = CHUNK - 1 - j
                ok = mc & ((cols * 0 + t0 + i) < T)
                base = (b * T + t0 + i) * C + cols
                at = tl.load(scr + i * 3 * BC)
                bt = tl.load(scr + i * 3 * BC + BC)
                pt = tl.load(scr + i * 3 * BC + 2 * BC)
                kt = tl.load(k + base, mask=ok, other=0.0).to(DT)
                vt = tl.load(v + base, mask=ok, other=0.0).to(DT)
                dyt = tl.load(dy + base, mask=ok, other=0.0).to(DT)
                _, _, _, s, f1, f2, err = _update(at, bt, pt, wv, kt, vt)
                nw = f2 * (ga * vt + gb)
                nw = nw + nw * err
                gp_upd = tl.where(s, gp - nw, f1 * (ga * at + gb * bt))
                gw = gw + tl.where(ok, gp_upd, 0.0)
                gk = tl.where(s, nw, nw + D)
                gv = f2 * ga
                gv = gv + gv * err
                D = tl.where(ok, tl.where(s, D, 0.0), D)
                ga_u = ga * f1
                gb_u = gb * f1
                yt, e1, e2, inv = _output(at, bt, pt, uv, kt, vt)
                g = dyt * inv
                ga = tl.where(ok, ga_u + ga_u * err + g * e1, ga)
                gb = tl.where(ok, gb_u + gb_u * err - g * e1 * yt, gb)
                gp = tl.where(ok, gp_upd + g * e1 * (at - yt * bt), gp)
                gy = g * e2 * (vt - yt)
                gu = gu + tl.where(ok, gy, 0.0)
                tl.store(dk + base, (gk + gy).to(dk.dtype.element_ty), mask=ok)
                tl.store(dv + base, (gv + g * e2).to(dv.dtype.element_ty), mask=ok)
                if HAS_STARTS:  # the state before a start is a constant: no gradient reaches past it
                    fresh = _fresh(starts, b * T + t0 + i, t0 + i < T)
                    ga, gb = tl.where(fresh, 0.0, ga), tl.where(fresh, 0.0, gb)
                    gp, D = tl.where(fresh, 0.0, gp), tl.where(fresh, 0.0, D)
        tl.store(daa0 + st, ga, mask=mc)
        tl.store(dbb0 + st, gb, mask=mc)
        tl.store(dpp0 + st, gp, mask=mc)
        tl.store(dw_rows + st, gw, mask=mc)
        tl.store(du_rows + st, gu, mask=mc)


def _block(C: int) -> int:
    return min(64, max(16, triton.next_power_of_2(C)))


def index_offsets(B: int, T: int, C: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index (int64 bases); refuses sizes they
    cannot index. C = H * N, the channels."""
    BC, NC = _block(C), triton.cdiv(T, tr.CHUNK)
    buffers = {
        "k, v, y": (B, T, C),
        "state snapshots": (B, NC, 3, C),
        "scratch": (B * triton.cdiv(C, BC), tr.CHUNK, 3, BC),
    }
    return tr.check_offsets("wkv4 triton", buffers, tile=tr.CHUNK * 3 * BC)


@triton_op("rwkvx::wkv4_triton_fwd")
def wkv4_triton_fwd(
    w: Tensor, u: Tensor, k: Tensor, v: Tensor, aa: Tensor, bb: Tensor, pp: Tensor, starts: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: w, u [H, N] (w the log decay), k, v [B, T, H, N], all in one dtype,
    the state aa, bb, pp [B, H, N] in the compute dtype, starts bool [B, T] or None. Returns (y
    in the inputs' dtype, aa, bb, pp at the end, snapshots [B, NC, 3, H * N])."""
    B, T, H, N = k.shape
    C = H * N
    w, u, k, v, aa, bb, pp = (x.contiguous() for x in (w, u, k, v, aa, bb, pp))
    _, DT = tr.compute_dtype(k.dtype)
    BC, NC = _block(C), triton.cdiv(T, tr.CHUNK)
    y = torch.empty_like(k)
    s_out = [torch.empty_like(aa) for _ in range(3)]
    snaps = aa.new_empty(B, NC, 3, C)
    flags = k if starts is None else starts.contiguous()
    wrap_triton(_fwd_kernel)[(B, triton.cdiv(C, BC))](
        w, u, k, v, aa, bb, pp, flags, y, *s_out, snaps, T, C, BC, tr.CHUNK, NC, starts is not None, DT
    )
    return (y, *s_out, snaps)


@triton_op("rwkvx::wkv4_triton_bwd")
def wkv4_triton_bwd(
    w: Tensor,
    u: Tensor,
    k: Tensor,
    v: Tensor,
    aaT: Tensor,
    bbT: Tensor,
    snaps: Tensor,
    dy: Tensor,
    daa: Tensor,
    dbb: Tensor,
    dpp: Tensor,
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs, its final aa, bb and snapshots, the
    cotangents of y and of the final state in the compute dtype, and the forward's starts.
    Returns (dw, du, dk, dv, daa, dbb, dpp) in the compute dtype (dw, du summed over the batch
    rows)."""
    B, T, H, N = k.shape
    C = H * N
    w, u, k, v, aaT, bbT, snaps, dy, daa, dbb, dpp = (
        x.contiguous() for x in (w, u, k, v, aaT, bbT, snaps, dy, daa, dbb, dpp)
    )
    cdt, DT = tr.compute_dtype(k.dtype)
    BC, NC = _block(C), triton.cdiv(T, tr.CHUNK)
    grid = (B, triton.cdiv(C, BC))
    empty = tr.compute_empty(cdt, k.device)
    scratch = empty(B * grid[1] * tr.CHUNK * 3 * BC)
    dk, dv = empty(B, T, H, N), empty(B, T, H, N)
    ds0 = [empty(B, H, N) for _ in range(3)]
    dw_rows, du_rows = empty(B, H, N), empty(B, H, N)
    flags = k if starts is None else starts.contiguous()
    wrap_triton(_bwd_kernel)[grid](
        w, u, k, v, aaT, bbT, snaps, flags, dy, daa, dbb, dpp, scratch, dk, dv, *ds0, dw_rows, du_rows,
        T, C, BC, tr.CHUNK, NC, starts is not None, DT,
    )  # fmt: skip
    return (dw_rows.sum(0), du_rows.sum(0), dk, dv, *ds0)


class _WKV4Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, u, k, v, aa, bb, pp, starts):
        B, T, H, N = k.shape
        C = H * N
        index_offsets(B, T, C)  # before any copy or allocation
        ins, s0, _, _ = tr.prepare((w, u, k, v), (aa, bb, pp), k.dtype)
        y, aaT, bbT, ppT, snaps = torch.ops.rwkvx.wkv4_triton_fwd(*ins, *s0, starts)
        ctx.save_for_backward(*ins, aaT, bbT, snaps, starts)
        ctx.dtypes = (w.dtype, u.dtype, k.dtype, v.dtype, aa.dtype, bb.dtype, pp.dtype)
        return y, aaT, bbT, ppT

    @staticmethod
    def backward(ctx, dy, daa, dbb, dpp):
        w, u, k, v, aaT, bbT, snaps, starts = ctx.saved_tensors
        (dy,), dstate, _, _ = tr.prepare((dy,), (daa, dbb, dpp), k.dtype)
        grads = torch.ops.rwkvx.wkv4_triton_bwd(w, u, k, v, aaT, bbT, snaps, dy, *dstate, starts)
        return (*tr.cast_back(grads, ctx.dtypes), None)


def wkv4_triton(w, u, k, v, state, *, starts=None):
    """starts: bool [B, T] or None (docs/operators.md#document-starts)."""
    y, aa, bb, pp = _WKV4Triton.apply(w, u, k, v, *state, starts)
    return y, (aa, bb, pp)
