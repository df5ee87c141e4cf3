"""What the `cpu` and `triton` backends of channel_mix share: one autograd Function around the two
matmuls (torch's: MKL/oneDNN on the CPU, cuBLAS on CUDA) and a backend's elementwise kernels:

    shift_fwd(x, weight, bias, mix [1, C], state, eps, starts) -> (x_k, state_out, mean, rstd)
        (state None, only from a backend with Backend.optional_state: the zero state; starts
        None or bool [B, T], the document starts)
        shift_mix's forward kernel with one lerp: x_k in the compute dtype, the LayerNorm's
        per-row mean and 1/std [B, T] kept for the backward
    shift_bwd(dx_k, dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add, starts)
        -> (dx, dweight, dbias, dmix [1, C], dstate)
        its backward, with the residual's gradient dx_add added into dx; dstate_out may be None
        (the state out unused: zero)
    relu2_fwd(h) -> relu(h)²            relu2_bwd(da, a) -> 2 sqrt(a) da

The forward keeps x (the block's residual stream, alive anyway), the LayerNorm's statistics, x_k
and a = relu(h)² (what the two weight gradients need) and nothing of h: relu²'s gradient is
taken from its output, 2 relu(h) = 2 sqrt(a), as RWKV-LM's channel-mix kernel does. Under
autocast the matmuls run in its dtype (x_k, a and the weights cast once, in the forward) and the
residual sum in x's; the elementwise kernels always run in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Kernels(NamedTuple):
    shift_fwd: object
    shift_bwd: object
    relu2_fwd: object
    relu2_bwd: object


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would run in here: autocast's when it is on for x's device, else x's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class ChannelMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mix, key, value, state, starts, eps, kernels: Kernels):
        B, T, C = x.shape
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        mm = matmul_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            params = [p.detach().to(cdt).contiguous() for p in (weight, bias, mix.reshape(1, C))]
            s0 = None if state is None else state.detach().to(cdt).contiguous()  # None: zeros (a cpu kernel's)
            xd = x.detach().contiguous()
            xk, s_out, mean, rstd = kernels.shift_fwd(xd, *params, s0, eps, starts)
            xk = xk.view(B * T, C).to(mm)
            kw, vw = key.detach().to(mm), value.detach().to(mm)
            a = kernels.relu2_fwd(xk @ kw.t())
            if mm == x.dtype:
                y = torch.addmm(xd.view(B * T, C), a, vw.t())
            else:  # the residual sum in x's dtype (fp32 under bf16 autocast), as x + ffn(...) is
                y = xd.view(B * T, C) + a @ vw.t()
        ctx.save_for_backward(xd, *params, s0, starts, mean, rstd, xk, a, kw, vw)
        ctx.eps, ctx.kernels = eps, kernels
        state_dtype = None if state is None else state.dtype
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype, mix.dtype, key.dtype, value.dtype, state_dtype)
        ctx.mix_shape = mix.shape
        ctx.set_materialize_grads(False)  # an unused state_out's cotangent stays None (shift_bwd reads no zeros)
        return y.view(B, T, C).to(x.dtype), s_out

    @staticmethod
    def backward(ctx, dy, ds_out):
        x, weight, bias, mix, s0, starts, mean, rstd, xk, a, kw, vw = ctx.saved_tensors
        B, T, C = x.shape
        k = ctx.kernels
        cdt = weight.dtype
        dy = torch.zeros_like(x) if dy is None else dy
        dy = dy.reshape(B * T, C)
        dy_mm = dy.to(xk.dtype)
        # The two weight matmuls run only where autograd asks for those gradients (state tuning
        # freezes every weight: then they are a third of this backward's matmul work).
        key_grad, value_grad = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        da = dy_mm @ vw
        dvalue = dy_mm.t() @ a if value_grad else None
        dh = k.relu2_bwd(da, a)
        dxk = (dh @ kw).to(cdt).view(B, T, C)
        dkey = dh.t() @ xk if key_grad else None
        ds_out = None if ds_out is None else ds_out.to(cdt).contiguous()
        dx, dweight, dbias, dmix, dstate = k.shift_bwd(
            dxk, ds_out, x, weight, bias, mix, s0, mean, rstd, dy.to(cdt).view(B, T, C), starts
        )
        grads = (dx, dweight, dbias, dmix.view(ctx.mix_shape), dkey, dvalue, dstate)
        grads = (None if dt is None or g is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes, strict=True))
        return (*grads, None, None, None)


def channel_mix_with(kernels: Kernels):
    """A channel_mix backend function over these kernels."""

    def fn(x, weight, bias, mix, key, value, state, *, eps: float = 1e-5, starts=None):
        return ChannelMix.apply(x, weight, bias, mix, key, value, state, starts, eps, kernels)

    return fn
