"""MoBA properties beyond the gradient-check gates (which run in test_gradcheck.py)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from rwkvx_cli.ops import get_op
from rwkvx_cli.ops.moba import moba
from rwkvx_cli.ops.moba import sparse as sparse_module
from rwkvx_cli.ops.moba import tiled as tiled_module
from rwkvx_cli.ops.moba.spec import _begins, _gate_margin

SPEC = get_op("moba")
BACKENDS = ["reference", *(bk.name for bk in SPEC.production_backends())]


def make_inputs(B, T, H, N, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, N, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def run_with_grads(backend, x, chunk_size, top_k):
    leaves = [t.clone().requires_grad_() for t in x]
    y, _ = moba(*leaves, chunk_size=chunk_size, top_k=top_k, backend=backend)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(123), dtype=torch.float64).to(y.dtype)
    (y * cot).sum().backward()
    return y.detach(), [t.grad for t in leaves]


def dense_causal(q, k, v):
    """Independent oracle for top_k covering every chunk: plain causal softmax attention."""
    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return y.transpose(1, 2)


@pytest.mark.parametrize("block_elements", [sparse_module.BLOCK_ELEMENTS, 2000])  # one block / several blocks
@pytest.mark.parametrize(
    "shape,chunk_size,top_k",
    [
        ((2, 37, 3, 8), 8, 2),  # ragged T: the last chunk is partial
        ((1, 64, 2, 4), 4, 1),  # 16 chunks, one earlier chunk each: really sparse
        ((1, 50, 2, 8), 5, 3),
        ((2, 17, 2, 4), 1, 3),  # chunk 1: selection per key
        ((1, 9, 1, 4), 20, 2),  # one partial chunk: plain causal attention
        ((1, 20, 1, 4), 3, 0),  # every earlier chunk
        ((1, 20, 1, 4), 3, -2),
        ((1, 20, 1, 4), 3, 100),
    ],
)
@pytest.mark.parametrize("backend", [bk.name for bk in SPEC.production_backends()])
def test_fp64_backend_equals_reference(monkeypatch, backend, shape, chunk_size, top_k, block_elements):
    monkeypatch.setattr(sparse_module, "BLOCK_ELEMENTS", block_elements)
    x = make_inputs(*shape)
    y_ref, g_ref = run_with_grads("reference", x, chunk_size, top_k)
    y, g = run_with_grads(backend, x, chunk_size, top_k)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    for name, a, b in zip("qkv", g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size,top_k", [(4, 0), (4, -1), (4, 6), (4, 100), (7, 3), (30, 1)])
def test_all_chunks_is_dense_causal_attention(backend, chunk_size, top_k):
    x = make_inputs(2, 27, 2, 8)  # 7 chunks of 4, 4 of 7, 1 of 30
    y, g = run_with_grads(backend, x, chunk_size, top_k)
    leaves = [t.clone().requires_grad_() for t in x]
    y_dense = dense_causal(*leaves)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(123), dtype=torch.float64)
    g_dense = torch.autograd.grad((y_dense * cot).sum(), leaves)
    torch.testing.assert_close(y, y_dense.detach(), rtol=1e-10, atol=1e-12)
    for a, b in zip(g, g_dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_selected_chunks_reach_a_query(backend):
    """Perturbing the values of one earlier chunk changes query t's output exactly when
    the chunk is among its top_k by q_t · mean(K_j) (computed here independently);
    otherwise, and for any later key, the output stays bit-identical."""
    B, T, H, N, c, top_k = 1, 30, 2, 4, 5, 2
    q, k, v = make_inputs(B, T, H, N, seed=1)
    y0, _ = moba(q, k, v, chunk_size=c, top_k=top_k, backend=backend)
    for t in (17, 29):  # chunks 3 and 5
        for h in range(H):
            scores = [q[0, t, h] @ k[0, j * c : (j + 1) * c, h].mean(dim=0) for j in range(t // c)]
            selected = set(torch.tensor(scores).topk(top_k).indices.tolist())
            reached = set()
            for j in range(t // c):
                v2 = v.clone()
                v2[0, j * c : (j + 1) * c, h] += 10.0
                y, _ = moba(q, k, v2, chunk_size=c, top_k=top_k, backend=backend)
                if not torch.equal(y[0, t, h], y0[0, t, h]):
                    reached.add(j)
            assert reached == selected, (t, h)
            v2 = v.clone()
            v2[0, t + 1 :, h] += 10.0  # the future
            y, _ = moba(q, k, v2, chunk_size=c, top_k=top_k, backend=backend)
            assert torch.equal(y[0, : t + 1, h], y0[0, : t + 1, h])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "T,chunk_size,top_k,cuts",
    [
        (37, 8, 2, [13]),  # a piece ends inside a chunk: the next one's first chunk straddles it
        (40, 8, 1, [8, 16, 33]),  # pieces that end on chunk boundaries, and not
        (30, 4, 0, [1, 2, 3, 17]),  # one token at a time (generation), every earlier chunk
        (25, 5, 3, [24]),
    ],
)
def test_reading_in_pieces_with_the_state_equals_reading_whole(backend, T, chunk_size, top_k, cuts):
    """The state is the keys and values read so far: each piece attends them by the same rule, so the
    outputs and the gradients of every input equal one whole call's (fp64, to rounding)."""
    x = [t.requires_grad_() for t in make_inputs(2, T, 2, 8, seed=3)]
    y, (keys, values) = moba(*x, chunk_size=chunk_size, top_k=top_k, backend=backend)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = torch.autograd.grad((y * cot).sum(), x)
    assert keys is x[1] and values is x[2]  # no cache: the state is the keys and values themselves
    pieces, state, lo = [], None, 0
    for hi in [*cuts, T]:
        part, state = moba(*(t[:, lo:hi] for t in x), state, chunk_size=chunk_size, top_k=top_k, backend=backend)
        assert state[0].shape[1] == hi
        pieces.append(part)
        lo = hi
    got = torch.autograd.grad((torch.cat(pieces, 1) * cot).sum(), x)
    torch.testing.assert_close(torch.cat(pieces, 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state[0], x[1], rtol=0, atol=0)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_cache_is_attended_and_differentiated(backend):
    """With a cache the new queries read it: perturbing a cached value changes the output, and the
    cache gets the gradient the whole call gives those keys and values."""
    q, k, v = make_inputs(1, 20, 2, 4, seed=5)
    cache = [t[:, :12].clone().requires_grad_() for t in (k, v)]
    y, _ = moba(q[:, 12:], k[:, 12:], v[:, 12:], tuple(cache), chunk_size=4, top_k=0, backend=backend)
    y.sum().backward()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    whole, _ = moba(*leaves, chunk_size=4, top_k=0, backend=backend)
    whole[:, 12:].sum().backward()
    torch.testing.assert_close(y, whole[:, 12:].detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache[0].grad, leaves[1].grad[:, :12], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cache[1].grad, leaves[2].grad[:, :12], rtol=1e-10, atol=1e-12)
    assert cache[1].grad.abs().min() > 0  # every cached value is read (top_k 0: all chunks)


def test_bad_caches_raise_value_error():
    q, k, v = make_inputs(1, 8, 2, 4)
    kw = {"chunk_size": 4, "top_k": 1}
    cases = [
        (k, "a pair"),
        ((k, v, v), "a pair"),
        ((k[:, :3], v[:, :2]), "k_cache has shape"),
        ((k[:, :3, :1], v[:, :3, :1]), r"must have shape \[1, P, 2, 4\]"),
        ((k[0], v[0]), "must have shape"),
        ((k.long(), v.long()), "floating-point"),
        ((k, v.to("meta")), "is on meta"),
    ]
    for state, message in cases:
        with pytest.raises(ValueError, match=message):
            moba(q, k, v, state, **kw)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.numel = max(self.numel, o.numel())
        return out


def _memory(T, B=1, H=2, N=4, c=16, top_k=2, backend="sparse"):
    q, k, v = (t.requires_grad_() for t in make_inputs(B, T, H, N, dtype=torch.float32))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with _LargestTensor() as largest, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moba(q, k, v, chunk_size=c, top_k=top_k, backend=backend)[0].sum().backward()
    return max(saved), largest.numel


def test_sparse_memory_is_linear_in_T():
    B, H, N, c, top_k = 1, 2, 4, 16, 2
    saved, largest = _memory(2048, B, H, N, c, top_k)
    # Backward keeps O(T * N) per head: inputs, output, selection, log-sum-exp.
    assert saved <= B * H * 2048 * N
    # No T x T matrix: the largest intermediates are the gathered keys (T * top_k * c * N)
    # and the gate scores (T * T / c), both T / 16 here.
    assert largest <= B * H * 2048 * (top_k + 1) * c * N
    assert largest < B * H * 2048 * 2048 / 4
    # Doubling T twice multiplies it by about 4, not 16.
    assert largest <= 5 * _memory(512, B, H, N, c, top_k)[1]


def test_tiled_memory_scales_with_T_times_top_k(monkeypatch):
    monkeypatch.setattr(tiled_module, "SELECT_ELEMENTS", 1 << 15)  # keep the gate scores below the tiles
    B, H, N, c, top_k, T = 1, 2, 4, 16, 2, 2048
    saved, largest = _memory(T, B, H, N, c, top_k, backend="tiled")
    # Tiles hold the selected pairs (B*H*T*top_k of them, plus at most one partial
    # tile per key chunk) against one copy of their chunk: O(T * top_k * (c + N)).
    pairs = B * H * T * top_k + B * H * (T // c) * tiled_module.TILE
    assert saved <= pairs * max(c, N)
    assert largest < B * H * T * T / 4
    assert largest <= 5 * _memory(T // 4, B, H, N, c, top_k, backend="tiled")[1]


def test_blocks_cap_the_largest_intermediate(monkeypatch):
    _, one_block = _memory(1024)
    monkeypatch.setattr(sparse_module, "BLOCK_ELEMENTS", 1 << 17)
    _, blocked = _memory(1024)
    assert blocked <= 1 << 17 < one_block


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_step(backend):
    x = make_inputs(2, 1, 3, 4)
    y, (dq, dk, dv) = run_with_grads(backend, x, chunk_size=4, top_k=1)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(123), dtype=torch.float64)
    # One key: weight 1, so y = v and the scores get no gradient.
    torch.testing.assert_close(y, x[2], rtol=0, atol=0)
    torch.testing.assert_close(dv, cot, rtol=0, atol=0)
    assert torch.count_nonzero(dq) == 0 and torch.count_nonzero(dk) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_returns_input_dtype(backend, dtype):
    x = make_inputs(1, 24, 2, 8)
    x_low = [t.to(dtype) for t in x]
    y, _ = moba(*x_low, chunk_size=4, top_k=2, backend=backend)
    y_ref, _ = moba(*(t.double() for t in x_low), chunk_size=4, top_k=2, backend="reference")
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)


def test_auto_is_the_tiled_backend():
    assert SPEC.production_backends()[0].name == "tiled"
    x = make_inputs(1, 10, 1, 4)
    assert torch.equal(moba(*x, chunk_size=3, top_k=1)[0], moba(*x, chunk_size=3, top_k=1, backend="tiled")[0])


def test_bad_arguments_raise_value_error():
    q, k, v = make_inputs(1, 8, 2, 4)
    good = {"chunk_size": 4, "top_k": 1}
    cases = [
        ((q, k[:, :7], v), good, "k has shape"),
        ((q, k, v.float()), good, "v has dtype"),
        ((q, k, v.to("meta")), good, "v is on meta"),
        ((q[0], k[0], v[0]), good, "q must have 4 dimensions"),
        ((q, k.long(), v), good, "k must be a floating-point"),
        ((q, k, [1.0]), good, "v must be a torch.Tensor"),
        ((q[:, :0], k[:, :0], v[:, :0]), good, "every dimension >= 1"),
        ((q, k, v), {"chunk_size": 0, "top_k": 1}, "chunk_size"),
        ((q, k, v), {"chunk_size": 2.5, "top_k": 1}, "chunk_size"),
        ((q, k, v), {"chunk_size": True, "top_k": 1}, "chunk_size"),
        ((q, k, v), {"chunk_size": 4, "top_k": 1.0}, "top_k"),
        ((q, k, v), {"chunk_size": 4, "top_k": None}, "top_k"),
        ((q, k, v), {**good, "backend": "flash"}, "unknown backend"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            moba(*args, **kwargs)


def test_sampler_keeps_selections_away_from_ties():
    """Gate B's finite differences must not flip the hard top-k: the sampled fd case
    has every selection margin above its min_gap (seeds as run_gradcheck uses them)."""
    case = SPEC.fd_case
    c, top_k = case.options["chunk_size"], case.options["top_k"]
    assert case.options["prefix"] > 0  # the cache is among the perturbed inputs
    for seed in range(20):
        x = SPEC.sample(case, torch.Generator().manual_seed(seed * 1000 + len(SPEC.cases)))
        assert x["k_cache"].shape[1] == case.options["prefix"]
        margin = _gate_margin(x["q"].float(), x["k"].float(), c, top_k, x["k_cache"].float(), _begins(case))
        assert margin > case.options["min_gap"]
    assert math.isinf(_gate_margin(x["q"], x["k"], c, 0, x["k_cache"]))
