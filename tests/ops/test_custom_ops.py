"""The CPU kernels as torch custom ops (docs/operators.md#the-cpu-kernels-as-torch-ops):
each op's schema, fake implementation and registration pass `torch.library.opcheck`;
Dynamo traces a model of every recurrent block kind with no graph break; and
torch.compile(fullgraph=True) of the ops and of an RWKV-7 model matches eager, forward
and backward. Tiny shapes: compiling on CPU takes seconds per graph."""

import pytest
import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import build_model
from rwkvx_cli.ops import gdn, kda, rwkv8, wkv4, wkv7
from rwkvx_cli.ops.channel_mix import cpu as channel_mix_cpu
from rwkvx_cli.ops.delta import cpu as delta_cpu
from rwkvx_cli.ops.rwkv7_out import cpu as rwkv7_out_cpu
from rwkvx_cli.ops.rwkv7_prep import cpu as rwkv7_prep_cpu
from rwkvx_cli.ops.rwkv8 import cpu as rwkv8_cpu
from rwkvx_cli.ops.shift_mix import cpu as shift_mix_cpu
from rwkvx_cli.ops.wkv4 import cpu as wkv4_cpu
from rwkvx_cli.ops.wkv7 import cpu as wkv7_cpu

KERNELS = {"wkv7": wkv7_cpu, "wkv4": wkv4_cpu, "rwkv8": rwkv8_cpu, "delta": delta_cpu}
KERNELS |= {"rwkv7_prep": rwkv7_prep_cpu, "rwkv7_out": rwkv7_out_cpu}
KERNELS |= {"shift_mix": shift_mix_cpu, "channel_mix": channel_mix_cpu}
unavailable = next((why for m in KERNELS.values() if (why := m.unavailable()) is not None), None)
pytestmark = pytest.mark.skipif(unavailable is not None, reason=f"no CPU kernels here: {unavailable}")

B, T, H, N = 2, 19, 2, 8  # T not a multiple of any kernel's snapshot interval


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rand(*shape, lo=-0.5, hi=0.5, gen):
    return lo + (hi - lo) * torch.rand(*shape, generator=gen)


def op_inputs(seed=0):
    """Inputs for every op in its valid range, fp32, each with its own requires_grad leaf."""
    gen = torch.Generator().manual_seed(seed)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, N, generator=gen), dim=-1)
    x = {
        "wkv7": [
            rand(B, T, H, N, gen=gen),
            -0.6 * torch.rand(B, T, H, N, generator=gen),
            rand(B, T, H, N, gen=gen),
            rand(B, T, H, N, gen=gen),
            -kk,
            kk * torch.rand(B, T, H, N, generator=gen),
            0.1 * rand(B, H, N, N, gen=gen),
        ],
        "wkv4": [
            -torch.rand(H, N, generator=gen) - 0.1,
            rand(H, N, gen=gen),
            rand(B, T, H, N, gen=gen),
            rand(B, T, H, N, gen=gen),
            torch.rand(B, H, N, generator=gen),
            torch.rand(B, H, N, generator=gen) + 0.5,
            rand(B, H, N, gen=gen),
        ],
        "rwkv8": [
            torch.rand(B, T, H, N, generator=gen),
            rand(B, T, H, N, gen=gen),
            0.5 + 0.5 * torch.rand(H, N, generator=gen),
            torch.rand(B, H, N, N, generator=gen),
            torch.rand(B, H, N, generator=gen) + 1.0,
        ],
    }
    for op in ("gdn", "kda"):
        x[op] = [
            torch.nn.functional.normalize(torch.randn(B, T, H, N, generator=gen), dim=-1),
            torch.nn.functional.normalize(torch.randn(B, T, H, N, generator=gen), dim=-1),
            rand(B, T, H, N, gen=gen),
            rand(*((B, T, H, N) if op == "kda" else (B, T, H)), lo=-0.7, hi=0.0, gen=gen),
            torch.rand(B, T, H, generator=gen),
            0.3 * torch.randn(B, H, N, N, generator=gen),
        ]
    return {op: [t.requires_grad_() for t in ts] for op, ts in x.items()}


def all_ops_loss(x):
    """Every op on the cpu backend, forward, one scalar over every output."""
    y7, s7 = wkv7(*x["wkv7"], backend="cpu")
    w, u, k, v, aa, bb, pp = x["wkv4"]
    y4, s4 = wkv4(w, u, k, v, (aa, bb, pp), backend="cpu")
    y8, rho, norm = rwkv8(*x["rwkv8"], backend="cpu")
    yg, sg = gdn(*x["gdn"], backend="cpu")
    yk, sk = kda(*x["kda"], backend="cpu")
    outs = (y7, s7, y4, *s4, y8, rho, norm, yg, sg, yk, sk)
    return sum((o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)


def test_every_kernel_is_a_custom_op_that_passes_opcheck():
    x = {op: [t.detach() for t in ts] for op, ts in op_inputs().items()}
    w7 = list(x["wkv7"])
    y, s_out, snaps, sas = torch.ops.rwkvx.wkv7_cpu_fwd(*w7)
    w4 = x["wkv4"]
    y4, aa, bb, pp, snaps4 = torch.ops.rwkvx.wkv4_cpu_fwd(*w4)
    r8 = x["rwkv8"]
    y8, rho, norm, snaps8, nsnaps8 = torch.ops.rwkvx.rwkv8_cpu_fwd(*r8)
    q, k, v, g, beta, s0 = x["kda"]
    chunk = delta_cpu.chunk_size(N, 4)
    yd, sd, snapsd, wd = torch.ops.rwkvx.delta_cpu_fwd(q, k, v, g.exp(), beta, s0, 0.5, chunk)
    calls = {
        torch.ops.rwkvx.wkv7_cpu_fwd: tuple(w7),
        torch.ops.rwkvx.wkv7_cpu_bwd: (*w7[:6], snaps, sas, torch.randn_like(y), torch.randn_like(s_out), True),
        torch.ops.rwkvx.wkv4_cpu_fwd: tuple(w4),
        torch.ops.rwkvx.wkv4_cpu_bwd: (*w4[:4], aa, bb, snaps4, *map(torch.randn_like, (y4, aa, bb, pp))),
        torch.ops.rwkvx.rwkv8_cpu_fwd: tuple(r8),
        torch.ops.rwkvx.rwkv8_cpu_bwd: (*r8[:3], snaps8, nsnaps8, *map(torch.randn_like, (y8, rho, norm))),
        torch.ops.rwkvx.delta_cpu_fwd: (q, k, v, g.exp(), beta, s0, 0.5, chunk),
        torch.ops.rwkvx.delta_cpu_bwd: (
            *(q, k, g.exp(), beta, snapsd, wd, torch.randn_like(yd), torch.randn_like(sd)),
            *(0.5, chunk),
        ),
    }
    calls_without_state = {  # the zero state as a null pointer, and no state gradient asked for
        torch.ops.rwkvx.wkv7_cpu_fwd: (*w7[:6], None),
        torch.ops.rwkvx.wkv7_cpu_bwd: (*w7[:6], snaps, sas, torch.randn_like(y), None, False),
    }
    for op, args in [*calls.items(), *calls_without_state.items()]:
        torch.library.opcheck(op, args)
    for args in block_op_calls():
        torch.library.opcheck(*args)


def block_op_calls():
    """(op, args) of the fused block ops' kernels: rwkv7_prep with and without the value residual
    (the first layer's None inputs), its backward with every cotangent and with some absent;
    shift_mix's (one output's cotangent absent, a residual gradient added) and relu²'s."""
    gen = torch.Generator().manual_seed(1)
    seq = [rand(B, T, H, N, gen=gen) for _ in range(7)]
    params = [rand(H * N, gen=gen) for _ in range(6)]
    first = [*seq[:5], None, None, params[0], params[1], None, *params[3:]]
    prep_fwd, prep_bwd = torch.ops.rwkvx.rwkv7_prep_cpu_fwd, torch.ops.rwkvx.rwkv7_prep_cpu_bwd
    cots = [torch.randn_like(seq[0]) for _ in range(6)]
    y, bonus, g = seq[:3]
    o, mean, rstd = torch.ops.rwkvx.rwkv7_out_cpu_fwd(y, bonus, g, params[0], params[1], 64e-5)
    return [
        (prep_fwd, (*seq, *params)),
        (prep_fwd, tuple(first)),
        (prep_bwd, (*seq, *params, *cots, None)),
        (prep_bwd, (*seq, *params, *cots, torch.randn_like(seq[0]))),  # dr_add: r's gradient from wkv7
        (prep_bwd, (*first, cots[0], cots[1], None, cots[3], None, cots[5], None)),
        (torch.ops.rwkvx.rwkv7_out_cpu_fwd, (y, bonus, g, params[0], params[1], 64e-5)),
        (torch.ops.rwkvx.rwkv7_out_cpu_bwd, (y, bonus, g, params[0], params[1], mean, rstd, torch.randn_like(o))),
        *shift_mix_calls(gen),
    ]


def shift_mix_calls(gen):
    C = H * N
    x = 0.3 + torch.randn(B, T, C, generator=gen)
    mix = [torch.rand(1, 1, C, generator=gen) for _ in range(3)]  # M tensors of C values (the model's parameters)
    sm = (x, 0.5 + torch.rand(C, generator=gen), 0.2 * torch.randn(C, generator=gen), mix)
    sm = (*sm, torch.randn(B, C, generator=gen))
    ys, s_out, mean, rstd = torch.ops.rwkvx.shift_mix_cpu_fwd(*sm, 1e-5)
    dys = [torch.randn_like(ys[0]), None, torch.randn_like(ys[2])]
    h = torch.randn(B, T, 4 * C, generator=gen)
    return [
        (torch.ops.rwkvx.shift_mix_cpu_fwd, (*sm, 1e-5)),
        (torch.ops.rwkvx.shift_mix_cpu_bwd, (dys, torch.randn_like(s_out), *sm, mean, rstd, torch.randn_like(x))),
        (torch.ops.rwkvx.relu2_cpu_fwd, (h,)),
        (torch.ops.rwkvx.relu2_cpu_bwd, (torch.randn_like(h), torch.relu(h).square())),
    ]


@pytest.mark.slow  # an inductor compile of every op: make test-slow (CI)
def test_the_ops_compile_with_no_graph_break_and_match_eager():
    x = op_inputs()
    leaves = [t for ts in x.values() for t in ts]
    eager = all_ops_loss(x)
    eager_grads = torch.autograd.grad(eager, leaves)
    explained = torch._dynamo.explain(all_ops_loss)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(all_ops_loss, fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled, leaves)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def tiny_model(kind: str):
    cfg = ModelConfig(vocab_size=61, n_embd=32, head_size=16)
    cfg.layers, cfg.n_layer, cfg.n_attn = [kind], 1, 0
    model = build_model(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # init zeroes the output projections: perturb so the time mix counts
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def model_loss(model, idx):
    logits, state = model(idx)
    return logits.float().square().mean() + sum(s.float().square().mean() for st in state for s in st.values())


IDX = torch.randint(0, 61, (2, 21), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", ["rwkv7", "rwkv4", "gdn", "kda", "rwkv8"])
def test_dynamo_traces_every_block_kind_in_one_graph(kind):
    model = tiny_model(kind)
    explained = torch._dynamo.explain(model_loss)(model, IDX)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def check_compiled_model(kind: str):
    model = tiny_model(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    eager = model_loss(model, IDX)
    eager_grads = torch.autograd.grad(eager, params)
    compiled = torch.compile(model_loss, fullgraph=True)(model, IDX)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for p, want in zip(params, eager_grads, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # an inductor compile of a model: make test-slow (CI)
def test_a_compiled_rwkv7_model_matches_eager_forward_and_backward():
    check_compiled_model("rwkv7")


@pytest.mark.slow  # one inductor compile of a model each: about half a minute on 2 CPU cores
@pytest.mark.parametrize("kind", ["rwkv4", "gdn", "kda", "rwkv8"])
def test_a_compiled_model_of_each_other_kind_matches_eager(kind):
    check_compiled_model(kind)


def test_eager_calls_skip_the_dispatcher_and_anything_that_could_tell_goes_through_it():
    """A kernel op called in plain eager mode runs its body directly (ops/_cpu_op.py) and returns what the
    dispatched op returns; under the profiler (the op count, the bench's split), a dispatch mode (fake tensors)
    or with a tensor subclass it is the dispatched op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rwkvx_cli.ops import _cpu_op

    w7 = [t.detach() for t in op_inputs()["wkv7"]]
    assert _cpu_op.direct_call_allowed(w7)
    direct = wkv7_cpu.wkv7_cpu_fwd(*w7)
    dispatched = torch.ops.rwkvx.wkv7_cpu_fwd(*w7)
    for a, b in zip(direct, dispatched, strict=True):
        assert torch.equal(a, b)

    with torch.profiler.profile() as prof:
        assert not _cpu_op.direct_call_allowed(w7)
        wkv7_cpu.wkv7_cpu_fwd(*w7)
        channel_mix_cpu.relu2_cpu_fwd(w7[0])
    names = {e.name for e in prof.events()}
    assert {"rwkvx::wkv7_cpu_fwd", "rwkvx::relu2_cpu_fwd"} <= names

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in w7]
        assert not _cpu_op.direct_call_allowed(fake)
        y, s_out, snaps, sas = wkv7_cpu.wkv7_cpu_fwd(*fake)  # the fake implementation: shapes, no kernel
        assert y.shape == w7[0].shape and s_out.shape == w7[6].shape

    assert not _cpu_op.direct_call_allowed([torch.nn.Parameter(w7[0])])
    assert not _cpu_op.direct_call_allowed([[w7[0], torch.nn.Parameter(w7[0])]])  # inside a list, too


def test_the_constant_result_mark_is_torchs_and_importing_the_ops_leaves_dynamo_unloaded():
    """ops/_cpu_op.py marks each kernel's `unavailable` as torch.compiler.assume_constant_result does
    (so Dynamo calls it once, at trace time) without importing torch._dynamo: every process that
    imports the ops, the CLI's and each test's subprocess, would pay 1.6 s for it. (Where Triton
    compiles, its ops are torch.library.triton_ops, whose registration imports Inductor and so
    Dynamo; the tests run Triton's interpreter, conftest.py.)"""
    import subprocess
    import sys

    from rwkvx_cli.ops import _cpu_op

    def theirs():
        return None

    def ours():
        return None

    torch.compiler.assume_constant_result(theirs)
    _cpu_op.assume_constant_result(ours)
    assert vars(ours) == vars(theirs) != {}
    assert vars(wkv7_cpu.KERNEL.unavailable) == vars(theirs)

    probe = "import sys, rwkvx_cli.ops; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
