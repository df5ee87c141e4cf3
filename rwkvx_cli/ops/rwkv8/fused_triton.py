"""rwkv8 `triton` backend: fused recurrent Triton kernels, forward and backward.

Each program owns a block of BR latent rows of one (batch, head) state ρ [L, E]
(all E columns) and its norm n, in fp32 registers (fp64 for fp64 inputs), and
walks the sequence: a row of ρ evolves independently of the others. What needs
every row is summed by torch afterwards from per-block partials: the output y
(Σ over rows), dv (Σ over rows) and, for dq, Σ_l dz_l z_l. The forward saves
the state every CHUNK steps; the backward recomputes each chunk's states into a
scratch buffer and runs the reverse scan (formulas in csrc/rwkv8_cpu.cpp).

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (how the test suite
checks it). Inputs fp32 or bf16; state and accumulation fp32.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._triton import CHUNK, cast_back, check_offsets, compute_empty, prepare, tl, triton, unavailable  # noqa: F401  (unavailable: re-exported)
from rwkvx_cli.ops.rwkv8.reference import EPS

if triton is not None:
    _EPS = tl.constexpr(EPS)  # jit code reads a module global only as a constexpr

    @triton.jit
    def _step_inputs(q, v, t, T, bi, h, H, Hv, L, E, rows, cols, all_rows, DT: tl.constexpr):
        """Step t's q over this block's rows, Σ_l q + eps over all rows, and v; zeros for t >= T
        (the last chunk may be partial: vector masks)."""
        qbase = ((bi * T + t) * H + h) * L
        q_all = tl.load(q + qbase + all_rows, mask=(all_rows < L) & ((all_rows * 0 + t) < T), other=0.0).to(DT)
        qr = tl.load(q + qbase + rows, mask=(rows < L) & ((rows * 0 + t) < T), other=0.0).to(DT)
        vh = tl.where(Hv > 1, h, 0)
        vt = tl.load(v + ((bi * T + t) * Hv + vh) * E + cols, mask=(cols < E) & ((cols * 0 + t) < T), other=0.0)
        vt = vt.to(DT)
        return qr, tl.sum(q_all, axis=0) + _EPS, vt

    @triton.jit
    def _fwd_kernel(
        q, v, d, rho0, n0,
        y_p, rhoT, nT, snaps, nsnaps,
        T, H, Hv, L, E, PSTRIDE,
        BR: tl.constexpr, BE: tl.constexpr, BL: tl.constexpr, CHUNK: tl.constexpr, NC, DT: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)  # i64: the base offsets (bh * NC * N * N, ...) pass 2^31 at production sizes
        ir = tl.program_id(1)
        bi = bh // H
        h = bh % H
        rows = ir * BR + tl.arange(0, BR)
        cols = tl.arange(0, BE)
        all_rows = tl.arange(0, BL)
        mr = rows < L
        m2 = mr[:, None] & (cols < E)[None, :]
        off2 = rows[:, None] * E + cols[None, :]
        R = tl.load(rho0 + bh * L * E + off2, mask=m2, other=0.0).to(DT)
        n = tl.load(n0 + bh * L + rows, mask=mr, other=0.0).to(DT)
        dr = tl.load(d + h * L + rows, mask=mr, other=0.0).to(DT)
        for t in range(T):
            if t % CHUNK == 0:
                c = bh * NC + t // CHUNK
                tl.store(snaps + c * L * E + off2, R, mask=m2)
                tl.store(nsnaps + c * L + rows, n, mask=mr)
            qr, s, vt = _step_inputs(q, v, t, T, bi, h, H, Hv, L, E, rows, cols, all_rows, DT)
            z = qr / (s * (n + _EPS))
            y_part = tl.sum(z[:, None] * R, axis=0)
            tl.store(y_p + ir.to(tl.int64) * PSTRIDE + ((bi * T + t) * H + h) * E + cols, y_part, mask=cols < E)
            R = dr[:, None] * R + qr[:, None] * vt[None, :]
            n = dr * n + qr
        tl.store(rhoT + bh * L * E + off2, R, mask=m2)
        tl.store(nT + bh * L + rows, n, mask=mr)

    @triton.jit
    def _bwd_kernel(
        q, v, d, snaps, nsnaps, dy, drhoT, dnT,
        scratch, nscratch,
        dq_p, zdz_p, dv_p, dd_rows, drho0, dn0,
        T, H, Hv, L, E, PSTRIDE, QSTRIDE,
        BR: tl.constexpr, BE: tl.constexpr, BL: tl.constexpr, CHUNK: tl.constexpr, NC, DT: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)  # i64: the base offsets (bh * NC * N * N, ...) pass 2^31 at production sizes
        ir = tl.program_id(1)
        bi = bh // H
        h = bh % H
        lrow = tl.arange(0, BR)
        rows = ir * BR + lrow
        cols = tl.arange(0, BE)
        all_rows = tl.arange(0, BL)
        mr = rows < L
        me = cols < E
        m2 = mr[:, None] & me[None, :]
        off2 = rows[:, None] * E + cols[None, :]
        scr = scratch + (bh * tl.num_programs(1) + ir) * CHUNK * BR * BE  # [CHUNK, BR, BE]
        nscr = nscratch + (bh * tl.num_programs(1) + ir) * CHUNK * BR
        loc2 = lrow[:, None] * BE + cols[None, :]
        dr = tl.load(d + h * L + rows, mask=mr, other=0.0).to(DT)
        dR = tl.load(drhoT + bh * L * E + off2, mask=m2, other=0.0).to(DT)
        dn = tl.load(dnT + bh * L + rows, mask=mr, other=0.0).to(DT)
        dd = tl.zeros([BR], dtype=DT)
        for cc in range(NC):
            c = NC - 1 - cc
            t0 = c * CHUNK
            R = tl.load(snaps + (bh * NC + c) * L * E + off2, mask=m2, other=0.0)
            n = tl.load(nsnaps + (bh * NC + c) * L + rows, mask=mr, other=0.0)
            for i in range(CHUNK):  # recompute the chunk's states before each step
                tl.store(scr + i * BR * BE + loc2, R)
                tl.store(nscr + i * BR + lrow, n)
                qr, s, vt = _step_inputs(q, v, t0 + i, T, bi, h, H, Hv, L, E, rows, cols, all_rows, DT)
                R = dr[:, None] * R + qr[:, None] * vt[None, :]
                n = dr * n + qr
            for j in range(CHUNK):  # the reverse scan
                i = CHUNK - 1 - j
                t = t0 + i
                okr = mr & ((rows * 0 + t) < T)  # vector masks: the last chunk may be partial
                okc = me & ((cols * 0 + t) < T)
                Rp = tl.load(scr + i * BR * BE + loc2)
                np_ = tl.load(nscr + i * BR + lrow)
                qr, s, vt = _step_inputs(q, v, t, T, bi, h, H, Hv, L, E, rows, cols, all_rows, DT)
                base = (bi * T + t) * H + h
                dyt = tl.load(dy + base * E + cols, mask=okc, other=0.0).to(DT)
                im = 1.0 / (np_ + _EPS)
                z = qr * im / s
                a = tl.sum(dR * vt[None, :], axis=1)
                g = tl.sum(dR * Rp, axis=1)
                r = tl.sum(Rp * dyt[None, :], axis=1)
                tl.store(dv_p + ir.to(tl.int64) * PSTRIDE + base * E + cols, tl.sum(qr[:, None] * dR, axis=0), mask=okc)
                tl.store(dq_p + base * L + rows, a + dn + r * im / s, mask=okr)
                tl.store(  # the block's scalar Σ dz z, stored by lane 0
                    zdz_p + ir.to(tl.int64) * QSTRIDE + base + lrow,
                    tl.sum(tl.where(okr, r * z, 0.0), axis=0) + lrow * 0.0,
                    mask=(lrow == 0) & okr,
                )
                dd = dd + tl.where(okr, g + dn * np_, 0.0)
                dR = tl.where(okr[:, None], dr[:, None] * dR + z[:, None] * dyt[None, :], dR)
                dn = tl.where(okr, dr * dn - r * z * im, dn)
        tl.store(drho0 + bh * L * E + off2, dR, mask=m2)
        tl.store(dn0 + bh * L + rows, dn, mask=mr)
        tl.store(dd_rows + bh * L + rows, dd, mask=mr)


def _blocks(L: int, E: int) -> tuple[int, int, int, int]:
    """BR (latent rows per program), BE (columns, a power of two >= E), BL (>= L), NR (row blocks)."""
    BL = triton.next_power_of_2(L)
    BR = min(BL, 32)
    return BR, triton.next_power_of_2(E), BL, triton.cdiv(L, BR)


def index_offsets(B: int, T: int, H: int, L: int, E: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index (int64 bases); refuses sizes they
    cannot index. E is the value width: the model width with the shared value head."""
    BR, BE, BL, NR = _blocks(L, E)
    NC = triton.cdiv(T, CHUNK)
    buffers = {
        "q": (B, T, H, L),
        "state snapshots": (B, H, NC, L, E),
        "output partials": (NR, B, T, H, E),
        "scratch": (B * H * NR, CHUNK, BR, BE),
    }
    return check_offsets("rwkv8 triton", buffers, tile=max(L * E, CHUNK * BR * BE))


class _RWKV8Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, v, d, rho, norm):
        B, T, H, L = q.shape
        Hv, E = v.shape[2], v.shape[3]
        index_offsets(B, T, H, L, E)  # before any copy or allocation
        ins, s0, cdt, DT = prepare((q, v, d), (rho, norm), q.dtype)
        BR, BE, BL, NR = _blocks(L, E)
        NC = triton.cdiv(T, CHUNK)
        y_p = compute_empty(cdt, q.device)(NR, B, T, H, E)
        rho_out, norm_out = torch.empty_like(s0[0]), torch.empty_like(s0[1])
        snaps = s0[0].new_empty(B, H, NC, L, E)
        nsnaps = s0[0].new_empty(B, H, NC, L)
        _fwd_kernel[(B * H, NR)](
            *ins, *s0, y_p, rho_out, norm_out, snaps, nsnaps,
            T, H, Hv, L, E, B * T * H * E, BR, BE, BL, CHUNK, NC, DT,
        )  # fmt: skip
        ctx.save_for_backward(*ins, snaps, nsnaps)
        ctx.dtypes = (q.dtype, v.dtype, d.dtype, rho.dtype, norm.dtype)
        return y_p.sum(0).to(q.dtype), rho_out, norm_out

    @staticmethod
    def backward(ctx, dy, drho, dnorm):
        q, v, d, snaps, nsnaps = ctx.saved_tensors
        B, T, H, L = q.shape
        Hv, E = v.shape[2], v.shape[3]
        (dy,), (drho, dnorm), cdt, DT = prepare((dy,), (drho, dnorm), q.dtype)
        BR, BE, BL, NR = _blocks(L, E)
        NC = triton.cdiv(T, CHUNK)
        empty = compute_empty(cdt, q.device)
        scratch = empty(B * H * NR * CHUNK * BR * BE)
        nscratch = empty(B * H * NR * CHUNK * BR)
        dq_local = empty(B, T, H, L)
        zdz_p = empty(NR, B, T, H)
        dv_p = empty(NR, B, T, H, E)
        dd_rows = empty(B, H, L)
        drho0, dnorm0 = empty(B, H, L, E), empty(B, H, L)
        _bwd_kernel[(B * H, NR)](
            q, v, d, snaps, nsnaps, dy, drho, dnorm, scratch, nscratch, dq_local, zdz_p, dv_p, dd_rows, drho0, dnorm0,
            T, H, Hv, L, E, B * T * H * E, B * T * H, BR, BE, BL, CHUNK, NC, DT,
        )  # fmt: skip
        s = q.to(cdt).sum(-1) + EPS  # [B, T, H]
        dq = dq_local - (zdz_p.sum(0) / s)[..., None]
        dv = dv_p.sum(0)
        if Hv == 1:
            dv = dv.sum(2, keepdim=True)
        return cast_back((dq, dv, dd_rows.sum(0), drho0, dnorm0), ctx.dtypes)


def rwkv8_triton(q, v, d, state):
    y, rho, norm = _RWKV8Triton.apply(q, v, d, *state)
    return y, (rho, norm)
