"""The cpu kernels of rwkv7_prep and rwkv7_out beyond the registry-wide gates: head sizes that
leave a partial vector in every build (the spec's N = 4, 16, 24 fill whole vectors on AVX2),
cotangents autograd does not give (outputs the loss leaves out), the first layer's v' being v
itself, parameters in another dtype than the activations, and run-to-run determinism."""

import pytest
import torch

from rwkvx_cli.ops import get_op
from rwkvx_cli.ops.registry import Case
from rwkvx_cli.ops.rwkv7_out import cpu as out_cpu
from rwkvx_cli.ops.rwkv7_prep import cpu as prep_cpu
from rwkvx_cli.ops.rwkv7_prep.spec import FIRST_LAYER

unavailable = prep_cpu.unavailable() or out_cpu.unavailable()
pytestmark = pytest.mark.skipif(unavailable is not None, reason=f"no CPU kernels here: {unavailable}")


def _run(op, backend, tensors, case, dtype, pick=None):
    """Outputs and input gradients of one call, the loss a fixed weighting of the outputs `pick`
    chooses (default all)."""
    spec = get_op(op)
    leaves = {n: t.detach().to(dtype).requires_grad_(True) for n, t in tensors.items()}
    outs, _ = spec.call(spec.backends[backend], leaves, case)
    gen = torch.Generator().manual_seed(7)
    chosen = [o for i, o in enumerate(outs) if pick is None or i in pick]
    loss = sum((o.double() * torch.rand(o.shape, generator=gen, dtype=torch.float64)).sum() for o in chosen)
    loss.backward()
    grads = {n: leaves[n].grad for n in spec.checked(case)}
    return [o.detach().double() for o in outs], grads


def _compare(op, case, pick=None):
    spec = get_op(op)
    tensors = spec.sample(case, torch.Generator().manual_seed(0))
    outs_ref, g_ref = _run(op, "reference", tensors, case, torch.float64, pick)
    outs, g = _run(op, "cpu", tensors, case, torch.float64, pick)
    for i, (a, b) in enumerate(zip(outs, outs_ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"output {i}")
    for name, want in g_ref.items():
        if want is None:
            assert g[name] is None or not g[name].any(), name
            continue
        torch.testing.assert_close(g[name], want, rtol=1e-9, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("N", [1, 5, 13, 37])
@pytest.mark.parametrize("first", [False, True], ids=["residual", "first_layer"])
def test_prep_any_head_size(N, first):
    _compare("rwkv7_prep", Case("odd", {"B": 2, "T": 3, "H": 3, "N": N}, absent=FIRST_LAYER if first else ()))


@pytest.mark.parametrize("N", [1, 5, 13, 37])
def test_out_any_head_size(N):
    _compare("rwkv7_out", Case("odd", {"B": 2, "T": 3, "H": 3, "N": N}))


@pytest.mark.parametrize("pick", [(5,), (0, 3), (1, 4, 5), (2,)], ids=["bonus", "w_a", "k_b_bonus", "v"])
@pytest.mark.parametrize("first", [False, True], ids=["residual", "first_layer"])
def test_prep_gradients_with_absent_cotangents(pick, first):
    """Outputs the loss leaves out reach the kernel as None cotangents (read as zeros)."""
    _compare("rwkv7_prep", Case("some", {"B": 2, "T": 4, "H": 2, "N": 16}, absent=FIRST_LAYER if first else ()), pick)


def test_prep_first_layer_returns_v_itself():
    spec = get_op("rwkv7_prep")
    case = Case("first", {"B": 1, "T": 2, "H": 2, "N": 8}, absent=FIRST_LAYER)
    t = {n: x.float() for n, x in spec.sample(case, torch.Generator().manual_seed(0)).items()}
    outs, _ = spec.call(spec.backends["cpu"], t, case)
    assert outs[2] is t["v"]


def test_fp32_parameters_with_bf16_activations():
    """Outputs in the activations' dtype, parameter gradients in the parameters' own, values near
    the reference's on the same inputs."""
    for op in ("rwkv7_prep", "rwkv7_out"):
        spec = get_op(op)
        case = Case("mixed", {"B": 2, "T": 3, "H": 2, "N": 16})
        sample = spec.sample(case, torch.Generator().manual_seed(0))
        results = []
        for backend in ("cpu", "reference"):
            leaves = {n: (x.bfloat16() if x.dim() == 4 else x.float()).requires_grad_(True) for n, x in sample.items()}
            outs, _ = spec.call(spec.backends[backend], leaves, case)
            sum(o.float().sum() for o in outs).backward()
            results.append((outs, leaves))
        (outs, leaves), (outs_ref, leaves_ref) = results
        for o, r in zip(outs, outs_ref, strict=True):
            assert o.dtype == torch.bfloat16
            torch.testing.assert_close(o.float(), r.float(), rtol=2e-2, atol=2e-2)
        for n, x in leaves.items():
            assert x.grad.dtype == x.dtype, n
            torch.testing.assert_close(x.grad.float(), leaves_ref[n].grad.float(), rtol=5e-2, atol=5e-2, msg=n)


@pytest.mark.parametrize("op", ["rwkv7_prep", "rwkv7_out"])
def test_the_parameter_gradients_are_deterministic(op):
    """Per-thread partial sums added in thread order: two runs give the same bits."""
    spec = get_op(op)
    case = Case("det", {"B": 4, "T": 50, "H": 2, "N": 16})
    tensors = spec.sample(case, torch.Generator().manual_seed(0))
    first, second = (_run(op, "cpu", tensors, case, torch.float32)[1] for _ in range(2))
    for name in first:
        assert torch.equal(first[name], second[name]), name
