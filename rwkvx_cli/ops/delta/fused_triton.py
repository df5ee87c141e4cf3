"""Gated delta rule `triton` backend: fused recurrent Triton kernels, forward and backward.

Each column j of the [N_k, N_v] state evolves on its own (m_j = Σ_i A_i S_ij k_i
needs only column j), so a program owns a block of BV value columns of one
(batch, head) state, all N_k key rows, in fp32 registers (fp64 for fp64 inputs),
and walks the sequence:

    P = A ⊙ S ;  m = Pᵀ k ;  u = β (v - m) ;  S = P + k uᵀ ;  y = c Sᵀ q

The forward saves a state snapshot every CHUNK steps; the backward recomputes a
chunk's states (and w = v - m) into a scratch buffer from its snapshot and runs
the reverse scan (formulas in csrc/delta_cpu.cpp), never dividing by the gate.
The key-indexed gradients (dq, dk, dg) are sums over value columns, written
per column block and summed by torch (gdn's dg also over the key rows); dβ =
Σ_j w_j du_j is written per value column and summed likewise.
The last chunk's steps past T load g = 0, β = 0 and zero q, k, v, dy: identity
steps that change neither the state nor its gradient.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (how the tests check
it). Inputs fp32 or bf16 (fp64 for the gradient checks); state and accumulation
fp32. A chunked (WY, tensor-core) Triton kernel is still to come.

The two launches, with the sums of their partials, are torch ops,
`torch.ops.rwkvx.delta_triton_fwd` and `torch.ops.rwkvx.delta_triton_bwd` (one pair for gdn
and kda; docs/operators.md#the-triton-kernels-as-torch-ops), so torch.compile traces the
autograd.Function around them with no graph break.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)

if triton is not None:

    @triton.jit
    def _step_inputs(
        q, k, v, g, beta, t, T, row0, H, keys, vals, mk, mv, N: tl.constexpr, G: tl.constexpr, DT: tl.constexpr
    ):
        """Step t's q, k, A = exp(g) over the keys, v and β over this block's value columns
        (β broadcast), for the (batch, head) whose step 0 is row `row0` of [B*T*H, *];
        past T everything is zero and A = 1: an identity step."""
        okk = mk & ((keys * 0 + t) < T)
        okv = mv & ((vals * 0 + t) < T)
        row = row0 + t * H
        base = row * N
        qt = tl.load(q + base + keys, mask=okk, other=0.0).to(DT)
        kt = tl.load(k + base + keys, mask=okk, other=0.0).to(DT)
        gk = keys if G > 1 else keys * 0
        At = tl.exp(tl.load(g + row * G + gk, mask=okk, other=0.0).to(DT))
        vt = tl.load(v + base + vals, mask=okv, other=0.0).to(DT)
        bt = tl.load(beta + row + vals * 0, mask=okv, other=0.0).to(DT)
        return qt, kt, At, vt, bt, okk, okv, base

    @triton.jit
    def _fwd_kernel(
        q, k, v, g, beta, s0,
        y, s_out, snaps,
        scale, T, H,
        N: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, NC,
        DT: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)  # i64: the base offsets (bh * NC * N * N, ...) pass 2^31 at production sizes
        iv = tl.program_id(1)
        row0 = (bh // H) * T * H + bh % H
        keys = tl.arange(0, BK)
        vals = iv * BV + tl.arange(0, BV)
        mk = keys < N
        mv = vals < N
        m2 = mk[:, None] & mv[None, :]
        off2 = keys[:, None] * N + vals[None, :]
        S = tl.load(s0 + bh * N * N + off2, mask=m2, other=0.0).to(DT)
        for t in range(T):
            if t % CHUNK == 0:
                tl.store(snaps + (bh * NC + t // CHUNK) * N * N + off2, S, mask=m2)
            qt, kt, At, vt, bt, okk, okv, base = _step_inputs(
                q, k, v, g, beta, t, T, row0, H, keys, vals, mk, mv, N, G, DT
            )
            P = S * At[:, None]
            u = bt * (vt - tl.sum(P * kt[:, None], axis=0))
            S = P + kt[:, None] * u[None, :]
            yt = scale * tl.sum(S * qt[:, None], axis=0)
            tl.store(y + base + vals, yt.to(y.dtype.element_ty), mask=okv)
        tl.store(s_out + bh * N * N + off2, S, mask=m2)

    @triton.jit
    def _bwd_kernel(
        q, k, v, g, beta, snaps, dy, ds_out,
        scratch, scratch_w,
        dv, ds0, dq_p, dk_p, dg_p, db_lanes,
        scale, T, H, PSTRIDE,
        N: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, NC, NVB,
        DT: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)  # i64: the base offsets (bh * NC * N * N, ...) pass 2^31 at production sizes
        iv = tl.program_id(1)
        row0 = (bh // H) * T * H + bh % H
        keys = tl.arange(0, BK)
        lv = tl.arange(0, BV)
        vals = iv * BV + lv
        mk = keys < N
        mv = vals < N
        m2 = mk[:, None] & mv[None, :]
        off2 = keys[:, None] * N + vals[None, :]
        # This program's scratch: the chunk's CHUNK states [BK, BV] and w vectors [BV].
        scr = scratch + (bh * NVB + iv) * CHUNK * BK * BV
        scr_w = scratch_w + (bh * NVB + iv) * CHUNK * BV
        loc2 = keys[:, None] * BV + lv[None, :]
        part = iv.to(tl.int64) * PSTRIDE  # this block's slice of the partials [NVB, B, T, H, N]
        dS = tl.load(ds_out + bh * N * N + off2, mask=m2, other=0.0).to(DT)
        for cc in range(NC):
            c = NC - 1 - cc
            t0 = c * CHUNK
            S = tl.load(snaps + (bh * NC + c) * N * N + off2, mask=m2, other=0.0).to(DT)
            tl.debug_barrier()  # the previous chunk's reverse scan is done with the scratch
            for i in range(CHUNK):  # recompute the chunk, keeping each S_{t-1} and w_t = v_t - m_t
                qt, kt, At, vt, bt, okk, okv, base = _step_inputs(
                    q, k, v, g, beta, t0 + i, T, row0, H, keys, vals, mk, mv, N, G, DT
                )
                tl.store(scr + i * BK * BV + loc2, S)
                P = S * At[:, None]
                w = vt - tl.sum(P * kt[:, None], axis=0)
                tl.store(scr_w + i * BV + lv, w)
                S = P + kt[:, None] * (bt * w)[None, :]
            tl.debug_barrier()  # the scratch is read back by whichever threads hold each element
            for j in range(CHUNK):  # the reverse scan over the chunk
                i = CHUNK - 1 - j
                qt, kt, At, vt, bt, okk, okv, base = _step_inputs(
                    q, k, v, g, beta, t0 + i, T, row0, H, keys, vals, mk, mv, N, G, DT
                )
                S_prev = tl.load(scr + i * BK * BV + loc2)
                w = tl.load(scr_w + i * BV + lv)
                dyt = tl.load(dy + base + vals, mask=okv, other=0.0).to(DT)
                u = bt * w
                x = dS + scale * qt[:, None] * dyt[None, :]  # dS_t
                du = tl.sum(x * kt[:, None], axis=0)  # read before k dmᵀ is added below
                dm = -bt * du
                P = S_prev * At[:, None]
                S_t = P + kt[:, None] * u[None, :]
                dP = x + kt[:, None] * dm[None, :]
                tl.store(dv + base + vals, bt * du, mask=okv)
                tl.store(db_lanes + base + vals, w * du, mask=okv)
                pk = part + base + keys
                tl.store(dq_p + pk, scale * tl.sum(S_t * dyt[None, :], axis=1), mask=okk)
                tl.store(dk_p + pk, tl.sum(x * u[None, :], axis=1) + tl.sum(P * dm[None, :], axis=1), mask=okk)
                tl.store(dg_p + pk, At * tl.sum(S_prev * dP, axis=1), mask=okk)
                dS = dP * At[:, None]
        tl.store(ds0 + bh * N * N + off2, dS, mask=m2)


def index_offsets(B: int, T: int, H: int, N: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index; refuses sizes they cannot index."""
    return tr.fused_state_offsets("gdn/kda triton", B, T, H, N)


@triton_op("rwkvx::delta_triton_fwd")
def delta_triton_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernel: q, k, v [B, T, H, N], the log gate g [B, T, H, G] (G = 1 for gdn,
    N for kda), β [B, T, H], in one dtype, s0 [B, H, N, N] in the compute dtype, and the
    output scale. Returns (y in the inputs' dtype, state_out, snapshots [B, H, NC, N, N])."""
    B, T, H, N = q.shape
    G = g.shape[-1]
    q, k, v, g, beta, s0 = (x.contiguous() for x in (q, k, v, g, beta, s0))
    _, DT = tr.compute_dtype(q.dtype)
    BK, BV, NVB = tr.state_blocks(N)
    NC = triton.cdiv(T, tr.CHUNK)
    y = torch.empty_like(q)
    s_out = torch.empty_like(s0)
    snaps = s0.new_empty(B, H, NC, N, N)
    wrap_triton(_fwd_kernel)[(B * H, NVB)](
        q, k, v, g, beta, s0, y, s_out, snaps, scale, T, H, N, G, BK, BV, tr.CHUNK, NC, DT
    )
    return y, s_out, snaps


@triton_op("rwkvx::delta_triton_bwd")
def delta_triton_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    snaps: Tensor,
    dy: Tensor,
    ds_out: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs and snapshots, the cotangents of y and
    state_out in the compute dtype, the output scale. Returns (dq, dk, dv, dg, dβ, dstate) in
    the compute dtype, each summed over the value blocks' partials."""
    B, T, H, N = q.shape
    G = g.shape[-1]
    q, k, v, g, beta, snaps, dy, ds_out = (x.contiguous() for x in (q, k, v, g, beta, snaps, dy, ds_out))
    cdt, DT = tr.compute_dtype(q.dtype)
    BK, BV, NVB = tr.state_blocks(N)
    NC = triton.cdiv(T, tr.CHUNK)
    empty = tr.compute_empty(cdt, dy.device)
    scratch = empty(B * H * NVB * tr.CHUNK * BK * BV)
    scratch_w = empty(B * H * NVB * tr.CHUNK * BV)
    dv = empty(B, T, H, N)
    ds0 = empty(B, H, N, N)
    dq_p, dk_p, dg_p = (empty(NVB, B, T, H, N) for _ in range(3))
    db_lanes = empty(B, T, H, N)  # w_j du_j: each value column belongs to one block
    wrap_triton(_bwd_kernel)[(B * H, NVB)](
        q, k, v, g, beta, snaps, dy, ds_out, scratch, scratch_w, dv, ds0, dq_p, dk_p, dg_p, db_lanes,
        scale, T, H, B * T * H * N, N, G, BK, BV, tr.CHUNK, NC, NVB, DT,
    )  # fmt: skip
    dq, dk, dg = dq_p.sum(0), dk_p.sum(0), dg_p.sum(0)
    if G == 1:
        dg = dg.sum(-1, keepdim=True)
    return dq, dk, dv, dg, db_lanes.sum(-1), ds0


class _DeltaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, scale):
        B, T, H, N = q.shape
        index_offsets(B, T, H, N)  # before any copy or allocation
        ins, (s0,), _, _ = tr.prepare((q, k, v, g, beta), (state,), q.dtype)
        y, s_out, snaps = torch.ops.rwkvx.delta_triton_fwd(*ins, s0, scale)
        ctx.save_for_backward(*ins, snaps)
        ctx.scale = scale
        ctx.dtypes = (q.dtype,) * 3 + (g.dtype, beta.dtype, state.dtype)
        return y, s_out

    @staticmethod
    def backward(ctx, dy, ds_out):
        *ins, snaps = ctx.saved_tensors
        (dy,), (ds_out,), _, _ = tr.prepare((dy,), (ds_out,), ins[0].dtype)
        grads = torch.ops.rwkvx.delta_triton_bwd(*ins, snaps, dy, ds_out, ctx.scale)
        return (*tr.cast_back(grads, ctx.dtypes), None)


def delta_triton(q, k, v, g, beta, state, scale):
    return _DeltaTriton.apply(q, k, v, g, beta, state, float(scale))
