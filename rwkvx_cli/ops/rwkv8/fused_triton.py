"""rwkv8 `triton` backend: fused recurrent Triton kernels, forward and backward.

Each program owns a tile of one (batch, head) state ρ [L, E]: a block of BR <= 32 latent
rows by a block of BV <= 32 value columns, in fp32 registers (fp64 for fp64 inputs), plus
the rows' norm n, and walks the sequence: every element of ρ evolves independently
of the others, so the tile's register use depends on BR x BV only, not on the value
width E (with the shared value head E is the model width, 768..4096 and more). What
is computed over latents only (q̃'s normaliser Σ_l q + eps) is computed once by torch
and read by every program; n (per row, O(BR) work) is recomputed by each value block.
What needs every row or every column is summed by torch afterwards from per-block
partials: the output y and dv (Σ over row blocks), dq, Σ_l dz_l z_l, dd and the
initial norm's gradient (Σ over value blocks, and for Σ dz z over row blocks too).
The norm's gradient dn obeys a recurrence driven by r = Σ_e ρ dy, a sum over all
columns; it is linear, so each value block runs it on its own part of r (the final
norm's gradient entering at value block 0) and the parts add up.

The forward saves the state every CHUNK steps; the backward recomputes each chunk's
states into a scratch buffer and runs the reverse scan (formulas in
csrc/rwkv8_cpu.cpp). Memory the fused backward keeps per layer: the snapshots,
B·H·⌈T/16⌉·L·(E + 1) fp32 values, i.e. H·L·(E + 1)/16 per token (4 bytes each;
with the shared value head E = C the model width: at H·L = 4096 latents and
C = 4096, 4 MiB per token and layer), plus the saved inputs q, v, d.

Document starts (bool [B, T], the HAS_STARTS variant of each kernel): where a document starts,
the forward zeroes the tile's state before the step (and before its snapshot), the backward's
recomputation does the same, and its reverse scan zeroes dρ and dn after the step, so no
gradient crosses the start. The forward reads one flag per step; the backward reads a chunk's
flags at once, as the bits of one integer (a flag load inside the recomputation loop spilled on
sm_90).

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (how the test suite
checks it). Inputs fp32 or bf16; state and accumulation fp32.

The two launches, with the sums of their partials, are torch ops,
`torch.ops.rwkvx.rwkv8_triton_fwd` and `torch.ops.rwkvx.rwkv8_triton_bwd`
(docs/operators.md#the-triton-kernels-as-torch-ops), so torch.compile traces the
autograd.Function around them with no graph break.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)
from rwkvx_cli.ops.rwkv8.reference import EPS

if triton is not None:
    _EPS = tl.constexpr(EPS)  # jit code reads a module global only as a constexpr

    @triton.jit
    def _step_inputs(q, v, s, t, T, bi, h, H, Hv, L, E, rows, cols, DT: tl.constexpr):
        """Step t's q over this tile's rows, Σ_l q + eps (precomputed), and v over its columns;
        zeros for t >= T (the last chunk may be partial: vector masks)."""
        qbase = ((bi * T + t) * H + h) * L
        qr = tl.load(q + qbase + rows, mask=(rows < L) & ((rows * 0 + t) < T), other=0.0).to(DT)
        vh = tl.where(Hv > 1, h, 0)
        vt = tl.load(v + ((bi * T + t) * Hv + vh) * E + cols, mask=(cols < E) & ((cols * 0 + t) < T), other=0.0)
        vt = vt.to(DT)
        st = tl.load(s + (bi * T + tl.minimum(t, T - 1)) * H + h).to(DT)  # past T: qr = 0, any s > 0 will do
        return qr, st, vt

    @triton.jit
    def _zero_at(start, a, b):
        """a and b, or zeros where `start` (a document starts: the state before it is zero)."""
        return tl.where(start, 0.0, a), tl.where(start, 0.0, b)

    @triton.jit
    def _chunk_starts(starts, bi, T, t0, CHUNK: tl.constexpr, HAS_STARTS: tl.constexpr):
        """Which steps t0 + i (i < CHUNK) of batch row bi start a document, as the bits i of an int32
        (none past T, none without starts): one load per chunk for the backward's two scans."""
        if HAS_STARTS:
            i = tl.arange(0, CHUNK)
            flags = tl.load(starts + bi * T + t0 + i, mask=t0 + i < T, other=0).to(tl.int32)
            return tl.sum(flags << i, axis=0)
        return t0 * 0

    @triton.jit
    def _fwd_kernel(
        q, v, d, s, rho0, n0,
        y_p, rhoT, nT, snaps, nsnaps,
        T, H, Hv, L, E, PSTRIDE,
        BR: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, NC, DT: tl.constexpr,
        starts=None, HAS_STARTS: tl.constexpr = False,  # document starts, bool [B, T] (default: none)
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)  # i64: the base offsets (bh * NC * L * E, ...) pass 2^31 at production sizes
        ir = tl.program_id(1)
        ic = tl.program_id(2)
        bi = bh // H
        h = bh % H
        rows = ir * BR + tl.arange(0, BR)
        cols = ic * BV + tl.arange(0, BV)
        mr = rows < L
        mn = mr & ((rows * 0 + ic) == 0)  # the norm (the same in every value block) is stored by block 0
        m2 = mr[:, None] & (cols < E)[None, :]
        off2 = rows[:, None] * E + cols[None, :]
        R = tl.load(rho0 + bh * L * E + off2, mask=m2, other=0.0).to(DT)
        n = tl.load(n0 + bh * L + rows, mask=mr, other=0.0).to(DT)
        dr = tl.load(d + h * L + rows, mask=mr, other=0.0).to(DT)
        for t in range(T):
            if HAS_STARTS:
                R, n = _zero_at(tl.load(starts + bi * T + t).to(tl.int1), R, n)
            if t % CHUNK == 0:
                c = bh * NC + t // CHUNK
                tl.store(snaps + c * L * E + off2, R, mask=m2)
                tl.store(nsnaps + c * L + rows, n, mask=mn)
            qr, st, vt = _step_inputs(q, v, s, t, T, bi, h, H, Hv, L, E, rows, cols, DT)
            z = qr / (st * (n + _EPS))
            y_part = tl.sum(z[:, None] * R, axis=0)
            tl.store(y_p + ir.to(tl.int64) * PSTRIDE + ((bi * T + t) * H + h) * E + cols, y_part, mask=cols < E)
            R = dr[:, None] * R + qr[:, None] * vt[None, :]
            n = dr * n + qr
        tl.store(rhoT + bh * L * E + off2, R, mask=m2)
        tl.store(nT + bh * L + rows, n, mask=mn)

    @triton.jit
    def _bwd_kernel(
        q, v, d, s, snaps, nsnaps, dy, drhoT, dnT,
        scratch, nscratch,
        dq_p, zdz_p, dv_p, dd_p, drho0, dn0_p,
        T, H, Hv, L, E, PSTRIDE, QSTRIDE, LSTRIDE, SSTRIDE,
        BR: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, NC, DT: tl.constexpr,
        starts=None, HAS_STARTS: tl.constexpr = False,  # document starts, bool [B, T] (default: none)
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)  # i64: the base offsets (bh * NC * L * E, ...) pass 2^31 at production sizes
        ir = tl.program_id(1)
        ic = tl.program_id(2)
        bi = bh // H
        h = bh % H
        lrow = tl.arange(0, BR)
        lcol = tl.arange(0, BV)
        rows = ir * BR + lrow
        cols = ic * BV + lcol
        mr = rows < L
        me = cols < E
        m2 = mr[:, None] & me[None, :]
        off2 = rows[:, None] * E + cols[None, :]
        prog = (bh * tl.num_programs(1) + ir) * tl.num_programs(2) + ic
        scr = scratch + prog * CHUNK * BR * BV  # [CHUNK, BR, BV]
        nscr = nscratch + prog * CHUNK * BR
        loc2 = lrow[:, None] * BV + lcol[None, :]
        icl = ic.to(tl.int64)
        dr = tl.load(d + h * L + rows, mask=mr, other=0.0).to(DT)
        dR = tl.load(drhoT + bh * L * E + off2, mask=m2, other=0.0).to(DT)
        # dn is linear in r = Σ_e ρ dy: each value block carries its columns' part, block 0 the final dn
        dn = tl.load(dnT + bh * L + rows, mask=mr & ((rows * 0 + ic) == 0), other=0.0).to(DT)
        dd = tl.zeros([BR], dtype=DT)
        for cc in range(NC):
            c = NC - 1 - cc
            t0 = c * CHUNK
            R = tl.load(snaps + (bh * NC + c) * L * E + off2, mask=m2, other=0.0)
            n = tl.load(nsnaps + (bh * NC + c) * L + rows, mask=mr, other=0.0)
            bits = _chunk_starts(starts, bi, T, t0, CHUNK, HAS_STARTS)
            for i in range(CHUNK):  # recompute the chunk's states before each step
                if HAS_STARTS:
                    R, n = _zero_at(((bits >> i) & 1) != 0, R, n)
                tl.store(scr + i * BR * BV + loc2, R)
                tl.store(nscr + i * BR + lrow, n)
                qr, st, vt = _step_inputs(q, v, s, t0 + i, T, bi, h, H, Hv, L, E, rows, cols, DT)
                R = dr[:, None] * R + qr[:, None] * vt[None, :]
                n = dr * n + qr
            for j in range(CHUNK):  # the reverse scan
                i = CHUNK - 1 - j
                t = t0 + i
                okr = mr & ((rows * 0 + t) < T)  # vector masks: the last chunk may be partial
                okc = me & ((cols * 0 + t) < T)
                Rp = tl.load(scr + i * BR * BV + loc2)
                np_ = tl.load(nscr + i * BR + lrow)
                qr, st, vt = _step_inputs(q, v, s, t, T, bi, h, H, Hv, L, E, rows, cols, DT)
                base = (bi * T + t) * H + h
                dyt = tl.load(dy + base * E + cols, mask=okc, other=0.0).to(DT)
                im = 1.0 / (np_ + _EPS)
                z = qr * im / st
                a = tl.sum(dR * vt[None, :], axis=1)
                g = tl.sum(dR * Rp, axis=1)
                r = tl.sum(Rp * dyt[None, :], axis=1)
                tl.store(dv_p + ir.to(tl.int64) * PSTRIDE + base * E + cols, tl.sum(qr[:, None] * dR, axis=0), mask=okc)
                tl.store(dq_p + icl * LSTRIDE + base * L + rows, a + dn + r * im / st, mask=okr)
                tl.store(  # the tile's scalar Σ dz z, stored by lane 0
                    zdz_p + (ir * tl.num_programs(2) + icl) * QSTRIDE + base + lrow,
                    tl.sum(tl.where(okr, r * z, 0.0), axis=0) + lrow * 0.0,
                    mask=(lrow == 0) & okr,
                )
                dd = dd + tl.where(okr, g + dn * np_, 0.0)
                dR = tl.where(okr[:, None], dr[:, None] * dR + z[:, None] * dyt[None, :], dR)
                dn = tl.where(okr, dr * dn - r * z * im, dn)
                if HAS_STARTS:  # no gradient crosses a start
                    dR, dn = _zero_at(((bits >> i) & 1) != 0, dR, dn)
        tl.store(drho0 + bh * L * E + off2, dR, mask=m2)
        tl.store(dn0_p + icl * SSTRIDE + bh * L + rows, dn, mask=mr)
        tl.store(dd_p + icl * SSTRIDE + bh * L + rows, dd, mask=mr)


def _blocks(L: int, E: int) -> tuple[int, int, int, int]:
    """BR (latent rows per program, <= 32), BV (value columns per program, a power of two
    <= 32: at 64 the backward spills ~1.5 KB per thread), NR and NV (the row and value blocks)."""
    BR = min(triton.next_power_of_2(L), 32)
    BV = min(triton.next_power_of_2(E), 32)
    return BR, BV, triton.cdiv(L, BR), triton.cdiv(E, BV)


def index_offsets(B: int, T: int, H: int, L: int, E: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index (int64 bases); refuses sizes they
    cannot index. E is the value width: the model width with the shared value head."""
    BR, BV, NR, NV = _blocks(L, E)
    NC = triton.cdiv(T, tr.CHUNK)
    buffers = {
        "q": (B, T, H, L),
        "state snapshots": (B, H, NC, L, E),
        "output partials": (NR, B, T, H, E),
        "dq partials": (NV, B, T, H, L),
        "scratch": (B * H * NR * NV, tr.CHUNK, BR, BV),
    }
    return tr.check_offsets("rwkv8 triton", buffers, tile=max(L * E, tr.CHUNK * BR * BV))


@triton_op("rwkvx::rwkv8_triton_fwd")
def rwkv8_triton_fwd(
    q: Tensor, v: Tensor, d: Tensor, s: Tensor, rho0: Tensor, n0: Tensor, starts: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: q [B, T, H, L], v [B, T, Hv, E], d [H, L] in one dtype, q̃'s
    normaliser s = Σ_l q + eps [B, T, H] and the state ρ [B, H, L, E], n [B, H, L] in the
    compute dtype; starts bool [B, T] (None: no document starts). Returns (y [B, T, H, E] in
    the compute dtype, ρ and n at the end, snapshots of ρ [B, H, NC, L, E] and of n [B, H, NC, L])."""
    B, T, H, L = q.shape
    Hv, E = v.shape[2], v.shape[3]
    q, v, d, s, rho0, n0 = (x.contiguous() for x in (q, v, d, s, rho0, n0))
    starts = None if starts is None else starts.contiguous()
    cdt, DT = tr.compute_dtype(q.dtype)
    BR, BV, NR, NV = _blocks(L, E)
    NC = triton.cdiv(T, tr.CHUNK)
    y_p = tr.compute_empty(cdt, q.device)(NR, B, T, H, E)
    rho_out, norm_out = torch.empty_like(rho0), torch.empty_like(n0)
    snaps = rho0.new_empty(B, H, NC, L, E)
    nsnaps = rho0.new_empty(B, H, NC, L)
    wrap_triton(_fwd_kernel)[(B * H, NR, NV)](
        q, v, d, s, rho0, n0, y_p, rho_out, norm_out, snaps, nsnaps,
        T, H, Hv, L, E, B * T * H * E, BR, BV, tr.CHUNK, NC, DT, starts, starts is not None,
    )  # fmt: skip
    return y_p.sum(0), rho_out, norm_out, snaps, nsnaps


@triton_op("rwkvx::rwkv8_triton_bwd")
def rwkv8_triton_bwd(
    q: Tensor,
    v: Tensor,
    d: Tensor,
    s: Tensor,
    snaps: Tensor,
    nsnaps: Tensor,
    dy: Tensor,
    drho: Tensor,
    dnorm: Tensor,
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs, normaliser and snapshots, the cotangents of
    y, ρ and n in the compute dtype, and the forward's starts. Returns (dq, dv, dd, dρ, dn) in
    the compute dtype, each summed over the program blocks' partials (dv over the heads too with
    the shared value head, Hv = 1)."""
    B, T, H, L = q.shape
    Hv, E = v.shape[2], v.shape[3]
    q, v, d, s, snaps, nsnaps, dy, drho, dnorm = (x.contiguous() for x in (q, v, d, s, snaps, nsnaps, dy, drho, dnorm))
    starts = None if starts is None else starts.contiguous()
    cdt, DT = tr.compute_dtype(q.dtype)
    BR, BV, NR, NV = _blocks(L, E)
    NC = triton.cdiv(T, tr.CHUNK)
    empty = tr.compute_empty(cdt, q.device)
    scratch = empty(B * H * NR * NV * tr.CHUNK * BR * BV)
    nscratch = empty(B * H * NR * NV * tr.CHUNK * BR)
    dq_p = empty(NV, B, T, H, L)
    zdz_p = empty(NR * NV, B, T, H)
    dv_p = empty(NR, B, T, H, E)
    dd_p, dnorm0_p = empty(NV, B, H, L), empty(NV, B, H, L)
    drho0 = empty(B, H, L, E)
    wrap_triton(_bwd_kernel)[(B * H, NR, NV)](
        q, v, d, s, snaps, nsnaps, dy, drho, dnorm, scratch, nscratch, dq_p, zdz_p, dv_p, dd_p, drho0, dnorm0_p,
        T, H, Hv, L, E, B * T * H * E, B * T * H, B * T * H * L, B * H * L, BR, BV, tr.CHUNK, NC, DT,
        starts, starts is not None,
    )  # fmt: skip
    dq = dq_p.sum(0) - (zdz_p.sum(0) / s)[..., None]
    dv = dv_p.sum(0)
    if Hv == 1:
        dv = dv.sum(2, keepdim=True)
    return dq, dv, dd_p.sum((0, 1)), drho0, dnorm0_p.sum(0)


class _RWKV8Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, v, d, rho, norm, starts):
        B, T, H, L = q.shape
        index_offsets(B, T, H, L, v.shape[3])  # before any copy or allocation
        ins, s0, cdt, _ = tr.prepare((q, v, d), (rho, norm), q.dtype)
        s = ins[0].to(cdt).sum(-1) + EPS  # [B, T, H]: q̃'s normaliser, shared by every tile
        y, rho_out, norm_out, snaps, nsnaps = torch.ops.rwkvx.rwkv8_triton_fwd(*ins, s, *s0, starts)
        ctx.save_for_backward(*ins, s, snaps, nsnaps, starts)
        ctx.dtypes = (q.dtype, v.dtype, d.dtype, rho.dtype, norm.dtype)
        return y.to(q.dtype), rho_out, norm_out

    @staticmethod
    def backward(ctx, dy, drho, dnorm):
        q, v, d, s, snaps, nsnaps, starts = ctx.saved_tensors
        (dy,), (drho, dnorm), _, _ = tr.prepare((dy,), (drho, dnorm), q.dtype)
        grads = torch.ops.rwkvx.rwkv8_triton_bwd(q, v, d, s, snaps, nsnaps, dy, drho, dnorm, starts)
        return (*tr.cast_back(grads, ctx.dtypes), None)


def rwkv8_triton(q, v, d, state, *, starts=None):
    """starts: bool [B, T] or None (docs/operators.md#document-starts)."""
    y, rho, norm = _RWKV8Triton.apply(q, v, d, *state, starts)
    return y, (rho, norm)
