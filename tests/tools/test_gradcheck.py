"""The gates themselves: they pass for every registered backend, and they fail
for backends with a planted bug (a check that cannot fail is a defect)."""

from dataclasses import replace

import pytest
import torch

from rwkvx_cli.ops import Backend, get_op, op_names
from rwkvx_cli.tools.gradcheck import THRESHOLD, compare, gate_a, gate_b, run_gradcheck

BACKENDS = [(op, bk.name) for op in op_names() for bk in get_op(op).production_backends()]


@pytest.mark.parametrize("op,backend", BACKENDS)
def test_gate_a_passes(op, backend):
    spec = get_op(op)
    for i, case in enumerate(spec.cases):
        result = gate_a(spec, spec.backends[backend], case, seed=i)
        failing = [(c.name, c.max_rel, c.ref_max) for c in result.columns if not c.passed]
        assert result.passed, f"{case.name}: {failing}"


@pytest.mark.parametrize("op,backend", BACKENDS)
def test_gate_b_passes(op, backend):
    spec = get_op(op)
    result = gate_b(spec, spec.backends[backend], spec.fd_case, seed=0)
    names = {c.name for c in result.columns}
    assert names == {f"d{n}" for n in (*spec.inputs, *spec.states)}
    assert result.passed, [(c.name, c.max_rel) for c in result.columns]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor` (a planted backward bug)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _wkv7_with(bug):
    spec = get_op("wkv7")
    ref = spec.backends["reference"].fn

    def fn(r, w, k, v, a, b, state):
        if bug == "output":
            y, s = ref(r, w, k, v, a, b, state)
            return y * (1 + 1e-2), s
        if bug == "grad_a":
            return ref(r, w, k, v, _ScaleGrad.apply(a, 1.01), b, state)
        if bug == "grad_state":
            return ref(r, w, k, v, a, b, _ScaleGrad.apply(state, 1.01))
        raise AssertionError(bug)

    bk = Backend(f"buggy_{bug}", fn, "planted bug")
    return replace(spec, backends={**spec.backends, bk.name: bk}), bk


@pytest.mark.parametrize("bug,column", [("output", "y"), ("grad_a", "da"), ("grad_state", "dstate")])
def test_gate_a_catches_planted_bugs(bug, column):
    spec, bk = _wkv7_with(bug)
    result = gate_a(spec, bk, spec.cases[0], seed=0)
    failed = {c.name for c in result.columns if not c.passed}
    assert column in failed and not result.passed


@pytest.mark.parametrize("bug,column", [("grad_a", "da"), ("grad_state", "dstate")])
def test_gate_b_catches_planted_bugs(bug, column):
    spec, bk = _wkv7_with(bug)
    result = gate_b(spec, bk, spec.fd_case, seed=0)
    failed = {c.name for c in result.columns if not c.passed}
    assert failed == {column}


def _moba_with_cache_bug():
    """moba's tiled backend with the gradient of its cached values scaled by 1.01."""
    spec = get_op("moba")
    tiled = spec.backends["tiled"].fn

    def fn(q, k, v, state, **kw):
        return tiled(q, k, v, (state[0], _ScaleGrad.apply(state[1], 1.01)), **kw)

    bk = Backend("buggy_cache", fn, "planted bug", resets=True)
    return replace(spec, backends={**spec.backends, bk.name: bk}), bk


def test_both_gates_check_moba_s_cache():
    """The cache is among the checked inputs: a wrong cache gradient fails gate A (on the cases with a
    cache) and gate B; a case without one has no cache column (an empty tensor has no gradient)."""
    spec, bk = _moba_with_cache_bug()
    by_name = {case.name: case for case in spec.cases}
    result = gate_a(spec, bk, by_name["cache"], seed=0)
    assert {c.name for c in result.columns if not c.passed} == {"dv_cache"}
    plain = gate_a(spec, bk, by_name["canonical"], seed=0)
    assert plain.passed and "dv_cache" not in {c.name for c in plain.columns}
    result = gate_b(spec, bk, spec.fd_case, seed=0)
    assert {c.name for c in result.columns if not c.passed} == {"dv_cache"}


def test_compare_metric():
    ref = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    got = torch.tensor([1.002, -2.0, 5e-10], dtype=torch.float64)
    col = compare("dx", got, ref, is_grad=True)
    assert col.max_rel == pytest.approx(2e-3 / (1 + 1e-6), rel=1e-6)  # not 5e-10 / 1e-6
    assert col.rms_ratio == pytest.approx(((4e-6 + 25e-20) / 3) ** 0.5 / (5 / 3) ** 0.5, rel=1e-6)
    assert col.ref_max == 2.0 and not col.vacuous
    assert not col.passed
    assert THRESHOLD == 1e-3
    assert compare("dx", got[1:], ref[1:], is_grad=True).passed  # 5e-4 only


def test_vacuous_gradient_fails_even_when_equal():
    tiny = torch.full((4,), 1e-5)
    col = compare("dx", tiny, tiny, is_grad=True)
    assert col.max_rel == 0.0 and col.vacuous and not col.passed
    assert compare("y", tiny, tiny, is_grad=False).passed  # outputs are not gradients


def test_report_json_shape():
    spec = get_op("wkv7")
    small = replace(spec, cases=spec.cases[:1])
    report = run_gradcheck(small, [spec.backends["recurrent"]], seed=3)
    d = report.to_dict()
    assert d["op"] == "wkv7" and d["seed"] == 3 and d["passed"] is True
    assert [r["gate"] for r in d["results"]] == ["A", "B"]
    cols = d["results"][0]["columns"]
    assert [c["name"] for c in cols] == ["y", "state_out", "dr", "dw", "dk", "dv", "da", "db", "dstate", "dw_eff"]
    assert all(c["max_rel"] < THRESHOLD and c["passed"] for c in cols)


def test_gate_b_differences_each_reference_afresh():
    """Gate B's finite differences are kept per (op, case, seed) across backends; a spec with another
    reference (here one whose outputs are 1% off) must be differenced anew, so the right backend fails."""
    spec = get_op("shift_mix")
    assert gate_b(spec, spec.backends["cpu"], spec.fd_case, seed=0).passed
    ref = spec.backends[spec.reference]

    def off(*args, **kwargs):
        ys, state = ref.fn(*args, **kwargs)
        return tuple(y * 1.01 for y in ys), state

    skewed = replace(spec, backends={**spec.backends, "reference": replace(ref, fn=off)})
    assert not gate_b(skewed, skewed.backends["cpu"], skewed.fd_case, seed=0).passed
