"""The Triton kernels as torch ops (docs/operators.md#the-triton-kernels-as-torch-ops): every
kernel launch of every Triton backend happens inside a registered `torch.ops.rwkvx.*_triton_*`
op; an op's forward equals the launch it wraps, bit for bit; each backend, forward and
backward through the ops, matches the fp64 reference; every op passes `torch.library.opcheck`;
Dynamo traces every Triton backend with no graph break.

Without a GPU the kernels run under Triton's interpreter, where the ops are opaque custom ops
(a triton_op cannot be faked or compiled there: see USE_TRITON_OP in ops/_triton.py); that
each op is a real triton_op naming its kernels outside the interpreter is checked in a child
process without TRITON_INTERPRET. Tiny shapes: the interpreter runs a program at a time."""

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from rwkvx_cli.ops import _triton as tr  # noqa: E402
from rwkvx_cli.ops import get_op  # noqa: E402
from rwkvx_cli.ops.channel_mix import fused_triton as channel_mix_ft  # noqa: E402
from rwkvx_cli.ops.delta import fused_triton as delta_ft  # noqa: E402
from rwkvx_cli.ops.rwkv7_out import fused_triton as rwkv7_out_ft  # noqa: E402
from rwkvx_cli.ops.rwkv7_prep import fused_triton as rwkv7_prep_ft  # noqa: E402
from rwkvx_cli.ops.rwkv8 import fused_triton as rwkv8_ft  # noqa: E402
from rwkvx_cli.ops.rwkv8.reference import EPS  # noqa: E402
from rwkvx_cli.ops.shift_mix import fused_triton as shift_mix_ft  # noqa: E402
from rwkvx_cli.ops.wkv4 import fused_triton as wkv4_ft  # noqa: E402
from rwkvx_cli.ops.wkv7 import chunked_triton as wkv7_ct  # noqa: E402
from rwkvx_cli.ops.wkv7 import fused_triton as wkv7_ft  # noqa: E402

pytestmark = pytest.mark.skipif(tr.unavailable() is not None, reason=str(tr.unavailable()))

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Every op, the module that defines it and the kernels its body launches.
OPS = {
    "wkv7_triton_fwd": (wkv7_ft, {"_fwd_kernel"}),
    "wkv7_triton_bwd": (wkv7_ft, {"_bwd_kernel"}),
    "wkv7_triton_chunked_fwd": (wkv7_ct, {"_intra_kernel", "_fwd_state_kernel"}),
    "wkv7_triton_chunked_bwd": (wkv7_ct, {"_intra_kernel", "_bwd_state_kernel", "_bwd_intra_kernel"}),
    "wkv4_triton_fwd": (wkv4_ft, {"_fwd_kernel"}),
    "wkv4_triton_bwd": (wkv4_ft, {"_bwd_kernel"}),
    "rwkv8_triton_fwd": (rwkv8_ft, {"_fwd_kernel"}),
    "rwkv8_triton_bwd": (rwkv8_ft, {"_bwd_kernel"}),
    "delta_triton_fwd": (delta_ft, {"_fwd_kernel"}),
    "delta_triton_bwd": (delta_ft, {"_bwd_kernel"}),
    "shift_mix_triton_fwd": (shift_mix_ft, {"_fwd_kernel"}),
    "shift_mix_triton_bwd": (shift_mix_ft, {"_bwd_rows_kernel", "_bwd_kernel"}),
    "rwkv7_prep_triton_fwd": (rwkv7_prep_ft, {"_fwd_kernel"}),
    "rwkv7_prep_triton_bwd": (rwkv7_prep_ft, {"_bwd_kernel"}),
    "rwkv7_out_triton_fwd": (rwkv7_out_ft, {"_fwd_kernel"}),
    "rwkv7_out_triton_bwd": (rwkv7_out_ft, {"_bwd_kernel"}),
    "relu2_triton_fwd": (channel_mix_ft, {"_relu2_fwd_kernel"}),
    "relu2_triton_bwd": (channel_mix_ft, {"_relu2_bwd_kernel"}),
}

# (op, backend) of every Triton backend in the registry.
BACKENDS = [("wkv7", "triton"), ("wkv7", "triton_chunked"), ("wkv4", "triton"), ("rwkv8", "triton")]
BACKENDS += [("gdn", "triton"), ("kda", "triton")]
BACKENDS += [("shift_mix", "triton"), ("rwkv7_prep", "triton"), ("rwkv7_out", "triton"), ("channel_mix", "triton")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_every_triton_op_is_registered_and_mutates_nothing():
    for name in OPS:
        schema = getattr(torch.ops.rwkvx, name).default._schema
        assert not schema.is_mutable, name
        assert all(a.alias_info is None for a in (*schema.arguments, *schema.returns)), name


def test_the_registry_has_no_other_triton_backend():
    from rwkvx_cli.ops import op_names

    found = [(op, bk) for op in op_names() for bk in get_op(op).backends if "triton" in bk]
    assert sorted(found) == sorted(BACKENDS)


def sample(op: str, dtype=torch.float64):
    """The op's finite-difference case (B = 1, T = 19, H = 2, N = 4: T over two snapshot
    intervals), inputs and states by name, as leaves that require grad."""
    spec = get_op(op)
    case = spec.fd_case
    tensors = spec.sample(case, torch.Generator().manual_seed(0))
    return spec, case, {k: v.to(DEVICE, dtype).requires_grad_(v.is_floating_point()) for k, v in tensors.items()}


def run(op: str, backend: str, tensors):
    """Forward, then the gradient of a fixed random projection of every output."""
    spec = get_op(op)
    y, states = spec.call(spec.backends[backend], tensors, spec.fd_case)
    outs = (*y, *states)
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)).sum() for o in outs)
    leaves = [t for t in tensors.values() if t.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(loss, leaves)


def _recorded_launches(op: str, backend: str) -> set[tuple[str, str]]:
    """(kernel, enclosing op function) of every kernel launch of one forward and backward."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = set()
    original = InterpretedFunction.run

    def record(self, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name not in OPS:
            frame = frame.f_back
        launches.add((self.fn.__name__, frame.f_code.co_name if frame is not None else None))
        return original(self, *args, **kwargs)

    InterpretedFunction.run = record
    try:
        run(op, backend, sample(op)[2])
    finally:
        InterpretedFunction.run = original
    return launches


@pytest.mark.skipif(not tr.INTERPRETED, reason="records the launches through Triton's interpreter")
@pytest.mark.parametrize("op,backend", BACKENDS, ids=[f"{o}-{b}" for o, b in BACKENDS])
def test_every_kernel_launch_is_inside_an_op(op, backend):
    launches = _recorded_launches(op, backend)
    assert launches
    for kernel, inside in launches:
        assert inside is not None, f"{kernel} launched outside every rwkvx op"
        assert kernel in OPS[inside][1], (kernel, inside)


_OUTSIDE_THE_INTERPRETER = """
import json, torch
from rwkvx_cli.ops import _triton
from rwkvx_cli.ops.channel_mix import fused_triton
from rwkvx_cli.ops.delta import fused_triton
from rwkvx_cli.ops.rwkv7_out import fused_triton
from rwkvx_cli.ops.rwkv7_prep import fused_triton
from rwkvx_cli.ops.shift_mix import fused_triton
from rwkvx_cli.ops.rwkv8 import fused_triton
from rwkvx_cli.ops.wkv4 import fused_triton
from rwkvx_cli.ops.wkv7 import chunked_triton, fused_triton
from torch._library.triton import get_triton_kernels_for_op
names = json.loads(input())
print(json.dumps({
    "use_triton_op": _triton.USE_TRITON_OP,
    "kernels": {n: sorted(k.fn.__name__ for k in get_triton_kernels_for_op("rwkvx::" + n)) for n in names},
}))
"""


@pytest.mark.skipif(not hasattr(torch.library, "triton_op"), reason="torch.library.triton_op needs torch >= 2.6")
def test_outside_the_interpreter_each_op_is_a_triton_op_that_names_its_kernels():
    # what torch.compile relies on with compiled kernels: the op is a triton_op and torch finds
    # every kernel its body launches (Inductor then traces the launches instead of the op)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _OUTSIDE_THE_INTERPRETER],
        input=json.dumps(list(OPS)),
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["use_triton_op"] is True
    assert got["kernels"] == {name: sorted(kernels) for name, (_, kernels) in OPS.items()}


# -- each forward op against the launch it wraps ------------------------------------------------

B, T, H, N = 1, 19, 2, 4


def _rand(*shape, gen, lo=-0.5, hi=0.5, dtype=torch.float32):
    return (lo + (hi - lo) * torch.rand(*shape, generator=gen)).to(DEVICE, dtype)


def _wkv7_inputs(gen, dtype=torch.float32):
    x = [_rand(B, T, H, N, gen=gen, dtype=dtype) for _ in range(6)]
    x[1] = _rand(B, T, H, N, gen=gen, lo=-0.6, hi=0.0, dtype=dtype)  # log decay
    return x, 0.2 * _rand(B, H, N, N, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wkv7_fwd_op_equals_a_direct_launch(dtype):
    gen = torch.Generator().manual_seed(0)
    ins, s0 = _wkv7_inputs(gen, dtype)
    y, s_out, snaps = torch.ops.rwkvx.wkv7_triton_fwd(*ins, s0)
    BK, BV, NV = tr.state_blocks(N)
    NC = triton.cdiv(T, tr.CHUNK)
    want = [torch.empty_like(ins[0]), torch.empty_like(s0), s0.new_empty(B, H, NC, N, N)]
    wkv7_ft._fwd_kernel[(B * H, NV)](*ins, s0, *want, T, H, N, BK, BV, tr.CHUNK, NC, triton.language.float32)
    for got, ref in zip((y, s_out, snaps), want, strict=True):
        assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_wkv7_chunked_fwd_op_equals_a_direct_launch():
    gen = torch.Generator().manual_seed(0)
    ins, s0 = _wkv7_inputs(gen)
    y, snaps, s_out = torch.ops.rwkvx.wkv7_triton_chunked_fwd(*ins, s0)
    r, w, k, v, a, b = ins
    BK, BKC, BV = wkv7_ct._blocks(N)
    NC = triton.cdiv(T, tr.CHUNK)
    DT, prec, L = triton.language.float32, wkv7_ct.DOT_PRECISION, tr.CHUNK
    mats = [torch.empty(B * H, NC, L, L, device=DEVICE) for _ in range(4)]
    rows = [torch.empty(B * H, NC * L, N, device=DEVICE) for _ in range(4)]
    ecl = torch.empty(B * H, NC, N, device=DEVICE)
    wkv7_ct._intra_kernel[(NC, B * H)](
        w, a, b, k, r, *mats, *rows, ecl, T, H, NC, N, L, wkv7_ct.LOG2_CHUNK, BK, BKC, DT, prec, wkv7_ct.W_MIN,
        num_warps=wkv7_ct.PAIRWISE_WARPS,
    )  # fmt: skip
    want = [torch.empty(B, T, H, N, device=DEVICE), s0.new_empty(B, H, NC + 1, N, N), torch.empty_like(s0)]
    wkv7_ct._fwd_state_kernel[(B * H, triton.cdiv(N, BV))](
        v, s0, *mats, *rows, ecl, *want, T, H, NC, N, L, BK, BV, DT, prec
    )
    for got, ref in zip((y, snaps, s_out), want, strict=True):
        assert torch.equal(got, ref)


def test_wkv4_fwd_op_equals_a_direct_launch():
    gen = torch.Generator().manual_seed(0)
    w, u = -torch.rand(H, N, generator=gen).to(DEVICE) - 0.1, _rand(H, N, gen=gen)
    k, v = _rand(B, T, H, N, gen=gen), _rand(B, T, H, N, gen=gen)
    aa, bb, pp = _rand(B, H, N, gen=gen), _rand(B, H, N, gen=gen, lo=0.5, hi=1.5), _rand(B, H, N, gen=gen)
    got = torch.ops.rwkvx.wkv4_triton_fwd(w, u, k, v, aa, bb, pp)
    C = H * N
    BC, NC = wkv4_ft._block(C), triton.cdiv(T, tr.CHUNK)
    want = [torch.empty_like(k), *(torch.empty_like(aa) for _ in range(3)), aa.new_empty(B, NC, 3, C)]
    wkv4_ft._fwd_kernel[(B, triton.cdiv(C, BC))](
        w, u, k, v, aa, bb, pp, k, *want, T, C, BC, tr.CHUNK, NC, False, triton.language.float32
    )  # (no starts: the pointer is any tensor, HAS_STARTS=False)
    for g, ref in zip(got, want, strict=True):
        assert torch.equal(g, ref)


@pytest.mark.parametrize("Hv,E", [(H, 4), (1, 12)], ids=["per_head", "shared_value_head"])
def test_rwkv8_fwd_op_equals_a_direct_launch(Hv, E):
    gen = torch.Generator().manual_seed(0)
    L = N
    q, v = _rand(B, T, H, L, gen=gen, lo=0.0, hi=1.0), _rand(B, T, Hv, E, gen=gen)
    d, rho0, n0 = _rand(H, L, gen=gen, lo=0.5, hi=1.0), _rand(B, H, L, E, gen=gen), _rand(B, H, L, gen=gen, lo=1, hi=2)
    s = q.sum(-1) + EPS
    got = torch.ops.rwkvx.rwkv8_triton_fwd(q, v, d, s, rho0, n0)
    BR, BV, NR, NV = rwkv8_ft._blocks(L, E)
    NC = triton.cdiv(T, tr.CHUNK)
    y_p = torch.empty(NR, B, T, H, E, device=DEVICE)
    want = [torch.empty_like(rho0), torch.empty_like(n0), rho0.new_empty(B, H, NC, L, E), rho0.new_empty(B, H, NC, L)]
    rwkv8_ft._fwd_kernel[(B * H, NR, NV)](
        q, v, d, s, rho0, n0, y_p, *want,
        T, H, Hv, L, E, B * T * H * E, BR, BV, tr.CHUNK, NC, triton.language.float32,
    )  # fmt: skip
    for g, ref in zip(got, [y_p.sum(0), *want], strict=True):
        assert torch.equal(g, ref)


@pytest.mark.parametrize("G", [1, N], ids=["gdn", "kda"])
def test_delta_fwd_op_equals_a_direct_launch(G):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_rand(B, T, H, N, gen=gen) for _ in range(3))
    g, beta = _rand(B, T, H, G, gen=gen, lo=-0.7, hi=0.0), _rand(B, T, H, gen=gen, lo=0.0, hi=1.0)
    s0 = _rand(B, H, N, N, gen=gen)
    got = torch.ops.rwkvx.delta_triton_fwd(q, k, v, g, beta, s0, 0.5)
    BK, BV, NVB = tr.state_blocks(N)
    NC = triton.cdiv(T, tr.CHUNK)
    want = [torch.empty_like(q), torch.empty_like(s0), s0.new_empty(B, H, NC, N, N)]
    delta_ft._fwd_kernel[(B * H, NVB)](
        q, k, v, g, beta, s0, *want, 0.5, T, H, N, G, BK, BV, tr.CHUNK, NC, triton.language.float32
    )
    for got_, ref in zip(got, want, strict=True):
        assert torch.equal(got_, ref)


# -- the backends through the ops ---------------------------------------------------------------


@pytest.mark.parametrize("op,backend", BACKENDS, ids=[f"{o}-{b}" for o, b in BACKENDS])
def test_backend_through_the_ops_matches_the_fp64_reference(op, backend):
    spec, _, tensors = sample(op)
    outs, grads = run(op, backend, tensors)
    ref_outs, ref_grads = run(
        op, spec.reference, {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in tensors.items()}
    )
    for got, want in zip((*outs, *grads), (*ref_outs, *ref_grads), strict=True):
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def _op_calls():
    """Arguments for every op at the tiny case (fp32): the forward ops' on sampled inputs, the
    backward ops' on what the forward ops return and random cotangents."""
    gen = torch.Generator().manual_seed(2)

    def like(*ts):
        return tuple(torch.randn(t.shape, generator=gen).to(t) for t in ts)

    calls = {}
    w7, s7 = _wkv7_inputs(gen)
    y, s_out, snaps = torch.ops.rwkvx.wkv7_triton_fwd(*w7, s7)
    calls["wkv7_triton_fwd"] = (*w7, s7)
    calls["wkv7_triton_bwd"] = (*w7, snaps, *like(y, s_out))
    y, snaps, s_out = torch.ops.rwkvx.wkv7_triton_chunked_fwd(*w7, s7)
    calls["wkv7_triton_chunked_fwd"] = (*w7, s7)
    calls["wkv7_triton_chunked_bwd"] = (*w7, snaps, *like(y, s_out))
    w4 = (-torch.rand(H, N, generator=gen).to(DEVICE) - 0.1, _rand(H, N, gen=gen))
    w4 += (_rand(B, T, H, N, gen=gen), _rand(B, T, H, N, gen=gen))
    w4 += (_rand(B, H, N, gen=gen), _rand(B, H, N, gen=gen, lo=0.5, hi=1.5), _rand(B, H, N, gen=gen))
    y, aa, bb, pp, snaps = torch.ops.rwkvx.wkv4_triton_fwd(*w4)
    calls["wkv4_triton_fwd"] = w4
    calls["wkv4_triton_bwd"] = (*w4[:4], aa, bb, snaps, *like(y, aa, bb, pp))
    q, v8 = _rand(B, T, H, N, gen=gen, lo=0.0, hi=1.0), _rand(B, T, 1, 3 * N, gen=gen)  # the shared value head
    r8 = (q, v8, _rand(H, N, gen=gen, lo=0.5, hi=1.0), q.sum(-1) + EPS)
    r8 += (_rand(B, H, N, 3 * N, gen=gen), _rand(B, H, N, gen=gen, lo=1.0, hi=2.0))
    y, rho, norm, snaps, nsnaps = torch.ops.rwkvx.rwkv8_triton_fwd(*r8)
    calls["rwkv8_triton_fwd"] = r8
    calls["rwkv8_triton_bwd"] = (*r8[:4], snaps, nsnaps, *like(y, rho, norm))
    d = (*(_rand(B, T, H, N, gen=gen) for _ in range(3)), _rand(B, T, H, N, gen=gen, lo=-0.7, hi=0.0))
    d += (_rand(B, T, H, gen=gen, lo=0.0, hi=1.0), _rand(B, H, N, N, gen=gen))
    y, s_out, snaps = torch.ops.rwkvx.delta_triton_fwd(*d, 0.5)
    calls["delta_triton_fwd"] = (*d, 0.5)
    calls["delta_triton_bwd"] = (*d[:5], snaps, *like(y, s_out), 0.5)
    C = H * N  # the fused block ops: rows of C = H·N channels
    sm = (_rand(B, T, C, gen=gen), _rand(C, gen=gen, lo=0.5, hi=1.5), _rand(C, gen=gen))
    sm += ([_rand(C, gen=gen, lo=0.0) for _ in range(3)],)
    sm += (_rand(B, C, gen=gen),)
    ys, s_out, mean, rstd = torch.ops.rwkvx.shift_mix_triton_fwd(*sm, 1e-5)
    calls["shift_mix_triton_fwd"] = (*sm, 1e-5)
    calls["shift_mix_triton_bwd"] = (list(like(*ys)), *like(s_out), *sm, mean, rstd, *like(sm[0]))
    seq = tuple(_rand(B, T, H, N, gen=gen) for _ in range(7))
    par = tuple(_rand(C, gen=gen) for _ in range(6))
    outs = torch.ops.rwkvx.rwkv7_prep_triton_fwd(*seq, *par)
    calls["rwkv7_prep_triton_fwd"] = (*seq, *par)
    w, kp, a, b, bonus, vp = like(*outs)
    calls["rwkv7_prep_triton_bwd"] = (*seq, *par, w, kp, vp, a, b, bonus, *like(seq[0]))
    ro = (*(_rand(B, T, H, N, gen=gen) for _ in range(3)), _rand(C, gen=gen, lo=0.5, hi=1.5), _rand(C, gen=gen))
    out = torch.ops.rwkvx.rwkv7_out_triton_fwd(*ro, 64e-5)
    calls["rwkv7_out_triton_fwd"] = (*ro, 64e-5)
    calls["rwkv7_out_triton_bwd"] = (*ro, *like(out), 64e-5)
    h = _rand(B * T, 4 * C, gen=gen)
    a = torch.ops.rwkvx.relu2_triton_fwd(h)
    calls["relu2_triton_fwd"] = (h,)
    calls["relu2_triton_bwd"] = (*like(a), a)
    return calls


@pytest.mark.slow  # opcheck runs each of 24 ops several ways under Triton's interpreter: ~35 s
def test_every_op_passes_opcheck():
    # schema, fake implementation (the body with no launch, under the interpreter), autograd
    # registration (none: the autograd.Function is around the ops) and AOT dispatch, dynamic shapes
    calls = _op_calls()
    assert set(calls) == set(OPS)
    for name, args in calls.items():
        torch.library.opcheck(getattr(torch.ops.rwkvx, name), args)


@pytest.mark.parametrize("op,backend", BACKENDS, ids=[f"{o}-{b}" for o, b in BACKENDS])
def test_dynamo_traces_each_triton_backend_in_one_graph(op, backend):
    _, _, tensors = sample(op, torch.float32)

    def loss(tensors):
        spec = get_op(op)
        y, states = spec.call(spec.backends[backend], tensors, spec.fd_case)
        return sum(o.square().sum() for o in (*y, *states))

    explained = torch._dynamo.explain(loss)(tensors)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def check_compiled(op: str, backend: str):
    # make gpu-check's compile step: the same check, so the two cannot drift apart
    from rwkvx_cli.tools.gpu_check import compiled_matches_eager

    error = compiled_matches_eager(op, backend, DEVICE.type)
    assert error is None, error


@pytest.mark.slow  # an inductor compile per backend (the ops opaque under the interpreter)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA variant below covers it")
@pytest.mark.parametrize("op,backend", BACKENDS, ids=[f"{o}-{b}" for o, b in BACKENDS])
def test_a_compiled_triton_backend_matches_eager_under_the_interpreter(op, backend):
    check_compiled(op, backend)


# Inductor with compiled kernels: it traces each triton_op's body and launches its kernels
# itself. Needs a GPU.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile of a triton_op's kernels needs CUDA")
@pytest.mark.parametrize("op,backend", BACKENDS, ids=[f"{o}-{b}" for o, b in BACKENDS])
def test_a_compiled_triton_backend_matches_eager_on_cuda(op, backend):
    check_compiled(op, backend)
