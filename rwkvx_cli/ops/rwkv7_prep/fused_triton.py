"""rwkv7_prep `triton` backend: RWKV-7's gates, value residual, kk, key update and bonus, forward and
backward, one kernel each.

Each program takes one head h of a tile of BT tokens, a [BT, N] tile per tensor (rows of N
contiguous channels, C apart): kk's norm and the bonus's sum are over the head's N channels, inside
the tile. The backward saves nothing but the inputs and recomputes the forward's elementwise work;
its programs each walk a run of tokens of one head and keep the parameters' gradients (sums over
B·T) in registers, per-program partials summed by torch. With s = Σ_N r k' r_k, ag = σ(a0 + a_lora)
and the forward's formulas (rwkv7_prep/__init__.py):

    dv'  = dv'_out + s dbonus         ds = Σ_N dbonus v'        dr = ds k' r_k
    dk'  = dk'_out + ds r r_k         dr_k = Σ ds r k'
    dkk  = db ag - da                 dag = db kk + dk' k k_a    dk_a = Σ dk' k (ag - 1)
    dk   = dk' (1 + (ag - 1) k_a) + k_k (dkk - kk (dkk · kk)) / |k k_k|
    d(w0 + w_lora) = -e^{-1/2} σ'(w0 + w_lora) dw,  d(a0 + a_lora) = σ'(a0 + a_lora) dag

and the value residual's lerp. The first layer (v_first = v_lora = None) has no residual: the
kernels then neither write v' (the Python side returns v itself) nor take its gradient (dv is the
bonus's part alone; autograd adds the rest).

The launches are torch ops, `torch.ops.rwkvx.rwkv7_prep_triton_fwd` and `_bwd`
(docs/operators.md#the-triton-kernels-as-torch-ops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)
from rwkvx_cli.ops.rwkv7_prep import prep_outputs
from rwkvx_cli.ops.rwkv7_prep.reference import DECAY_SCALE

WARPS = 4
NORM_EPS = 1e-12  # F.normalize's

if triton is not None:
    _DECAY = tl.constexpr(DECAY_SCALE)  # jit code reads a module global only as a constexpr
    _NORM_EPS = tl.constexpr(NORM_EPS)

    @triton.jit
    def _sigmoid(z):
        return 1.0 / (1.0 + tl.exp(-z))

    @triton.jit
    def _tile(tok, h, R, H, N: tl.constexpr, BN: tl.constexpr):
        """Offsets of head h of these tokens in [R, H, N], its channels h N + n, and the masks."""
        n = tl.arange(0, BN)
        mn = n < N
        m = (tok < R)[:, None] & mn[None, :]
        ch = h * N + n
        return tok.to(tl.int64)[:, None] * (H * N) + ch[None, :], ch, mn, m

    @triton.jit
    def _gate(p, lora, ch, mn, off, m, DT: tl.constexpr):
        """A gate's argument: the parameter [C] plus the low-rank output over the tile."""
        return tl.load(p + ch, mask=mn, other=0.0).to(DT)[None, :] + tl.load(lora + off, mask=m, other=0.0).to(DT)

    @triton.jit
    def _fwd_kernel(
        r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k,
        w_out, k_out, v_out, a_out, b_out, bonus,
        R, H,
        N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, RESIDUAL: tl.constexpr, DT: tl.constexpr,
    ):  # fmt: skip
        h = tl.program_id(1)
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        off, ch, mn, m = _tile(tok, h, R, H, N, BN)
        rt = tl.load(r + off, mask=m, other=0.0).to(DT)
        kt = tl.load(k + off, mask=m, other=0.0).to(DT)
        vt = tl.load(v + off, mask=m, other=0.0).to(DT)
        w = -_DECAY * _sigmoid(_gate(w0, w_lora, ch, mn, off, m, DT))
        ag = _sigmoid(_gate(a0, a_lora, ch, mn, off, m, DT))
        if RESIDUAL:
            sv = _sigmoid(_gate(v0, v_lora, ch, mn, off, m, DT))
            vt = vt + (tl.load(v_first + off, mask=m, other=0.0).to(DT) - vt) * sv
            tl.store(v_out + off, vt.to(v_out.dtype.element_ty), mask=m)
        kk = kt * tl.load(k_k + ch, mask=mn, other=0.0).to(DT)[None, :]
        kk = kk / tl.maximum(tl.sqrt(tl.sum(kk * kk, axis=1)), _NORM_EPS)[:, None]
        kp = kt * (1.0 + (ag - 1.0) * tl.load(k_a + ch, mask=mn, other=0.0).to(DT)[None, :])
        s = tl.sum(rt * kp * tl.load(r_k + ch, mask=mn, other=0.0).to(DT)[None, :], axis=1)
        ty = w_out.dtype.element_ty
        tl.store(w_out + off, w.to(ty), mask=m)
        tl.store(k_out + off, kp.to(ty), mask=m)
        tl.store(a_out + off, (-kk).to(ty), mask=m)
        tl.store(b_out + off, (kk * ag).to(ty), mask=m)
        tl.store(bonus + off, (s[:, None] * vt).to(ty), mask=m)

    @triton.jit
    def _bwd_kernel(
        r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k,
        gw, gk, gv, ga, gb, gbonus, dr_add,
        dr, dk, dv, dw_lora, da_lora, dv_first, dv_lora, parts,
        R, H, RP, PSTRIDE,
        N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, RESIDUAL: tl.constexpr, HAS_DR_ADD: tl.constexpr,
        DT: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(0)
        h = tl.program_id(1)
        ch = h * N + tl.arange(0, BN)
        mn = tl.arange(0, BN) < N
        w0v = tl.load(w0 + ch, mask=mn, other=0.0).to(DT)[None, :]
        a0v = tl.load(a0 + ch, mask=mn, other=0.0).to(DT)[None, :]
        kkv = tl.load(k_k + ch, mask=mn, other=0.0).to(DT)[None, :]
        kav = tl.load(k_a + ch, mask=mn, other=0.0).to(DT)[None, :]
        rkv = tl.load(r_k + ch, mask=mn, other=0.0).to(DT)[None, :]
        v0v = tl.load(v0 + ch, mask=mn, other=0.0).to(DT)[None, :]  # v0 is any valid pointer without RESIDUAL
        acc_w0 = tl.zeros([BT, BN], dtype=DT)
        acc_a0 = tl.zeros([BT, BN], dtype=DT)
        acc_kk = tl.zeros([BT, BN], dtype=DT)
        acc_ka = tl.zeros([BT, BN], dtype=DT)
        acc_rk = tl.zeros([BT, BN], dtype=DT)
        acc_v0 = tl.zeros([BT, BN], dtype=DT)
        for t0 in range(p * RP, p * RP + RP, BT):
            off, _ch, _mn, m = _tile(t0 + tl.arange(0, BT), h, R, H, N, BN)
            rt = tl.load(r + off, mask=m, other=0.0).to(DT)
            kt = tl.load(k + off, mask=m, other=0.0).to(DT)
            vt = tl.load(v + off, mask=m, other=0.0).to(DT)
            sw = _sigmoid(w0v + tl.load(w_lora + off, mask=m, other=0.0).to(DT))
            ag = _sigmoid(a0v + tl.load(a_lora + off, mask=m, other=0.0).to(DT))
            vp = vt
            if RESIDUAL:
                vf = tl.load(v_first + off, mask=m, other=0.0).to(DT)
                sv = _sigmoid(v0v + tl.load(v_lora + off, mask=m, other=0.0).to(DT))
                vp = vt + (vf - vt) * sv
            kk0 = kt * kkv
            nrm = tl.sqrt(tl.sum(kk0 * kk0, axis=1))[:, None]
            den = tl.maximum(nrm, _NORM_EPS)
            kk = kk0 / den
            kp = kt * (1.0 + (ag - 1.0) * kav)
            s = tl.sum(rt * kp * rkv, axis=1)[:, None]
            gbon = tl.load(gbonus + off, mask=m, other=0.0).to(DT)
            ds = tl.sum(gbon * vp, axis=1)[:, None]
            dvp = s * gbon
            dkp = tl.load(gk + off, mask=m, other=0.0).to(DT) + ds * rt * rkv
            acc_rk += ds * rt * kp
            gbt = tl.load(gb + off, mask=m, other=0.0).to(DT)
            dkk = gbt * ag - tl.load(ga + off, mask=m, other=0.0).to(DT)
            dza = (gbt * kk + dkp * kt * kav) * ag * (1.0 - ag)
            acc_ka += dkp * kt * (ag - 1.0)
            acc_a0 += dza
            # kk = kk0 / max(|kk0|, eps): the norm's gradient only where it is not clamped
            dkk0 = tl.where(nrm >= _NORM_EPS, dkk - kk * tl.sum(dkk * kk, axis=1)[:, None], dkk) / den
            acc_kk += dkk0 * kt
            dzw = tl.load(gw + off, mask=m, other=0.0).to(DT) * (-_DECAY) * sw * (1.0 - sw)
            acc_w0 += dzw
            ty = dr.dtype.element_ty
            drt = ds * kp * rkv
            if HAS_DR_ADD:
                drt += tl.load(dr_add + off, mask=m, other=0.0).to(DT)
            tl.store(dr + off, drt.to(ty), mask=m)
            tl.store(dk + off, (dkp * (1.0 + (ag - 1.0) * kav) + dkk0 * kkv).to(ty), mask=m)
            tl.store(dw_lora + off, dzw.to(ty), mask=m)
            tl.store(da_lora + off, dza.to(ty), mask=m)
            if RESIDUAL:
                dvp += tl.load(gv + off, mask=m, other=0.0).to(DT)
                dzv = dvp * (vf - vt) * sv * (1.0 - sv)
                acc_v0 += dzv
                tl.store(dv + off, (dvp * (1.0 - sv)).to(ty), mask=m)
                tl.store(dv_first + off, (dvp * sv).to(ty), mask=m)
                tl.store(dv_lora + off, dzv.to(ty), mask=m)
            else:
                tl.store(dv + off, dvp.to(ty), mask=m)
        # parts [5 or 6, P, C]: w0, a0, k_k, k_a, r_k (, v0)
        pc = p.to(tl.int64) * H * N + ch
        tl.store(parts + pc, tl.sum(acc_w0, axis=0), mask=mn)
        tl.store(parts + PSTRIDE + pc, tl.sum(acc_a0, axis=0), mask=mn)
        tl.store(parts + 2 * PSTRIDE + pc, tl.sum(acc_kk, axis=0), mask=mn)
        tl.store(parts + 3 * PSTRIDE + pc, tl.sum(acc_ka, axis=0), mask=mn)
        tl.store(parts + 4 * PSTRIDE + pc, tl.sum(acc_rk, axis=0), mask=mn)
        if RESIDUAL:
            tl.store(parts + 5 * PSTRIDE + pc, tl.sum(acc_v0, axis=0), mask=mn)


def _tiles(N: int, elements: int) -> tuple[int, int]:
    """The padded head (BN) and the tokens per tile (BT): tiles of about `elements`."""
    BN = triton.next_power_of_2(N)
    return BN, max(1, elements // BN)


# Elements per tile: twice these, the forward takes ~96 registers and the backward ~140 (it keeps
# six accumulator tiles); these take 48 and 72 (the compile gate).
FWD_TILE, BWD_TILE = 512, 256


def index_offsets(B: int, T: int, H: int, N: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index (int64 token bases)."""
    return tr.check_offsets("rwkv7_prep triton", {"inputs": (B, T, H, N)})


@triton_op("rwkvx::rwkv7_prep_triton_fwd")
def rwkv7_prep_triton_fwd(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    w_lora: Tensor,
    a_lora: Tensor,
    v_first: Tensor | None,
    v_lora: Tensor | None,
    w0: Tensor,
    a0: Tensor,
    v0: Tensor | None,
    k_k: Tensor,
    k_a: Tensor,
    r_k: Tensor,
) -> list[Tensor]:
    """The forward kernel: the sequence inputs [B, T, H, N] in one dtype (v_first, v_lora None in
    the first layer), the parameters [C] (any floating dtype; v0 None with them). Returns
    [w, k', a, b, bonus], then v' when there is a value residual, all in the inputs' dtype."""
    B, T, H, N = r.shape
    residual = v_first is not None
    seq = [t.contiguous() for t in (r, k, v, w_lora, a_lora)]
    vf, vl = (v_first.contiguous(), v_lora.contiguous()) if residual else (seq[0], seq[0])
    params = [t.contiguous() for t in (w0, a0, v0 if residual else w0, k_k, k_a, r_k)]
    _, DT = tr.compute_dtype(r.dtype)
    BN, BT = _tiles(N, FWD_TILE)
    w, kp, a, b, bonus = (torch.empty_like(seq[0]) for _ in range(5))
    vp = torch.empty_like(seq[0]) if residual else seq[0]
    wrap_triton(_fwd_kernel)[(triton.cdiv(B * T, BT), H)](
        *seq, vf, vl, *params, w, kp, vp, a, b, bonus, B * T, H, N, BT, BN, residual, DT, num_warps=WARPS
    )
    return [w, kp, a, b, bonus, vp] if residual else [w, kp, a, b, bonus]


@triton_op("rwkvx::rwkv7_prep_triton_bwd")
def rwkv7_prep_triton_bwd(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    w_lora: Tensor,
    a_lora: Tensor,
    v_first: Tensor | None,
    v_lora: Tensor | None,
    w0: Tensor,
    a0: Tensor,
    v0: Tensor | None,
    k_k: Tensor,
    k_a: Tensor,
    r_k: Tensor,
    dw: Tensor,
    dk_out: Tensor,
    dv_out: Tensor | None,
    da: Tensor,
    db: Tensor,
    dbonus: Tensor,
    dr_add: Tensor | None,
) -> list[Tensor]:
    """The backward kernel: the forward's inputs and the cotangents of w, k', v' (None in the first
    layer), a, b and bonus [B, T, H, N], and dr_add, a gradient added into dr (None: nothing).
    Returns [dr, dk, dv, dw_lora, da_lora, (dv_first, dv_lora with a value residual)] in the
    inputs' dtype, then the parameters' gradients as one tensor [dw0, da0, dk_k, dk_a, dr_k (, dv0)]
    x [C] in the compute dtype."""
    B, T, H, N = r.shape
    C, R = H * N, B * T
    residual = v_first is not None
    seq = [t.contiguous() for t in (r, k, v, w_lora, a_lora)]
    vf, vl = (v_first.contiguous(), v_lora.contiguous()) if residual else (seq[0], seq[0])
    params = [t.contiguous() for t in (w0, a0, v0 if residual else w0, k_k, k_a, r_k)]
    gv = dv_out.contiguous() if residual else seq[0]
    grads = [t.contiguous() for t in (dw, dk_out)] + [gv] + [t.contiguous() for t in (da, db, dbonus)]
    cdt, DT = tr.compute_dtype(r.dtype)
    BN, BT = _tiles(N, BWD_TILE)
    P, RP = tr.row_chunks(R, BT, H)
    outs = [torch.empty_like(seq[0]) for _ in range(7 if residual else 5)]
    dr, dk, dv, dwl, dal = outs[:5]
    dvf, dvl = outs[5:] if residual else (seq[0], seq[0])
    parts = tr.compute_empty(cdt, r.device)(6 if residual else 5, P, C)
    dra = seq[0] if dr_add is None else dr_add.contiguous()  # any valid pointer without HAS_DR_ADD
    wrap_triton(_bwd_kernel)[(P, H)](
        *seq, vf, vl, *params, *grads, dra, dr, dk, dv, dwl, dal, dvf, dvl, parts,
        R, H, RP, P * C, N, BT, BN, residual, dr_add is not None, DT, num_warps=WARPS,
    )  # fmt: skip
    return [*outs, parts.sum(1)]


class _Rwkv7PrepTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pass_r, r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k):
        index_offsets(*r.shape)
        ins = [None if t is None else t.detach() for t in (r, k, v, w_lora, a_lora, v_first, v_lora)]
        params = [None if t is None else t.detach() for t in (w0, a0, v0, k_k, k_a, r_k)]
        outs = torch.ops.rwkvx.rwkv7_prep_triton_fwd(*ins, *params)
        ctx.residual = v_first is not None
        ctx.save_for_backward(*ins, *params)
        ctx.params = [None if p is None else (p.dtype, p.shape) for p in (w0, a0, v0, k_k, k_a, r_k)]
        ctx.pass_r = pass_r
        w, kp, a, b, bonus, *vp = outs
        return (w, kp, *vp, a, b, bonus, *((r,) if pass_r else ()))  # r as is: autograd views it

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        r = saved[0]
        dr_add = grads[-1] if ctx.pass_r else None  # r's gradient from its other consumer: added into dr
        grads = grads[:-1] if ctx.pass_r else grads
        grads = [torch.zeros_like(r) if g is None else g for g in grads]  # an output no loss reached
        if ctx.residual:
            dw, dk, dv, da, db, dbonus = grads
        else:
            (dw, dk, da, db, dbonus), dv = grads, None
        out = torch.ops.rwkvx.rwkv7_prep_triton_bwd(*saved, dw, dk, dv, da, db, dbonus, dr_add)
        *seq, dparams = out
        dr, dk, dv, dwl, dal, dvf, dvl = seq if ctx.residual else (*seq, None, None)
        dw0, da0, dkk, dka, drk, *dv0 = dparams.unbind(0)
        dv0 = dv0[0] if ctx.residual else None
        pgrads = (dw0, da0, dv0, dkk, dka, drk)
        pgrads = [None if g is None else g.to(p[0]).view(p[1]) for g, p in zip(pgrads, ctx.params, strict=True)]
        return (None, dr, dk, dv, dwl, dal, dvf, dvl, *pgrads)


def rwkv7_prep_triton(r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k, *, pass_r: bool = False):
    outs = _Rwkv7PrepTriton.apply(pass_r, r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k)
    return prep_outputs(outs, v_first is not None, v, pass_r)
