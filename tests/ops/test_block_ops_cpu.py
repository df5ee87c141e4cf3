"""The fused block ops' C++ kernels (shift_mix's, relu²) where the registry-wide tests do not reach:
the result of every thread count, the residual gradient `dx_add`, absent output cotangents,
channel_mix's cpu backend under bf16 autocast, and both backends under torch.compile."""

import pytest
import torch

from rwkvx_cli.ops import channel_mix, get_op, shift_mix
from rwkvx_cli.ops.shift_mix import cpu as shift_mix_cpu

pytestmark = pytest.mark.skipif(shift_mix_cpu.unavailable() is not None, reason="no CPU kernels here")

B, T, C, M = 2, 100, 203, 3  # several threads' row ranges, starting inside a sequence; C not a multiple of a vector


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 0.3 + torch.randn(B, T, C, generator=gen, dtype=dtype)
    weight = 0.5 + torch.rand(C, generator=gen, dtype=dtype)
    bias = 0.2 * torch.randn(C, generator=gen, dtype=dtype)
    mix = torch.rand(M, C, generator=gen, dtype=dtype)
    state = torch.randn(B, C, generator=gen, dtype=dtype)
    dys = [torch.randn(B, T, C, generator=gen, dtype=dtype) for _ in range(M)]
    return (x, weight, bias, mix, state), dys, torch.randn(B, C, generator=gen, dtype=dtype)


def run(args, dys, ds, dx_add=None):
    x, weight, bias, mix, state = args
    args = (x, weight, bias, [*mix], state)  # the kernels take the M lerp weights as M tensors
    ys, s_out, mean, rstd = torch.ops.rwkvx.shift_mix_cpu_fwd(*args, 1e-5)
    grads = torch.ops.rwkvx.shift_mix_cpu_bwd(dys, ds, *args, mean, rstd, dx_add)
    return (*ys, s_out, mean, rstd), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_thread_count_changes_only_the_rounding_of_the_parameter_sums(threads, dtype):
    args, dys, ds = inputs(dtype)
    threads(1)
    outs1, grads1 = run(args, dys, ds)
    for n in (2, 3, 5):
        threads(n)
        outs, grads = run(args, dys, ds)
        for got, want in zip(outs, outs1, strict=True):  # rows are independent: exactly the same
            assert torch.equal(got, want), n
        tol = 1e-13 if dtype == torch.float64 else 1e-6  # fp64 sums either way
        for name, got, want in zip(("dx", "dweight", "dbias", "dmix", "dstate"), grads, grads1, strict=True):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{name}, {n} threads")


def test_dx_add_is_added_into_dx():
    args, dys, ds = inputs(torch.float64)
    dx_add = torch.randn(B, T, C, dtype=torch.float64)
    _, plain = run(args, dys, ds)
    _, added = run(args, dys, ds, dx_add)
    torch.testing.assert_close(added[0], plain[0] + dx_add, rtol=1e-14, atol=1e-14)
    for got, want in zip(added[1:], plain[1:], strict=True):
        assert torch.equal(got, want)


def test_an_absent_cotangent_is_a_zero_one():
    args, dys, ds = inputs(torch.float32)
    _, absent = run(args, [dys[0], None, dys[2]], None)
    _, zeros = run(args, [dys[0], torch.zeros_like(dys[1]), dys[2]], torch.zeros_like(ds))
    for got, want in zip(absent, zeros, strict=True):
        assert torch.equal(got, want)


def test_shift_mix_s_function_skips_the_unused_outputs():
    """Only y_1 used: its Function's backward gets None for the others and passes it on."""
    (x, *rest), _, _ = inputs(torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (x, *rest)]
    spec = get_op("shift_mix")
    (ys, _), (ys_ref, _) = (spec.backends[bk].fn(*leaves, eps=1e-5) for bk in ("cpu", "reference"))
    got = torch.autograd.grad(ys[1].sum(), leaves)
    want = torch.autograd.grad(ys_ref[1].sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_channel_mix_cpu_under_bf16_autocast():
    """The matmuls in bf16 (relu² then in torch: the kernels take fp32 and fp64), the rest fp32:
    within bf16's rounding of the composition under the same autocast."""
    spec = get_op("channel_mix")
    case = spec.cases[1]
    t = {n: v.float() for n, v in spec.sample(case, torch.Generator().manual_seed(3)).items()}
    results = []
    for bk in ("cpu", "reference"):
        leaves = {n: v.clone().requires_grad_(True) for n, v in t.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, s = spec.backends[bk].fn(*(leaves[n] for n in spec.inputs), leaves["state"], eps=1e-5)
        assert y.dtype == torch.float32 and s.dtype == torch.float32
        (y.square().sum() + s.sum()).backward()
        results.append((y.detach(), {n: v.grad for n, v in leaves.items()}))
    (y_c, g_c), (y_r, g_r) = results
    assert (y_c - y_r).norm() / y_r.norm() < 1e-2
    for n in g_r:
        assert (g_c[n] - g_r[n]).norm() / g_r[n].norm() < 3e-2, n


def test_relu2_kernels():
    h = torch.randn(3, 5, 37, dtype=torch.float64)
    h[0, 0, :3] = torch.tensor([0.0, -0.0, float("nan")])
    a = torch.ops.rwkvx.relu2_cpu_fwd(h)
    torch.testing.assert_close(a, torch.relu(h).square(), equal_nan=True)
    da = torch.randn_like(h)
    dh = torch.ops.rwkvx.relu2_cpu_bwd(da, a)
    torch.testing.assert_close(dh, 2 * torch.relu(h) * da, equal_nan=True)


def _block_loss(x, weight, bias, mix, state, key, value):
    ys, s = shift_mix(x, weight, bias, mix, state, backend="cpu")
    y, s2 = channel_mix(ys[0], weight, bias, mix[1], key, value, state, backend="cpu")
    return (ys[1] * ys[2]).sum() + s.sum() + y.square().sum() + s2.sum()  # y_0 reaches the loss through y only


@pytest.mark.slow  # an inductor compile: make test-slow (CI)
def test_both_backends_compile_in_one_graph_and_match_eager():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    c = 16
    args = [
        0.3 + torch.randn(2, 7, c, generator=gen),
        0.5 + torch.rand(c, generator=gen),
        0.1 * torch.randn(c, generator=gen),
        torch.rand(3, c, generator=gen),
        torch.randn(2, c, generator=gen),
        torch.randn(4 * c, c, generator=gen) / 4,
        torch.randn(c, 4 * c, generator=gen) / 8,
    ]
    args = [a.requires_grad_() for a in args]
    explained = torch._dynamo.explain(_block_loss)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    eager = _block_loss(*args)
    eager_grads = torch.autograd.grad(eager, args)
    compiled = torch.compile(_block_loss, fullgraph=True)(*args)
    compiled_grads = torch.autograd.grad(compiled, args)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_state_is_the_zero_state_for_shift_mix_and_channel_mix(dtype):
    """state=None: the cpu backends take it as the zero state (no tensor of zeros, no state gradient);
    the outputs and every other gradient equal an explicit zero state's, bit for bit."""
    (x, weight, bias, mix, _), dys, ds = inputs(dtype, seed=4)
    gen = torch.Generator().manual_seed(5)
    key = 0.1 * torch.randn(4 * C, C, generator=gen, dtype=dtype)
    value = 0.1 * torch.randn(C, 4 * C, generator=gen, dtype=dtype)
    dy = torch.randn(B, T, C, generator=gen, dtype=dtype)
    assert get_op("shift_mix").backends["cpu"].optional_state and get_op("channel_mix").backends["cpu"].optional_state

    def both(state):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias, mix, key, value)]
        (ys, s_out) = shift_mix(*leaves[:4], state, backend="cpu")
        y, c_out = channel_mix(*leaves[:3], leaves[3][0], leaves[4], leaves[5], state, backend="cpu")
        loss = sum((yi * g).sum() for yi, g in zip(ys, dys, strict=True)) + (s_out * ds).sum() + (y * dy).sum()
        (loss + (c_out * ds).sum()).backward()
        return [*ys, s_out, y, c_out], [t.grad for t in leaves]

    outs0, grads0 = both(torch.zeros(B, C, dtype=dtype))
    outs, grads = both(None)
    for a, b in zip(outs + grads, outs0 + grads0, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_frozen_channel_mix_weights_get_no_gradient_and_change_no_other(backend):
    """key and value without requires_grad (state tuning freezes every weight): the fused backward
    skips their two matmuls; every other gradient equals the one computed with them, bit for bit."""
    spec = get_op("channel_mix")
    t = spec.sample(spec.cases[1], torch.Generator().manual_seed(6))

    def grads(frozen):
        leaves = {n: v.clone().requires_grad_(n not in frozen) for n, v in t.items()}
        y, s = spec.backends[backend].fn(*(leaves[n] for n in spec.inputs), leaves["state"], eps=1e-5)
        (y.square().sum() + s.sum()).backward()
        return {n: v.grad for n, v in leaves.items()}

    full, frozen = grads(()), grads(("key", "value"))
    assert frozen["key"] is None and frozen["value"] is None
    assert full["key"] is not None and full["value"] is not None
    for n in set(full) - {"key", "value"}:
        assert torch.equal(frozen[n], full[n]), n
