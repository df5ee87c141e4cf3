"""rwkv7_prep `cpu` backend: the fused C++ kernel of csrc/rwkv7_prep_cpu.cpp behind a
torch.autograd.Function. One pass over each tensor, OpenMP over the B·T rows, SIMD over each
head's channels, fp32 math (fp64 for fp64 inputs). The backward saves only the inputs (and the
output w in place of w_lora: wkv7 keeps w anyway, and the decay's logistic is -e^{1/2} w) and
recomputes the elementwise work (the logistics, kk's norm, k', v', the bonus's sum).

The kernel's two entry points are torch custom ops, `torch.ops.rwkvx.rwkv7_prep_cpu_fwd` and
`torch.ops.rwkvx.rwkv7_prep_cpu_bwd` (docs/operators.md#the-cpu-kernels-as-torch-ops), so
torch.compile traces the autograd.Function around them with no graph break."""

from __future__ import annotations

import torch
from torch import Tensor

from rwkvx_cli.native import optional_ptr, ptr
from rwkvx_cli.ops._cpu_op import NativeKernel, cpu_kernel_op, threads
from rwkvx_cli.ops.rwkv7_prep import prep_outputs

KERNEL = NativeKernel("rwkv7_prep")  # csrc/rwkv7_prep_cpu.cpp
unavailable = KERNEL.unavailable


def _ptrs(tensors, stand_in: Tensor) -> list:
    """Pointers for the kernel; an absent tensor (None, or an empty output) gets `stand_in`'s, which
    the kernel never touches."""
    return [ptr(stand_in if t is None or t.numel() == 0 else t) for t in tensors]


@cpu_kernel_op("rwkvx::rwkv7_prep_cpu_fwd")
def rwkv7_prep_cpu_fwd(
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: the sequence inputs [B, T, H, N] and the parameters [C], all fp32 or
    all fp64; v_first, v_lora and v0 None in the first layer. Returns (w, k', v', a, b, bonus),
    v' empty ([0]) in the first layer, where it is v itself."""
    B, T, H, N = r.shape
    ins = [None if x is None else x.contiguous() for x in (r, k, v, w_lora, a_lora, v_first, v_lora)]
    params = [None if p is None else p.contiguous() for p in (w0, a0, v0, k_k, k_a, r_k)]
    outs = _fwd_fake(r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k)
    fn = KERNEL.forward(r)
    residual = v_first is not None
    fn(*_ptrs((*ins, *params, *outs), r), B * T, H, N, int(residual), threads(B * T))
    return outs


@rwkv7_prep_cpu_fwd.register_fake
def _fwd_fake(r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k):
    vo = r.new_empty(r.shape if v_first is not None else (0,))
    return (*(r.new_empty(r.shape) for _ in range(2)), vo, *(r.new_empty(r.shape) for _ in range(3)))


@cpu_kernel_op("rwkvx::rwkv7_prep_cpu_bwd")
def rwkv7_prep_cpu_bwd(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor,
    a_lora: Tensor,
    v_first: Tensor | None,
    v_lora: Tensor | None,
    w0: Tensor,
    a0: Tensor,
    v0: Tensor | None,
    k_k: Tensor,
    k_a: Tensor,
    r_k: Tensor,
    dw: Tensor | None,
    dk_out: Tensor | None,
    dv_out: Tensor | None,
    da: Tensor | None,
    db: Tensor | None,
    dbonus: Tensor | None,
    dr_add: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: the forward's inputs, but its output w (the log-decay, whose σ it reads
    off, σ = -e^{1/2} w) in place of w_lora; the cotangents of (w, k', v', a, b, bonus), None where
    autograd gave none (read as zeros; dv_out None in the first layer); and dr_add, a gradient added
    into dr (None: nothing). Returns the gradients of the 13 inputs in order (w_lora's fourth), the
    parameters' [C], those of v_first, v_lora and v0 empty ([0]) in the first layer."""
    B, T, H, N = r.shape
    ins = [None if x is None else x.contiguous() for x in (r, k, v, w, a_lora, v_first, v_lora)]
    params = [None if p is None else p.contiguous() for p in (w0, a0, v0, k_k, k_a, r_k)]
    douts = [None if g is None else g.contiguous() for g in (dw, dk_out, dv_out, da, db, dbonus)]
    grads = _bwd_fake(r, k, v, w, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k, *douts, dr_add)
    present = sum(1 << i for i, g in enumerate(douts) if g is not None)
    fn = KERNEL.backward(r)
    residual = v_first is not None
    dra = None if dr_add is None else dr_add.contiguous()  # None, a null pointer: nothing to add
    fn(
        *_ptrs((*ins, *params, *douts), r),
        optional_ptr(dra),
        *_ptrs(grads, r),
        *(B * T, H, N, int(residual), present, threads(B * T)),
    )
    return grads


@rwkv7_prep_cpu_bwd.register_fake
def _bwd_fake(r, k, v, w, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k, *cotangents_and_dr_add):
    seq, C = r.shape, w0.shape[0]
    absent = (0,) if v_first is None else None
    return (
        *(r.new_empty(seq) for _ in range(5)),
        r.new_empty(absent or seq),
        r.new_empty(absent or seq),
        r.new_empty(C),
        r.new_empty(C),
        r.new_empty(absent or (C,)),
        *(r.new_empty(C) for _ in range(3)),
    )


class _Rwkv7PrepCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pass_r, r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k):
        inputs = (r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k)
        cdt = torch.float64 if r.dtype == torch.float64 else torch.float32
        ins = [None if x is None else x.detach().to(cdt).contiguous() for x in inputs]
        w, k_out, v_out, a, b, bonus = rwkv7_prep_cpu_fwd(*ins)
        # The backward recomputes the rest from the inputs, and w's σ from w itself, which wkv7 keeps
        # anyway (in fp32 the same tensor): w_lora is not kept.
        ctx.save_for_backward(*ins[:3], w, *ins[4:])
        ctx.dtypes = [None if x is None else x.dtype for x in inputs]
        ctx.pass_r = pass_r
        ctx.set_materialize_grads(False)
        outs = (w, k_out, v_out, a, b, bonus) if v_first is not None else (w, k_out, a, b, bonus)
        return (*(o.to(r.dtype) for o in outs), *((r,) if pass_r else ()))  # r as is: autograd views it

    @staticmethod
    def backward(ctx, *douts):
        ins = ctx.saved_tensors
        cdt = ins[0].dtype
        dr_add = douts[-1] if ctx.pass_r else None  # r's gradient from its other consumer: added into dr
        douts = douts[:-1] if ctx.pass_r else douts
        if ins[5] is None:  # the first layer: no v' output here (it is v itself)
            douts = (douts[0], douts[1], None, *douts[2:])
        douts = [None if g is None else g.to(cdt) for g in douts]
        grads = rwkv7_prep_cpu_bwd(*ins, *douts, None if dr_add is None else dr_add.to(cdt))
        return (None, *(None if dt is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes, strict=True)))


def rwkv7_prep_cpu(r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k, *, pass_r: bool = False):
    C = r.shape[-2] * r.shape[-1]
    residual = v_first is not None
    w0, a0, k_k, k_a, r_k = (p.reshape(C) for p in (w0, a0, k_k, k_a, r_k))
    v0 = v0.reshape(C) if residual else None
    outs = _Rwkv7PrepCPU.apply(pass_r, r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k)
    return prep_outputs(outs, residual, v, pass_r)
