"""gdn and kda (the gated delta rule) beyond the gradient-check gates: every backend
against the fp64 oracle, the oracle against the formula, gdn == kda with a broadcast
gate, state chaining, the default scale, and argument checks."""

import math
from dataclasses import replace

import pytest
import torch

from rwkvx_cli.ops import gdn, get_op, kda, registry, resolve_backend
from rwkvx_cli.ops.delta import cpu as delta_cpu_module
from rwkvx_cli.ops.delta.chunked import delta_chunked
from rwkvx_cli.ops.delta.reference import delta_reference

OPS = {"gdn": gdn, "kda": kda}
NAMES = ("q", "k", "v", "g", "beta")
PRODUCTION = ["cpu", "triton", "chunked"]
assert [bk.name for bk in get_op("gdn").production_backends()] == PRODUCTION
assert [bk.name for bk in get_op("kda").production_backends()] == PRODUCTION


def make_inputs(op, B, T, H, N, seed=0, dtype=torch.float64, gate=(-0.7, 0.0)):
    gen = torch.Generator().manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    def u(shape, lo=-0.5, hi=0.5):
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)

    x = {
        "q": torch.nn.functional.normalize(randn(B, T, H, N), dim=-1),
        "k": torch.nn.functional.normalize(randn(B, T, H, N), dim=-1),
        "v": u((B, T, H, N)),
        "g": u((B, T, H, N) if op == "kda" else (B, T, H), *gate),
        "beta": u((B, T, H), 0.0, 1.0),
    }
    state = 0.3 * randn(B, H, N, N)
    return {n: t.to(dtype) for n, t in x.items()}, state.to(dtype)


def run_with_grads(op, backend, x, state, scale=None, seed=123):
    """y, state_out and the gradients of a random linear loss on both, including the initial state's."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    s0 = state.clone().requires_grad_()
    y, s = OPS[op](*(leaves[n] for n in NAMES), s0, scale=scale, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    cot_y = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype)
    cot_s = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    ((y * cot_y).sum() + (s * cot_s).sum()).backward()
    grads = {n: leaves[n].grad for n in NAMES}
    grads["state"] = s0.grad
    return y.detach(), s.detach(), grads


def assert_matches(got, ref, rtol=1e-10, atol=1e-12):
    y, s, g = got
    y_ref, s_ref, g_ref = ref
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol, msg="y")
    torch.testing.assert_close(s, s_ref, rtol=rtol, atol=atol, msg="state_out")
    assert set(g) == set(g_ref) == {*NAMES, "state"}
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=rtol, atol=atol, msg=f"d{name}")


def test_reference_follows_the_formula():
    """Two steps of the oracle against the recurrence written out element by element."""
    B, T, H, N = 1, 2, 1, 3
    for op in OPS:
        x, state = make_inputs(op, B, T, H, N, seed=1)
        y, s = delta_reference(*(x[n] for n in ("q", "k", "v")), _gate4(op, x["g"]), x["beta"], state, 0.7)
        S = [[state[0, 0, i, j].item() for j in range(N)] for i in range(N)]
        for t in range(T):
            q, k, v = (x[n][0, t, 0].tolist() for n in ("q", "k", "v"))
            beta = x["beta"][0, t, 0].item()
            a = [math.exp(x["g"][0, t, 0, i].item() if op == "kda" else x["g"][0, t, 0].item()) for i in range(N)]
            P = [[a[i] * S[i][j] for j in range(N)] for i in range(N)]
            m = [sum(P[i][j] * k[i] for i in range(N)) for j in range(N)]
            u = [beta * (v[j] - m[j]) for j in range(N)]
            S = [[P[i][j] + k[i] * u[j] for j in range(N)] for i in range(N)]
            y_t = [0.7 * sum(S[i][j] * q[i] for i in range(N)) for j in range(N)]
            torch.testing.assert_close(y[0, t, 0], torch.tensor(y_t, dtype=torch.float64), rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(s[0, 0], torch.tensor(S, dtype=torch.float64), rtol=1e-13, atol=1e-15)


def _gate4(op, g):
    return g if op == "kda" else g.unsqueeze(-1)


# T spans several snapshot chunks (16 steps for Triton, 64 for the cpu kernel at
# these N) with a ragged tail; N = 40 > 32 gives the Triton kernels two value-column
# blocks and a masked key range. The Triton interpreter runs a few ms per op and
# step, so its shapes are smaller.
FP64_CASES = [
    ("ragged", (2, 37, 2, 8), (2, 21, 1, 8), (-0.7, 0.0)),
    ("long", (1, 150, 2, 8), (1, 35, 1, 8), (-0.7, 0.0)),  # the cpu kernel's 64-step snapshots: 3 chunks
    ("blocks", (1, 21, 1, 40), (1, 21, 1, 40), (-0.7, 0.0)),
    ("gate_near_0", (1, 20, 2, 8), (1, 18, 1, 8), (-30.0, -10.0)),  # A down to e^-30: nothing divides by A
    ("gate_1", (1, 20, 2, 8), (1, 18, 1, 8), (0.0, 0.0)),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", PRODUCTION)
@pytest.mark.parametrize("name,shape,triton_shape,gate", FP64_CASES, ids=[c[0] for c in FP64_CASES])
def test_fp64_backend_equals_reference(op, backend, name, shape, triton_shape, gate):
    x, state = make_inputs(op, *(triton_shape if backend == "triton" else shape), gate=gate)
    ref = run_with_grads(op, "reference", x, state)
    assert_matches(run_with_grads(op, backend, x, state), ref)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("chunk_size", [None, 1, 8, 64])
def test_chunked_any_chunk_size_equals_reference(op, chunk_size):
    """Several chunks, a padded last chunk (T = 70 is not a multiple of 8 or 64);
    None is the default (64 for gdn, 8 for kda)."""
    x, state = make_inputs(op, 1, 70, 2, 8, seed=3)

    def fn(q, k, v, g, beta, s):
        return delta_chunked(q, k, v, _gate4(op, g), beta, s, 0.3, chunk_size=chunk_size)

    leaves = [t.clone().requires_grad_() for t in (*(x[n] for n in NAMES), state)]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y, s = fn(*leaves)
    y_ref, s_ref = delta_reference(*ref_leaves[:3], _gate4(op, ref_leaves[3]), *ref_leaves[4:], 0.3)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-12)
    gen = torch.Generator().manual_seed(0)
    cot = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (y, s)]
    torch.autograd.backward((y, s), cot)
    torch.autograd.backward((y_ref, s_ref), cot)
    for a, b in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["cpu", "chunked", "triton"])
def test_fp32_head_64_matches_the_fp64_reference(op, backend):
    """The model's head size in fp32, by the RMS ratio (gate A's cases keep N = 16)."""
    T, H = (12, 1) if backend == "triton" else (40, 2)
    x, state = make_inputs(op, 1, T, H, 64, seed=4)
    x = {n: t.float().double() for n, t in x.items()}
    state = state.float().double()
    y_ref, s_ref, g_ref = run_with_grads(op, "reference", x, state)
    y, s, g = run_with_grads(op, backend, {n: t.float() for n, t in x.items()}, state.float())

    def rms_ratio(got, ref):
        return ((got.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()

    assert y.dtype == torch.float32 and s.dtype == torch.float32
    assert rms_ratio(y, y_ref) < 1e-5 and rms_ratio(s, s_ref) < 1e-5
    for name in g_ref:
        assert g[name].dtype == torch.float32
        assert rms_ratio(g[name], g_ref[name]) < 1e-5, name


@pytest.mark.parametrize("backend", ["reference", "cpu", "chunked", "triton"])
def test_gdn_is_kda_with_the_gate_broadcast(backend):
    x, state = make_inputs("gdn", 2, 19, 1, 8, seed=5)
    y, s, g = run_with_grads("gdn", backend, x, state)
    x_kda = {**x, "g": x["g"][..., None].expand(-1, -1, -1, 8).contiguous()}
    y_k, s_k, g_k = run_with_grads("kda", backend, x_kda, state)
    torch.testing.assert_close(y, y_k, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s, s_k, rtol=1e-12, atol=1e-14)
    for name in ("q", "k", "v", "beta", "state"):
        torch.testing.assert_close(g[name], g_k[name], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g["g"], g_k["g"].sum(-1), rtol=1e-10, atol=1e-13)  # dL/dg = Σ_i dL/dg_i


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["reference", "cpu", "chunked", "triton"])
def test_chained_segments_equal_one_run(op, backend):
    """Segments joined by state passing give the long run's outputs and gradients."""
    x, state = make_inputs(op, 1, 23, 1, 8, seed=6)
    y_full, s_full, g_full = run_with_grads(op, backend, x, state)

    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    s0 = state.clone().requires_grad_()
    cut = 9  # the first segment ends inside a snapshot chunk
    y1, s1 = OPS[op](*(leaves[n][:, :cut] for n in NAMES), s0, backend=backend)
    y2, s2 = OPS[op](*(leaves[n][:, cut:] for n in NAMES), s1, backend=backend)
    y = torch.cat([y1, y2], dim=1)
    gen = torch.Generator().manual_seed(123)
    cot_y = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    cot_s = torch.randn(s2.shape, generator=gen, dtype=torch.float64)
    ((y * cot_y).sum() + (s2 * cot_s).sum()).backward()

    torch.testing.assert_close(y.detach(), y_full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s2.detach(), s_full, rtol=1e-10, atol=1e-12)
    for name in NAMES:
        torch.testing.assert_close(leaves[name].grad, g_full[name], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(s0.grad, g_full["state"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["reference", "cpu", "chunked"])
def test_scale_defaults_to_inverse_sqrt_n_and_applies_to_q_only(op, backend):
    N = 9
    x, state = make_inputs(op, 1, 7, 2, N, seed=7)
    args = [x[n] for n in NAMES]
    y_default, s_default = OPS[op](*args, state, backend=backend)
    y_third, s_third = OPS[op](*args, state, scale=1 / 3, backend=backend)
    torch.testing.assert_close(y_default, y_third, rtol=0, atol=0)
    y_one, s_one = OPS[op](*args, state, scale=1.0, backend=backend)
    torch.testing.assert_close(y_default, y_one / 3, rtol=1e-13, atol=1e-15)
    y_q, s_q = OPS[op](x["q"] * 2.5, *args[1:], state, scale=1.0, backend=backend)
    torch.testing.assert_close(y_q, 2.5 * y_one, rtol=1e-13, atol=1e-15)
    for s in (s_third, s_one, s_q):  # the state never sees the scale
        torch.testing.assert_close(s, s_default, rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["cpu", "chunked"])
def test_default_state_dtypes(op, backend):
    x, _ = make_inputs(op, 1, 5, 2, 4, dtype=torch.float32)
    y, s = OPS[op](*(x[n] for n in NAMES), backend=backend)
    assert y.dtype == torch.float32 and s.dtype == torch.float32 and s.shape == (1, 2, 4, 4)
    y_ref, s_ref = OPS[op](*(x[n] for n in NAMES), torch.zeros(1, 2, 4, 4), backend="reference")
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(s, s_ref)
    y16, s16 = OPS[op](*(x[n].to(torch.bfloat16) for n in NAMES), backend=backend)
    assert y16.dtype == torch.bfloat16 and s16.dtype == torch.float32


@pytest.mark.parametrize("op", OPS)
def test_cpu_backward_memory_is_snapshots_not_every_state(op):
    """Saved for backward: q, k, the gates, β, w and one state per chunk, O(T N) + O(T/chunk N²)."""
    B, T, H, N = 1, 128, 2, 16
    x, state = make_inputs(op, B, T, H, N, dtype=torch.float32)
    leaves = [x[n].requires_grad_() for n in NAMES]
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        OPS[op](*leaves, state.requires_grad_(), backend="cpu")
    chunk = delta_cpu_module.chunk_size(N, 4)
    assert chunk == 64
    budget = B * H * (T // chunk + 1) * N * N + 6 * B * T * H * N
    assert sum(storages.values()) // 4 <= budget


def test_auto_picks_the_cpu_kernel_on_cpu():
    for op in OPS:
        assert resolve_backend(get_op(op), "auto", torch.device("cpu")).name == "cpu"


@pytest.mark.parametrize("op", OPS)
def test_auto_falls_back_to_chunked_without_a_compiler(op, monkeypatch):
    spec = get_op(op)
    monkeypatch.setitem(spec.backends, "cpu", replace(spec.backends["cpu"], unavailable=lambda: "no compiler here"))
    monkeypatch.setattr(registry, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="'cpu' backend is unavailable \\(no compiler here\\); using 'chunked'"):
        assert resolve_backend(spec, "auto", torch.device("cpu")).name == "chunked"


def test_cpu_kernel_rejects_head_sizes_beyond_its_vectors():
    x, state = make_inputs("gdn", 1, 1, 1, 257)
    with pytest.raises(ValueError, match="head sizes up to 512 \\(fp32\\) / 256 \\(fp64\\), got N = 257"):
        gdn(*(x[n] for n in NAMES), state, backend="cpu")


def _bad_calls(op):
    B, T, H, N = 1, 3, 2, 4
    g_shape = (B, T, H, N) if op == "kda" else (B, T, H)
    yield "shape", dict(k=torch.zeros(B, T, H, N + 1)), "k has shape"
    yield "dtype", dict(v=torch.zeros(B, T, H, N, dtype=torch.float64)), "v has dtype"
    yield "device", dict(q=torch.zeros(B, T, H, N, device="meta")), "k is on cpu but q is on meta"
    yield "ndim", dict(q=torch.zeros(T, H, N)), "q must have 4 dimensions"
    yield "g shape", dict(g=torch.zeros(B, T, H, N + 1)), "g must have shape"
    yield "g dtype", dict(g=torch.zeros(g_shape, dtype=torch.float64)), "g has dtype"
    yield "g integer", dict(g=torch.zeros(g_shape, dtype=torch.int64)), "g must be a floating-point"
    yield "g device", dict(g=torch.zeros(g_shape, device="meta")), "g is on meta"
    yield "beta shape", dict(beta=torch.zeros(B, T, H, N)), "beta must have shape"
    yield "beta not a tensor", dict(beta=0.5), "beta must be a torch.Tensor"
    yield "state shape", dict(state=torch.zeros(B, H, N, N + 1)), "state must have shape"
    yield "state device", dict(state=torch.zeros(B, H, N, N, device="meta")), "state is on meta"
    yield (
        "empty T",
        {"q": torch.zeros(B, 0, H, N), "k": torch.zeros(B, 0, H, N), "v": torch.zeros(B, 0, H, N)},
        ("every dimension >= 1"),
    )
    yield "scale negative", dict(scale=-1.0), "scale must be a positive finite number"
    yield "scale nan", dict(scale=float("nan")), "scale must be"
    yield "scale tensor", dict(scale=torch.tensor(0.5)), "scale must be"
    yield "backend", dict(backend="nope"), "unknown backend 'nope'"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(_bad_calls("kda")), ids=lambda c: c[0])
def test_bad_arguments_raise_value_error_naming_the_argument(op, case):
    name, override, message = case
    if op == "gdn" and name == "g shape":
        override = dict(g=torch.zeros(1, 3, 2, 4))  # kda's gate shape is wrong for gdn
    if op == "gdn" and name in ("g dtype", "g integer", "g device"):
        override = {"g": override["g"][..., 0]}
    B, T, H, N = 1, 3, 2, 4
    args = {n: torch.zeros(B, T, H, N) for n in ("q", "k", "v")}
    args["g"] = torch.zeros(B, T, H, N) if op == "kda" else torch.zeros(B, T, H)
    args["beta"] = torch.zeros(B, T, H)
    kwargs = {}
    for key, value in override.items():
        (kwargs if key in ("state", "scale", "backend") else args)[key] = value
    if name == "empty T":
        args["g"] = args["g"][:, :0]
        args["beta"] = args["beta"][:, :0]
    with pytest.raises(ValueError, match=message):
        OPS[op](*(args[n] for n in NAMES), **kwargs)
