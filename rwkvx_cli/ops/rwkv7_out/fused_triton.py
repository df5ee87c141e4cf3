"""rwkv7_out `triton` backend: the per-head group norm, the bonus and the gate, forward and
backward, one kernel each.

Each program takes one head h of a tile of BT tokens, a [BT, N] tile per tensor: the norm's
statistics are over the head's N channels, inside the tile (mean first, then the centred
variance). The backward saves nothing but the inputs and recomputes the norm; its programs each
walk a run of tokens of one head and keep weight's and bias's gradients (sums over B·T) in
registers, per-program partials summed by torch. With n = (y - mean) rstd, ŷ = n weight + bias:

    dbonus = dout g      dg = dout (ŷ + bonus)      dŷ = dout g
    dweight = Σ dŷ n     dbias = Σ dŷ               dy = rstd (e - mean_N(e) - n mean_N(e n)),  e = dŷ weight

The launches are torch ops, `torch.ops.rwkvx.rwkv7_out_triton_fwd` and `_bwd`
(docs/operators.md#the-triton-kernels-as-torch-ops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.ops import _triton as tr
from rwkvx_cli.ops._triton import tl, triton, triton_op, unavailable, wrap_triton  # noqa: F401  (re-exported)
from rwkvx_cli.ops.rwkv7_out import LN_X_EPS

WARPS = 4
FWD_TILE, BWD_TILE = 1024, 512  # elements per tile: ~50 and 64 registers (a backward tile of 1024 takes ~140)

if triton is not None:

    @triton.jit
    def _normed(y, weight, bias, tok, h, R, H, eps, N: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
        """Head h of these tokens: offsets and mask in [R, H, N], n = (y - mean) rstd, ŷ, rstd,
        weight [1, BN] and the channel mask."""
        cn = tl.arange(0, BN)
        mn = cn < N
        m = (tok < R)[:, None] & mn[None, :]
        ch = h * N + cn
        off = tok.to(tl.int64)[:, None] * (H * N) + ch[None, :]
        yt = tl.load(y + off, mask=m, other=0.0).to(DT)
        d = tl.where(m, yt - (tl.sum(yt, axis=1) / N)[:, None], 0.0)
        rstd = (1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps))[:, None]
        n = d * rstd
        w = tl.load(weight + ch, mask=mn, other=0.0).to(DT)[None, :]
        yn = n * w + tl.load(bias + ch, mask=mn, other=0.0).to(DT)[None, :]
        return off, m, n, yn, rstd, w, ch, mn

    @triton.jit
    def _fwd_kernel(
        y, bonus, g, weight, bias, out,
        R, H, eps,
        N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
    ):  # fmt: skip
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        off, m, _, yn, _, _, _, _ = _normed(y, weight, bias, tok, tl.program_id(1), R, H, eps, N, BN, DT)
        bt = tl.load(bonus + off, mask=m, other=0.0).to(DT)
        gt = tl.load(g + off, mask=m, other=0.0).to(DT)
        tl.store(out + off, ((yn + bt) * gt).to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _bwd_kernel(
        y, bonus, g, weight, bias, dout,
        dy, dbonus, dg, parts,
        R, H, RP, PSTRIDE, eps,
        N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(0)
        h = tl.program_id(1)
        acc_w = tl.zeros([BT, BN], dtype=DT)
        acc_b = tl.zeros([BT, BN], dtype=DT)
        for t0 in range(p * RP, p * RP + RP, BT):
            tok = t0 + tl.arange(0, BT)
            off, m, n, yn, rstd, w, ch, mn = _normed(y, weight, bias, tok, h, R, H, eps, N, BN, DT)
            gt = tl.load(g + off, mask=m, other=0.0).to(DT)
            do = tl.load(dout + off, mask=m, other=0.0).to(DT)
            dyn = do * gt
            acc_w += dyn * n
            acc_b += dyn
            e = dyn * w
            dyt = rstd * (e - (tl.sum(e, axis=1) / N)[:, None] - n * (tl.sum(e * n, axis=1) / N)[:, None])
            ty = dy.dtype.element_ty
            tl.store(dy + off, dyt.to(ty), mask=m)
            tl.store(dbonus + off, dyn.to(ty), mask=m)
            tl.store(dg + off, (do * (yn + tl.load(bonus + off, mask=m, other=0.0).to(DT))).to(ty), mask=m)
        ch = h * N + tl.arange(0, BN)
        mn = tl.arange(0, BN) < N
        pc = p.to(tl.int64) * H * N + ch
        tl.store(parts + pc, tl.sum(acc_w, axis=0), mask=mn)
        tl.store(parts + PSTRIDE + pc, tl.sum(acc_b, axis=0), mask=mn)


def _tiles(N: int, elements: int) -> tuple[int, int]:
    """The padded head (BN) and the tokens per tile (BT): tiles of about `elements`."""
    BN = triton.next_power_of_2(N)
    return BN, max(1, elements // BN)


def index_offsets(B: int, T: int, H: int, N: int) -> dict[str, int]:
    """The largest offset into each buffer the kernels index (int64 token bases)."""
    return tr.check_offsets("rwkv7_out triton", {"inputs": (B, T, H, N)})


@triton_op("rwkvx::rwkv7_out_triton_fwd")
def rwkv7_out_triton_fwd(y: Tensor, bonus: Tensor, g: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """The forward kernel: y, bonus, g [B, T, H, N] in one dtype, weight and bias [C] (any floating
    dtype). Returns out [B, T, H, N] in the inputs' dtype."""
    B, T, H, N = y.shape
    y, bonus, g, weight, bias = (t.contiguous() for t in (y, bonus, g, weight, bias))
    _, DT = tr.compute_dtype(y.dtype)
    BN, BT = _tiles(N, FWD_TILE)
    out = torch.empty_like(y)
    wrap_triton(_fwd_kernel)[(triton.cdiv(B * T, BT), H)](
        y, bonus, g, weight, bias, out, B * T, H, eps, N, BT, BN, DT, num_warps=WARPS
    )
    return out


@triton_op("rwkvx::rwkv7_out_triton_bwd")
def rwkv7_out_triton_bwd(
    y: Tensor, bonus: Tensor, g: Tensor, weight: Tensor, bias: Tensor, dout: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs and out's cotangent. Returns (dy, dbonus, dg) in the
    inputs' dtype and (dweight, dbias) as one [2, C] tensor in the compute dtype."""
    B, T, H, N = y.shape
    R, C = B * T, H * N
    y, bonus, g, weight, bias, dout = (t.contiguous() for t in (y, bonus, g, weight, bias, dout))
    cdt, DT = tr.compute_dtype(y.dtype)
    BN, BT = _tiles(N, BWD_TILE)
    P, RP = tr.row_chunks(R, BT, H)
    dy, dbonus, dg = (torch.empty_like(y) for _ in range(3))
    parts = tr.compute_empty(cdt, y.device)(2, P, C)
    wrap_triton(_bwd_kernel)[(P, H)](
        y, bonus, g, weight, bias, dout, dy, dbonus, dg, parts,
        R, H, RP, P * C, eps, N, BT, BN, DT, num_warps=WARPS,
    )  # fmt: skip
    return dy, dbonus, dg, parts.sum(1)


class _Rwkv7OutTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bonus, g, weight, bias, eps):
        index_offsets(*y.shape)
        ins = [t.detach() for t in (y, bonus, g, weight, bias)]
        out = torch.ops.rwkvx.rwkv7_out_triton_fwd(*ins, eps)
        ctx.save_for_backward(*ins)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, dout):
        y, bonus, g, weight, bias = ctx.saved_tensors
        dy, dbonus, dg, dparams = torch.ops.rwkvx.rwkv7_out_triton_bwd(y, bonus, g, weight, bias, dout, ctx.eps)
        dw, db = dparams.unbind(0)
        return dy, dbonus, dg, dw.to(weight.dtype).view_as(weight), db.to(bias.dtype).view_as(bias), None


def rwkv7_out_triton(y, bonus, g, weight, bias, *, eps: float = LN_X_EPS):
    return _Rwkv7OutTriton.apply(y, bonus, g, weight, bias, eps)
