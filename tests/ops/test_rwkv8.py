"""rwkv8 properties beyond the gradient-check gates (which run in test_gradcheck.py)."""

from dataclasses import replace

import pytest
import torch

from rwkvx_cli.ops import get_op, registry, resolve_backend, rwkv8
from rwkvx_cli.ops.rwkv8.cpu import CHUNK
from rwkvx_cli.ops.rwkv8.reference import EPS

SPEC = get_op("rwkv8")
PRODUCTION = [bk.name for bk in SPEC.production_backends()]
FAST = [name for name in PRODUCTION if name != "triton"]  # triton runs interpreted on CPU: tiny shapes only
NAMES = ("q", "v", "d", "rho", "rho_norm")


def make_inputs(B, T, H, L, E, Hv=None, seed=0, dtype=torch.float64, zero_state=False, decay=(0.5, 0.99)):
    g = torch.Generator().manual_seed(seed)

    def u(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)

    norm = u(B, H, L, lo=0.5, hi=2.5)
    x = {
        "q": u(B, T, H, L),
        "v": u(B, T, Hv or H, E, lo=-1.0),
        "d": u(H, L, lo=decay[0], hi=decay[1]),
        "rho": norm[..., None] * u(B, H, L, E, lo=-1.0),
        "rho_norm": norm,
    }
    if zero_state:
        x["rho"], x["rho_norm"] = torch.zeros_like(x["rho"]), torch.zeros_like(x["rho_norm"])
    return {n: t.to(dtype) for n, t in x.items()}


def run_with_grads(backend, x, seed=123):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    outs = rwkv8(*(leaves[n] for n in NAMES), backend=backend)
    g = torch.Generator().manual_seed(seed)
    sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum() for o in outs).backward()
    return tuple(o.detach() for o in outs), {n: leaves[n].grad for n in NAMES}


def assert_all_close(got, ref, rtol=1e-10, atol=1e-12):
    for name, a, b in zip(("y", "rho_out", "rho_norm_out"), got[0], ref[0], strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)
    for name in NAMES:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=10 * rtol, atol=10 * atol, msg=f"d{name}")


@pytest.mark.parametrize("backend", ["reference", *PRODUCTION])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_seed_test_vector(backend, dtype):
    """H = 1, L = 2, E = 2, decay 0.5, zero state (docs/operators.md#rwkv8)."""
    q = torch.tensor([[2.0, 0.0], [1.0, 3.0]], dtype=dtype).reshape(1, 2, 1, 2)
    v = torch.tensor([[10.0, 20.0], [30.0, 40.0]], dtype=dtype).reshape(1, 2, 1, 2)
    d = torch.full((1, 2), 0.5, dtype=dtype)
    y, rho, norm = rwkv8(q, v, d, backend=backend)
    # y_1 = q̃_1[0] ρ_0[0] / (n_0[0] + eps): 1/(4 + eps) * [20, 40]/(2 + eps); latent 1 has ρ_0 = 0
    y1 = torch.tensor([20.0, 40.0], dtype=torch.float64) / ((4 + EPS) * (2 + EPS))
    torch.testing.assert_close(y[0, 0, 0], torch.zeros(2, dtype=dtype), rtol=0, atol=0)
    torch.testing.assert_close(y[0, 1, 0].double(), y1, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
    torch.testing.assert_close(y[0, 1, 0].double(), torch.tensor([2.5, 5.0], dtype=torch.float64), rtol=1e-6, atol=0)
    assert rho.tolist() == [[[[40.0, 60.0], [90.0, 120.0]]]]
    assert norm.tolist() == [[[2.0, 3.0]]]


SHAPES = {
    "ragged": dict(B=2, T=2 * CHUNK + 5, H=3, L=8, E=6),  # T over several snapshot chunks
    "shared_value": dict(B=2, T=20, H=3, L=8, E=5, Hv=1),
    "model_size": dict(B=1, T=20, H=2, L=64, E=64),  # the compile-time paths of the cpu kernel
    "wide_value": dict(B=1, T=12, H=1, L=32, E=128, Hv=1),
    "zero_state": dict(B=1, T=20, H=2, L=8, E=4, zero_state=True),
    "fast_decay": dict(B=1, T=20, H=2, L=8, E=4, decay=(1e-4, 1e-2)),
    "no_decay": dict(B=1, T=20, H=2, L=8, E=4, decay=(1.0, 1.0)),
}


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp64_backend_equals_reference(backend, shape):
    x = make_inputs(**SHAPES[shape])
    assert_all_close(run_with_grads(backend, x), run_with_grads("reference", x))


@pytest.mark.parametrize("Hv", [1, 2])
def test_fp64_triton_equals_reference(Hv):
    if "triton" not in PRODUCTION or SPEC.backends["triton"].unavailable():
        pytest.skip("triton cannot run here")  # conftest sets TRITON_INTERPRET=1 on CPU
    x = make_inputs(1, 18, 2, 8, 4, Hv=Hv)  # T over two of its 16-step chunks
    assert_all_close(run_with_grads("triton", x), run_with_grads("reference", x))


@pytest.mark.parametrize("backend", FAST)
def test_fp32_matches_the_fp64_reference_at_the_model_size(backend):
    """Gate A judges element-wise at small sizes; at L = E = 64 the RMS ratio is the fair metric."""
    x = {n: t.float().double() for n, t in make_inputs(1, CHUNK + 3, 2, 64, 64).items()}
    ref = run_with_grads("reference", x)
    got = run_with_grads(backend, {n: t.float() for n, t in x.items()})

    def rms_ratio(a, b):
        return ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()

    for a, b in zip(got[0], ref[0], strict=True):
        assert rms_ratio(a, b) < 1e-5
    for name in NAMES:
        assert rms_ratio(got[1][name], ref[1][name]) < 1e-5, name


@pytest.mark.parametrize("backend", ["reference", *PRODUCTION])
def test_chained_segments_equal_one_run(backend):
    """Segments joined by state passing give the long run's outputs and gradients."""
    B, T, cut = (1, 12, 5) if backend == "triton" else (2, 41, 23)
    x = make_inputs(B, T, 2, 8, 4)
    full = run_with_grads(backend, x)

    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    y1, rho1, n1 = rwkv8(leaves["q"][:, :cut], leaves["v"][:, :cut], leaves["d"], leaves["rho"], leaves["rho_norm"],
                         backend=backend)  # fmt: skip
    y2, rho2, n2 = rwkv8(leaves["q"][:, cut:], leaves["v"][:, cut:], leaves["d"], rho1, n1, backend=backend)
    outs = (torch.cat([y1, y2], dim=1), rho2, n2)
    g = torch.Generator().manual_seed(123)
    sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum() for o in outs).backward()
    assert_all_close((tuple(o.detach() for o in outs), {n: leaves[n].grad for n in NAMES}), full)


@pytest.mark.parametrize("backend", FAST)
def test_a_shared_value_head_equals_the_same_values_in_every_head(backend):
    x = make_inputs(2, 10, 3, 8, 4, Hv=1)
    (y, rho, n), g = run_with_grads(backend, x)
    x_rep = {**x, "v": x["v"].expand(-1, -1, 3, -1).contiguous()}
    (y_rep, rho_rep, n_rep), g_rep = run_with_grads(backend, x_rep)
    torch.testing.assert_close(y, y_rep, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rho, rho_rep, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g["v"], g_rep["v"].sum(dim=2, keepdim=True), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", FAST)
def test_default_state_and_dtypes(backend):
    x = make_inputs(1, 6, 2, 4, 3, dtype=torch.float32)
    y, rho, n = rwkv8(x["q"], x["v"], x["d"], backend=backend)
    y0, rho0, n0 = rwkv8(x["q"], x["v"], x["d"], torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4), backend=backend)
    torch.testing.assert_close(y, y0, rtol=0, atol=0)
    assert y.shape == (1, 6, 2, 3) and y.dtype == torch.float32
    assert rho.shape == (1, 2, 4, 3) and rho.dtype == torch.float32 and n.shape == (1, 2, 4)
    q16, v16 = x["q"].to(torch.bfloat16), x["v"].to(torch.bfloat16)
    y16, rho16, _ = rwkv8(q16, v16, x["d"], backend=backend)  # an fp32 decay with bf16 activations
    assert y16.dtype == torch.bfloat16 and rho16.dtype == torch.float32


def _bad_calls():
    B, T, H, L, E = 1, 3, 2, 4, 5
    yield "q ndim", dict(q=torch.zeros(T, H, L)), "q must have 4 dimensions"
    yield "q integer", dict(q=torch.zeros(B, T, H, L, dtype=torch.int64)), "q must be a floating-point"
    yield "v heads", dict(v=torch.zeros(B, T, 3, E)), "v must have shape"
    yield "v time", dict(v=torch.zeros(B, T + 1, H, E)), "v must have shape"
    yield "v dtype", dict(v=torch.zeros(B, T, H, E, dtype=torch.float64)), "v has dtype"
    yield "v device", dict(v=torch.zeros(B, T, H, E, device="meta")), "v is on meta"
    yield "d shape", dict(d=torch.zeros(H, L + 1)), "d must have shape"
    yield "d not a tensor", dict(d=[0.5]), "d must be a torch.Tensor"
    yield "rho shape", dict(rho=torch.zeros(B, H, L, E + 1)), "rho must have shape"
    yield "rho_norm shape", dict(rho_norm=torch.zeros(B, H, L + 1)), "rho_norm must have shape"
    yield "rho_norm device", dict(rho_norm=torch.zeros(B, H, L, device="meta")), "rho_norm is on meta"
    yield "empty T", dict(q=torch.zeros(B, 0, H, L), v=torch.zeros(B, 0, H, E)), "every dimension >= 1"


@pytest.mark.parametrize("case", list(_bad_calls()), ids=lambda c: c[0])
def test_bad_arguments_raise_value_error(case):
    _, override, message = case
    args = {"q": torch.zeros(1, 3, 2, 4), "v": torch.zeros(1, 3, 2, 5), "d": torch.full((2, 4), 0.5)}
    args.update(override)
    with pytest.raises(ValueError, match=message):
        rwkv8(*(args.get(n) for n in NAMES))


def test_unknown_backend_names_the_valid_ones():
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match=f"valid: auto, {', '.join(SPEC.backends)}"):
        rwkv8(q, q, torch.ones(1, 4), backend="nope")


def test_auto_picks_the_cpu_kernel_on_cpu():
    expected = "chunked" if SPEC.backends["cpu"].unavailable() else "cpu"  # no compiler: the pure-torch form
    assert resolve_backend(SPEC, "auto", torch.device("cpu")).name == expected


def test_auto_falls_back_to_the_chunked_form_without_a_compiler(monkeypatch):
    broken = replace(SPEC.backends["cpu"], unavailable=lambda: "no compiler here")
    monkeypatch.setitem(SPEC.backends, "cpu", broken)
    monkeypatch.setattr(registry, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="'cpu' backend is unavailable \\(no compiler here\\); using 'chunked'"):
        assert resolve_backend(SPEC, "auto", torch.device("cpu")).name == "chunked"


@pytest.mark.parametrize(
    "shape",
    [
        dict(B=1, T=37, H=1, L=16, E=80, Hv=1),
        dict(B=1, T=37, H=1, L=16, E=80, Hv=1, zero_state=True),
        # two row blocks too, the last partial: ~20 s under the interpreter, in make test-slow
        pytest.param(dict(B=2, T=19, H=2, L=40, E=80, Hv=2), marks=pytest.mark.slow),
    ],
    ids=["init_state", "zero_state", "row_blocks"],
)
def test_fp64_triton_value_width_past_one_value_block(shape):
    """A value width over several value blocks, the last one partial (80 = 2 * 32 + 16), and a ragged
    T over three snapshot chunks: the per-block partials (y, dq, Σ dz z, dd, the norm's gradient)
    add up to the reference's, with and without an initial state."""
    if "triton" not in PRODUCTION or SPEC.backends["triton"].unavailable():
        pytest.skip("triton cannot run here")  # conftest sets TRITON_INTERPRET=1 on CPU
    x = make_inputs(**shape)
    assert_all_close(run_with_grads("triton", x), run_with_grads("reference", x))


def test_triton_refuses_a_size_it_cannot_index():
    if "triton" not in PRODUCTION or SPEC.backends["triton"].unavailable():
        pytest.skip("triton cannot run here")
    from rwkvx_cli.ops.rwkv8.fused_triton import index_offsets

    offsets = index_offsets(8, 4096, 64, 64, 4096)  # a shared value head at model width 4096
    assert offsets["state snapshots"] == 8 * 64 * 256 * 64 * 4096 - 1
    with pytest.raises(ValueError, match="rwkv8 triton: a program's tile offsets reach"):
        index_offsets(1, 16, 1, 2**16, 2**15)  # L * E = 2^31: past the int32 tile offsets
