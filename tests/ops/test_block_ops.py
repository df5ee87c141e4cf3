"""The fused block ops (shift_mix, rwkv7_prep, rwkv7_out, channel_mix): what the registry-wide tests
(both gradient-check gates on every backend, bench, the compile gate) do not already cover.

The backward math of shift_mix, written out here in torch as the kernels compute it (checked
against autograd's), and the channel_mix Function (ops/channel_mix/fused.py) over these torch
kernels: its matmuls, its relu² gradient from the output, its autocast handling."""

import pytest
import torch
import torch.nn.functional as F

from rwkvx_cli.ops import get_op
from rwkvx_cli.ops.channel_mix.fused import Kernels, channel_mix_with
from rwkvx_cli.tools.gradcheck import gate_a, gate_b


def _keep(starts, x):
    """1 where x̂[t-1] carries into t, 0 where t starts a document ([B, T, 1])."""
    return torch.ones_like(x[..., :1]) if starts is None else (~starts)[..., None].to(x.dtype)


def shift_fwd(x, weight, bias, mix, state, eps, starts=None):
    """shift_mix's forward as its kernels compute it: LayerNorm statistics, x̂, the lerps."""
    mean = x.mean(-1)
    var = (x - mean[..., None]).pow(2).mean(-1)
    rstd = torch.rsqrt(var + eps)
    xn = (x - mean[..., None]) * rstd[..., None] * weight + bias
    prev = torch.cat([state[:, None], xn[:, :-1]], dim=1) * _keep(starts, x)
    ys = [xn + (prev - xn) * mix[m] for m in range(mix.shape[0])]
    return ys, xn[:, -1].clone(), mean, rstd


def shift_bwd(dys, dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add=None, starts=None):
    """Its backward, by hand: with n = (x - mean) rstd, x̂ = n weight + bias, k[t] = 0 where t
    starts a document (else 1) and y_m[t] = x̂[t] (1 - mix_m) + k[t] x̂[t-1] mix_m,

        dx̂[t]  = Σ_m dy_m[t] (1 - mix_m) + k[t+1] Σ_m dy_m[t+1] mix_m   (+ dstate_out at t = T-1)
        dmix_m = Σ_{b,t} dy_m[t] (k[t] x̂[t-1] - x̂[t])                  dstate = k[0] Σ_m dy_m[0] mix_m
        dweight = Σ dx̂ n    dbias = Σ dx̂    g = dx̂ weight
        dx = rstd (g - mean_C(g) - n mean_C(g n))                         (+ dx_add)"""
    n = (x - mean[..., None]) * rstd[..., None]
    xn = n * weight + bias
    keep = _keep(starts, x)
    prev = torch.cat([state[:, None], xn[:, :-1]], dim=1) * keep
    dxn = sum(dy * (1 - m) for dy, m in zip(dys, mix, strict=True))
    nxt = sum(dy[:, 1:] * m for dy, m in zip(dys, mix, strict=True)) * keep[:, 1:]
    dxn = dxn + F.pad(nxt, (0, 0, 0, 1))
    dxn[:, -1] += dstate_out
    dmix = torch.stack([(dy * (prev - xn)).sum((0, 1)) for dy in dys])
    dstate = sum(dy[:, 0] * m for dy, m in zip(dys, mix, strict=True)) * keep[:, 0]
    dweight, dbias = (dxn * n).sum((0, 1)), dxn.sum((0, 1))
    g = dxn * weight
    dx = rstd[..., None] * (g - g.mean(-1, keepdim=True) - n * (g * n).mean(-1, keepdim=True))
    if dx_add is not None:
        dx = dx + dx_add
    return dx, dweight, dbias, dmix, dstate


def _shift_fwd1(x, weight, bias, mix, state, eps, starts):
    ys, s_out, mean, rstd = shift_fwd(x, weight, bias, mix, state, eps, starts)
    return ys[0], s_out, mean, rstd


def _shift_bwd1(dxk, dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add, starts):
    return shift_bwd([dxk], dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add, starts)


TORCH_KERNELS = Kernels(
    _shift_fwd1,
    _shift_bwd1,
    lambda h: torch.relu(h).square(),
    lambda da, a: 2 * a.sqrt() * da,
)


@pytest.mark.parametrize("with_starts", [False, True])
def test_the_shift_mix_backward_by_hand_is_autograd_s(with_starts):
    spec = get_op("shift_mix")
    gen = torch.Generator().manual_seed(0)
    case = next(c for c in spec.cases if c.starts) if with_starts else spec.cases[2]
    starts = case.starts_mask()
    t = {n: v.requires_grad_(True) for n, v in spec.sample(case, gen).items()}
    ys, s_out = spec.backends["reference"].fn(
        t["x"], t["weight"], t["bias"], t["mix"], t["state"], eps=1e-5, starts=starts
    )
    dys = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ys]
    ds = torch.randn(s_out.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad([*ys, s_out], [t[n] for n in ("x", "weight", "bias", "mix", "state")], [*dys, ds])
    with torch.no_grad():
        _, _, mean, rstd = shift_fwd(t["x"], t["weight"], t["bias"], t["mix"], t["state"], 1e-5, starts)
        got = shift_bwd(dys, ds, t["x"], t["weight"], t["bias"], t["mix"], t["state"], mean, rstd, starts=starts)
    for name, g, w in zip(("x", "weight", "bias", "mix", "state"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def test_the_channel_mix_function_passes_both_gates_over_torch_kernels():
    spec = get_op("channel_mix")
    from rwkvx_cli.ops.registry import Backend

    bk = Backend("torch_kernels", channel_mix_with(TORCH_KERNELS), "the Function over torch kernels", resets=True)
    for i, case in enumerate(spec.cases):
        result = gate_a(spec, bk, case, seed=i)
        assert result.passed, [(c.name, c.max_rel) for c in result.columns if not c.passed]
    result = gate_b(spec, bk, spec.fd_case, seed=0)
    assert result.passed, [(c.name, c.max_rel) for c in result.columns if not c.passed]


def test_the_channel_mix_function_follows_autocast_as_the_composition_does():
    """Under bf16 autocast: the matmuls in bf16, the residual sum and the state in fp32, and values
    and gradients within bf16's rounding of the torch composition's under the same autocast."""
    spec = get_op("channel_mix")
    case = spec.cases[1]
    t = {n: v.float() for n, v in spec.sample(case, torch.Generator().manual_seed(3)).items()}
    fused = channel_mix_with(TORCH_KERNELS)
    ref = spec.backends["reference"].fn
    results = []
    for fn in (fused, ref):
        leaves = {n: v.clone().requires_grad_(True) for n, v in t.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, s = fn(*(leaves[n] for n in spec.inputs), leaves["state"], eps=1e-5)
        assert y.dtype == torch.float32 and s.dtype == torch.float32
        (y.square().sum() + s.sum()).backward()
        results.append((y.detach(), {n: v.grad for n, v in leaves.items()}))
    (y_f, g_f), (y_r, g_r) = results
    assert (y_f - y_r).norm() / y_r.norm() < 1e-2
    for n in g_r:
        assert (g_f[n] - g_r[n]).norm() / g_r[n].norm() < 3e-2, n


def test_shift_mix_passes_the_residual_stream_on_with_its_gradient():
    """residual=True: every backend also returns x itself, and a block's `x + f(y)` through that output has the
    reference's values and gradients (the kernels add the residual's gradient into dx); x reaches them once."""
    from rwkvx_cli.ops import shift_mix

    spec = get_op("shift_mix")
    gen = torch.Generator().manual_seed(7)
    case = spec.cases[0]
    tensors = spec.sample(case, gen)
    proj = torch.randn(tensors["x"].shape[-1], tensors["x"].shape[-1], generator=gen, dtype=torch.float64)

    def block(backend, dtype):
        leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in tensors.items()}
        ys, s_out, x_res = shift_mix(*(leaves[n] for n in spec.inputs), leaves["state"], residual=True, backend=backend)
        assert x_res.data_ptr() == leaves["x"].data_ptr()  # x itself, no copy
        out = x_res + sum(y * (i + 1) for i, y in enumerate(ys)) @ proj.to(dtype)
        ((out * out.detach().sin()).sum() + s_out.sum()).backward()
        return out.detach().double(), {n: t.grad.double() for n, t in leaves.items()}

    def near(got, want, tol):  # against the largest magnitude: these sums run into the hundreds
        return (got - want).abs().max() <= tol * want.abs().max()

    want, want_grads = block("reference", torch.float64)
    for name in spec.production_backends():
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
            got, grads = block(name.name, dtype)
            assert near(got, want, tol), (name.name, dtype)
            for n, g in grads.items():
                assert near(g, want_grads[n], tol), (name.name, dtype, n)


def test_shift_mix_takes_the_lerp_weights_as_separate_tensors():
    """mix as M tensors of C values (the model's [1, 1, C] parameters, with no cat of them): the same outputs as the
    stacked [M, C] tensor on every backend, and each tensor's gradient in its own shape (a row of the stacked one's)."""
    from rwkvx_cli.ops import shift_mix

    spec = get_op("shift_mix")
    tensors = spec.sample(spec.cases[0], torch.Generator().manual_seed(8))
    M, C = tensors["mix"].shape
    cot = torch.randn(M, *tensors["x"].shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for bk in spec.backends.values():
        if not bk.production and bk.name != "reference":
            continue
        x, w, b, s = (tensors[n].detach().clone().requires_grad_() for n in ("x", "weight", "bias", "state"))
        stacked = tensors["mix"].detach().clone().requires_grad_()
        ys, s_out = shift_mix(x, w, b, stacked, s, backend=bk.name)
        (sum((y * c).sum() for y, c in zip(ys, cot, strict=True)) + s_out.sum()).backward()
        parts = [tensors["mix"][m].detach().clone().view(1, 1, C).requires_grad_() for m in range(M)]
        x2, w2, b2, s2 = (tensors[n].detach().clone().requires_grad_() for n in ("x", "weight", "bias", "state"))
        ys2, s_out2 = shift_mix(x2, w2, b2, parts, s2, backend=bk.name)
        (sum((y * c).sum() for y, c in zip(ys2, cot, strict=True)) + s_out2.sum()).backward()
        got = (*ys2, s_out2, x2.grad, w2.grad, b2.grad, s2.grad)
        for a, b_ in zip((*ys, s_out, x.grad, w.grad, b.grad, s.grad), got, strict=True):
            assert torch.equal(a, b_), bk.name
        for m, p in enumerate(parts):
            assert p.grad.shape == (1, 1, C) and torch.equal(p.grad.view(C), stacked.grad[m]), (bk.name, m)


def test_rwkv7_prep_passes_r_on_with_its_gradient():
    """pass_r=True: every backend also returns r itself, and a time mix that feeds that r to another op (wkv7 in
    the model; a product here) has the reference's values and gradients: the kernels add the other op's gradient
    of r into dr. With and without the value residual (the first layer)."""
    from rwkvx_cli.ops import rwkv7_prep

    spec = get_op("rwkv7_prep")
    for case in spec.cases[:2]:
        tensors = spec.sample(case, torch.Generator().manual_seed(10))
        probe = torch.randn(tensors["r"].shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)

        def run(backend, dtype, case=case, tensors=tensors, probe=probe):
            leaves = {
                n: None if n in case.absent else tensors[n].detach().to(dtype).requires_grad_() for n in spec.inputs
            }
            *outs, r = rwkv7_prep(*(leaves[n] for n in spec.inputs), pass_r=True, backend=backend)
            assert r.data_ptr() == leaves["r"].data_ptr()  # r itself, no copy
            p = probe.to(dtype)
            (sum((o * (i + 1) * p).sum() for i, o in enumerate(outs)) + (r * r * p).sum()).backward()
            return {n: t.grad.double() for n, t in leaves.items() if t is not None}

        want = run("reference", torch.float64)
        for bk in spec.production_backends():
            for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
                got = run(bk.name, dtype)
                for n, g in got.items():
                    assert (g - want[n]).abs().max() <= tol * want[n].abs().max(), (bk.name, dtype, case.name, n)
