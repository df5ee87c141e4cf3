"""WKV7 `triton` backend: fused recurrent Triton kernels, forward and backward.

Each program owns a block of BV value rows of one (batch, head) state, kept in
fp32 registers (fp64 for fp64 inputs), and walks the sequence: a state row evolves independently of the
others (sa_i = S_i · a), so row blocks run in parallel. The forward saves a
state snapshot every CHUNK steps; the backward recomputes each chunk's states
into a scratch buffer and runs the reverse scan (formulas in recurrent.py). The
per-column gradients (dr, dk, db, dw, da) are sums over rows, written per row
block and summed by torch afterwards.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (how the test suite
checks it). Inputs fp32 or bf16; state and accumulation fp32. This is the
RWKV-LM-style design; the chunked (WY, tensor-core) form is chunked_triton.py.

The two launches are torch ops, `torch.ops.rwkvx.wkv7_triton_fwd` and
`torch.ops.rwkvx.wkv7_triton_bwd` (docs/operators.md#the-triton-kernels-as-torch-ops), so
torch.compile traces the autograd.Function around them with no graph break.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)

if triton is not None:

    @triton.jit
    def _step_inputs(r, w, k, v, a, b, base, cols, rows, mc, mr, DT: tl.constexpr):
        """One step's r, decay = exp(w), k, a, b over the key columns, and v over this block's rows."""
        rt = tl.load(r + base + cols, mask=mc, other=0.0).to(DT)
        wt = tl.exp(tl.load(w + base + cols, mask=mc, other=0.0).to(DT))
        kt = tl.load(k + base + cols, mask=mc, other=0.0).to(DT)
        at = tl.load(a + base + cols, mask=mc, other=0.0).to(DT)
        bt = tl.load(b + base + cols, mask=mc, other=0.0).to(DT)
        vt = tl.load(v + base + rows, mask=mr, other=0.0).to(DT)
        return rt, wt, kt, at, bt, vt

    @triton.jit
    def _fwd_kernel(
        r, w, k, v, a, b, s0,
        y, s_out, snaps,
        T, H,
        N: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, NC, DT: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)  # i64: the base offsets (bh * NC * N * N, ...) pass 2^31 at production sizes
        iv = tl.program_id(1)
        bi = bh // H
        h = bh % H
        rows = iv * BV + tl.arange(0, BV)
        cols = tl.arange(0, BK)
        mr = rows < N
        mc = cols < N
        m2 = mr[:, None] & mc[None, :]
        off2 = rows[:, None] * N + cols[None, :]
        S = tl.load(s0 + bh * N * N + off2, mask=m2, other=0.0).to(DT)
        for t in range(T):
            if t % CHUNK == 0:
                tl.store(snaps + (bh * NC + t // CHUNK) * N * N + off2, S, mask=m2)
            base = ((bi * T + t) * H + h) * N
            rt, wt, kt, at, bt, vt = _step_inputs(r, w, k, v, a, b, base, cols, rows, mc, mr, DT)
            sa = tl.sum(S * at[None, :], axis=1)
            S = S * wt[None, :] + sa[:, None] * bt[None, :] + vt[:, None] * kt[None, :]
            yt = tl.sum(S * rt[None, :], axis=1)
            tl.store(y + base + rows, yt.to(y.dtype.element_ty), mask=mr)
        tl.store(s_out + bh * N * N + off2, S, mask=m2)

    @triton.jit
    def _bwd_kernel(
        r, w, k, v, a, b, snaps, dy, ds_out,
        scratch, scratch_sa,
        dv, ds0, dr_p, dw_p, dk_p, da_p, db_p,
        T, H, PSTRIDE,
        N: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, NC, NV, DT: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)  # i64: the base offsets (bh * NC * N * N, ...) pass 2^31 at production sizes
        iv = tl.program_id(1)
        bi = bh // H
        h = bh % H
        vrow = tl.arange(0, BV)
        rows = iv * BV + vrow
        cols = tl.arange(0, BK)
        mr = rows < N
        mc = cols < N
        m2 = mr[:, None] & mc[None, :]
        off2 = rows[:, None] * N + cols[None, :]
        # This program's scratch: the chunk's CHUNK states [BV, BK] and sa vectors [BV].
        scr = scratch + (bh * NV + iv) * CHUNK * BV * BK
        scr_sa = scratch_sa + (bh * NV + iv) * CHUNK * BV
        loc2 = vrow[:, None] * BK + cols[None, :]
        part = iv.to(tl.int64) * PSTRIDE  # this row block's slice of the column-sum partials [NV, B, T, H, N]
        dS = tl.load(ds_out + bh * N * N + off2, mask=m2, other=0.0).to(DT)
        for cc in range(NC):
            c = NC - 1 - cc
            t0 = c * CHUNK
            S = tl.load(snaps + (bh * NC + c) * N * N + off2, mask=m2, other=0.0)
            for i in range(CHUNK):  # recompute the chunk, keeping each S_{t-1} and sa_t
                t = t0 + i
                okc = (cols * 0 + t) < T  # vector masks: the last chunk may be partial
                okr = (rows * 0 + t) < T
                base = ((bi * T + t) * H + h) * N
                _, wt, kt, at, bt, vt = _step_inputs(r, w, k, v, a, b, base, cols, rows, mc & okc, mr & okr, DT)
                tl.store(scr + i * BV * BK + loc2, S)
                sa = tl.sum(S * at[None, :], axis=1)
                tl.store(scr_sa + i * BV + vrow, sa)
                S = S * wt[None, :] + sa[:, None] * bt[None, :] + vt[:, None] * kt[None, :]
            for j in range(CHUNK):  # the reverse scan over the chunk
                i = CHUNK - 1 - j
                t = t0 + i
                okc = (cols * 0 + t) < T  # vector masks: the last chunk may be partial
                okr = (rows * 0 + t) < T
                base = ((bi * T + t) * H + h) * N
                S_prev = tl.load(scr + i * BV * BK + loc2)
                sa = tl.load(scr_sa + i * BV + vrow)
                rt, wt, kt, at, bt, vt = _step_inputs(r, w, k, v, a, b, base, cols, rows, mc & okc, mr & okr, DT)
                dyt = tl.load(dy + base + rows, mask=mr & okr, other=0.0).to(DT)
                S_t = S_prev * wt[None, :] + sa[:, None] * bt[None, :] + vt[:, None] * kt[None, :]
                dS_t = dS + dyt[:, None] * rt[None, :]
                dsa = tl.sum(dS_t * bt[None, :], axis=1)
                tl.store(dv + base + rows, tl.sum(dS_t * kt[None, :], axis=1), mask=mr & okr)
                pc = part + base + cols
                tl.store(dr_p + pc, tl.sum(S_t * dyt[:, None], axis=0), mask=mc & okc)
                tl.store(dk_p + pc, tl.sum(dS_t * vt[:, None], axis=0), mask=mc & okc)
                tl.store(db_p + pc, tl.sum(dS_t * sa[:, None], axis=0), mask=mc & okc)
                tl.store(dw_p + pc, tl.sum(dS_t * S_prev, axis=0) * wt, mask=mc & okc)
                tl.store(da_p + pc, tl.sum(S_prev * dsa[:, None], axis=0), mask=mc & okc)
                dS = tl.where(okr[:, None], dS_t * wt[None, :] + dsa[:, None] * at[None, :], dS)
        tl.store(ds0 + bh * N * N + off2, dS, mask=m2)


def index_offsets(B: int, T: int, H: int, N: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index; refuses sizes they cannot index."""
    return tr.fused_state_offsets("wkv7 triton", B, T, H, N)


@triton_op("rwkvx::wkv7_triton_fwd")
def wkv7_triton_fwd(
    r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, s0: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernel: r..b [B, T, H, N] in one dtype (w the log decay), s0 [B, H, N, N] in
    the compute dtype. Returns (y in the inputs' dtype, state_out, snapshots [B, H, NC, N, N])."""
    B, T, H, N = r.shape
    r, w, k, v, a, b, s0 = (x.contiguous() for x in (r, w, k, v, a, b, s0))
    _, DT = tr.compute_dtype(r.dtype)
    BK, BV, NV = tr.state_blocks(N)
    NC = triton.cdiv(T, tr.CHUNK)
    y = torch.empty_like(r)
    s_out = torch.empty_like(s0)
    snaps = s0.new_empty(B, H, NC, N, N)
    wrap_triton(_fwd_kernel)[(B * H, NV)](r, w, k, v, a, b, s0, y, s_out, snaps, T, H, N, BK, BV, tr.CHUNK, NC, DT)
    return y, s_out, snaps


@triton_op("rwkvx::wkv7_triton_bwd")
def wkv7_triton_bwd(
    r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, snaps: Tensor, dy: Tensor, ds_out: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs and snapshots, the cotangents of y and
    state_out in the compute dtype. Returns (dr, dw, dk, dv, da, db, dstate), all in the
    compute dtype (the column gradients summed over the row blocks' partials)."""
    B, T, H, N = r.shape
    r, w, k, v, a, b, snaps, dy, ds_out = (x.contiguous() for x in (r, w, k, v, a, b, snaps, dy, ds_out))
    cdt, DT = tr.compute_dtype(r.dtype)
    BK, BV, NV = tr.state_blocks(N)
    NC = triton.cdiv(T, tr.CHUNK)
    empty = tr.compute_empty(cdt, dy.device)
    scratch = empty(B * H * NV * tr.CHUNK * BV * BK)
    scratch_sa = empty(B * H * NV * tr.CHUNK * BV)
    dv = empty(B, T, H, N)
    ds0 = empty(B, H, N, N)
    partials = [empty(NV, B, T, H, N) for _ in range(5)]  # dr, dw, dk, da, db
    wrap_triton(_bwd_kernel)[(B * H, NV)](
        r, w, k, v, a, b, snaps, dy, ds_out, scratch, scratch_sa, dv, ds0, *partials,
        T, H, B * T * H * N, N, BK, BV, tr.CHUNK, NC, NV, DT,
    )  # fmt: skip
    dr, dw, dk, da, db = (p.sum(0) for p in partials)
    return dr, dw, dk, dv, da, db, ds0


class _WKV7Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, w, k, v, a, b, state):
        B, T, H, N = r.shape
        index_offsets(B, T, H, N)  # before any copy or allocation
        ins, (s0,), _, _ = tr.prepare((r, w, k, v, a, b), (state,), r.dtype)
        y, s_out, snaps = torch.ops.rwkvx.wkv7_triton_fwd(*ins, s0)
        ctx.save_for_backward(*ins, snaps)
        ctx.state_dtype = state.dtype
        return y, s_out

    @staticmethod
    def backward(ctx, dy, ds_out):
        *ins, snaps = ctx.saved_tensors
        (dy,), (ds_out,), _, _ = tr.prepare((dy,), (ds_out,), ins[0].dtype)
        grads = torch.ops.rwkvx.wkv7_triton_bwd(*ins, snaps, dy, ds_out)
        dtype = ins[0].dtype
        return tr.cast_back(grads, (dtype,) * 6 + (ctx.state_dtype,))


def wkv7_triton(r, w, k, v, a, b, state):
    return _WKV7Triton.apply(r, w, k, v, a, b, state)
