"""Every backend that runs here gives the same gradients whatever the layout of what autograd hands
its backward: a strided cotangent, an expanded one (the gradient of `.sum()`), strided inputs and
states. The C++ backends copy such tensors to contiguous ones for their kernels; a copy made inside
the call that passes its pointer (`ptr(x.contiguous())`) is freed before the kernel reads it, which
gave wkv7's cpu backward a wrong gradient (off by 3.8 in fp64) for an expanded final-state cotangent."""

import pytest
import torch

from rwkvx_cli.ops import get_op, op_names, rwkv7_prep, shift_mix

DT = torch.float64


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (every other element of a buffer twice the size)."""
    if t.dim() == 0:
        return t
    return torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0]


def _cases():
    for name in op_names():
        spec = get_op(name)
        with_state = [c for c in spec.cases if c.nonzero_state]
        for case in (spec.cases[0], *with_state[:1]):
            for bk in spec.backends.values():
                if "cpu" in bk.devices and bk.unavailable() is None:
                    yield pytest.param(name, bk.name, case, id=f"{name}-{bk.name}-{case.name}")


def _run(spec, bk, case, tensors, cotangents, layout):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in tensors.items()}
    given = {n: _strided(t) if layout == "strided" else t for n, t in leaves.items()}
    y, states = spec.call(bk, given, case)
    pairs = [(o, c) for o, c in zip((*y, *states), cotangents, strict=True) if o.requires_grad]
    outs, cotangents = [o for o, _ in pairs], [c for _, c in pairs]
    if layout == "expanded":  # each cotangent a constant, handed over as an expanded scalar
        constants = [c.flatten()[:1].reshape(()).expand(o.shape) for o, c in zip(outs, cotangents, strict=True)]
        torch.autograd.backward(outs, constants)
    elif layout == "strided":
        torch.autograd.backward(outs, [_strided(c) for c in cotangents])
    else:
        torch.autograd.backward(outs, cotangents)
    return [o.detach() for o in (*y, *states)], {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize(("name", "backend", "case"), list(_cases()))
@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_gradients_do_not_depend_on_layouts(name, backend, case, layout):
    spec, gen = get_op(name), torch.Generator().manual_seed(0)
    bk = spec.backends[backend]
    tensors = {n: t.to(DT) for n, t in spec.sample(case, gen).items()}
    tensors = {n: (None if n in case.absent else t) for n, t in tensors.items()}
    tensors = {n: t for n, t in tensors.items() if t is not None}
    y, states = spec.call(bk, tensors, case)
    cotangents = [torch.rand(o.shape, generator=gen, dtype=o.dtype) - 0.5 for o in (*y, *states)]
    if layout == "expanded":
        cotangents = [torch.full_like(c, c.flatten()[0].item()) if c.numel() else c for c in cotangents]
    ref_out, ref_grads = _run(spec, bk, case, tensors, cotangents, "contiguous")
    out, grads = _run(spec, bk, case, tensors, cotangents, layout)
    for a, b in zip(out, ref_out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for n in ref_grads:
        if ref_grads[n] is None:
            assert grads[n] is None, n
        else:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-12, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")


def _passthrough_grads(fn, inputs, layout):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    outs = fn(*leaves)
    gen = torch.Generator().manual_seed(3)
    cots = [torch.rand(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    if layout == "strided":
        cots = [_strided(c) for c in cots]
    torch.autograd.backward(list(outs), cots)
    return [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("op", ["shift_mix", "rwkv7_prep"])
def test_passed_on_outputs_take_strided_cotangents(op):
    """shift_mix(residual=True) and rwkv7_prep(pass_r=True) add the cotangent of what they pass on
    (x, r) inside their backward kernels: that cotangent strided gives the same gradients."""
    spec, gen = get_op(op), torch.Generator().manual_seed(1)
    case = spec.cases[0]
    tensors = {n: t.to(DT) for n, t in spec.sample(case, gen).items()}
    if op == "shift_mix":
        x, weight, bias, mix, state = (tensors[n] for n in (*spec.inputs, *spec.states))

        def fn(x, weight, bias, mix, state):
            ys, s_out, x_on = shift_mix(x, weight, bias, mix, state, residual=True, backend="cpu")
            return (*ys, s_out, x_on)

        inputs = [x, weight, bias, mix, state]
    else:
        inputs = [tensors[n] for n in spec.inputs]

        def fn(*args):
            return rwkv7_prep(*args, pass_r=True, backend="cpu")

    if spec.backends["cpu"].unavailable() is not None:
        pytest.skip("no CPU kernels here")
    plain, strided = _passthrough_grads(fn, inputs, "contiguous"), _passthrough_grads(fn, inputs, "strided")
    for a, b in zip(strided, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
