"""The chunked Triton wkv7 backend against the fp64 oracle, over the regimes its
decay scheme must survive (run through Triton's interpreter when there is no GPU).

Also covered for every production backend, this one included, in test_wkv7.py:
fp64 equality at N = 8 and 128, chained segments, T = 1, the saved-memory budget.
"""

import pytest
import torch

from rwkvx_cli.ops import wkv7
from rwkvx_cli.ops.wkv7.chunked_triton import CHUNK, W_MIN, unavailable
from rwkvx_cli.tools.gradcheck import compare

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

NAMES = ("r", "w", "k", "v", "a", "b")


def log_decays(kind, shape, g):
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    if kind == "rwkv7":  # the model's clamped range, w_eff in (0.545, 1)
        return -0.6 * u
    if kind == "near1":  # w_eff in (0.999, 1], exact 1 on a quarter of the entries
        return torch.where(u < 0.25, 0.0, -1e-3 * u)
    if kind == "near0":  # w_eff in (e^-25, e^-15): the state forgets within a step
        return -15.0 - 10.0 * u
    if kind == "mixed":  # per entry either e^-20 or (0.9, 1): a near-0 decay followed by slow ones
        return torch.where(u < 0.4, -20.0, -0.1 * u)
    if kind == "reset":  # some steps decay by e^-1000, below the clamp at W_MIN
        return torch.where(u < 0.2, -1000.0, -0.6 * u)
    raise ValueError(kind)


def sample(B, T, H, N, decay="rwkv7", seed=0):
    """Inputs in the gradient check's scales (r, k, v, state small; a = -kk, b = kk * gate),
    every value exactly representable in fp32, and fp32-representable cotangents."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, H, N)

    def u(scale):
        return scale * (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5)

    kk = torch.nn.functional.normalize(torch.randn(shape, generator=g, dtype=torch.float64), dim=-1)
    x = {"r": u(0.2), "w": log_decays(decay, shape, g), "k": u(0.2), "v": u(0.2), "a": -kk, "b": kk * u(1.0).abs()}
    state = 0.1 * (torch.rand(B, H, N, N, generator=g, dtype=torch.float64) - 0.5)
    cot_y = 0.2 * (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5)
    cot_s = 0.2 * (torch.rand(B, H, N, N, generator=g, dtype=torch.float64) - 0.5)
    f32 = lambda t: t.float().double()  # noqa: E731
    return {n: f32(t) for n, t in x.items()}, f32(state), f32(cot_y), f32(cot_s)


def run(backend, x, state, cot_y, cot_s, dtype):
    """y, state_out and the gradients of Σ cot_y y + Σ cot_s state_out, as fp64."""
    leaves = {n: x[n].detach().to(dtype).requires_grad_() for n in NAMES}
    s0 = state.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    y, s = wkv7(*(leaves[n] for n in NAMES), state=s0, backend=backend)
    ((y.double() * cot_y).sum() + (s.double() * cot_s).sum()).backward()
    grads = {n: leaves[n].grad.double() for n in NAMES}
    grads["state"] = s0.grad.double()
    return y.detach().double(), s.detach().double(), grads


def assert_gate_a(got, ref, check_vacuous=True):
    """The gradient check's gate A metric (max |g - ref| / (|ref| + 1e-6) < 1e-3) on every output."""
    (y, s, g), (y_ref, s_ref, g_ref) = got, ref
    cols = [compare("y", y, y_ref, False), compare("state_out", s, s_ref, False)]
    cols += [compare(f"d{n}", g[n], g_ref[n], check_vacuous) for n in g_ref]
    bad = [f"{c.name}: max_rel {c.max_rel:.2e}, ref max {c.ref_max:.1e}" for c in cols if not c.passed]
    assert not bad, "; ".join(bad)
    return cols


@pytest.mark.parametrize("decay", ["rwkv7", "near1", "mixed", "reset"])
def test_fp32_matches_the_fp64_oracle_over_ragged_chunks(decay):
    """T = 37 = 2 full chunks + 5 steps, a non-zero initial state, gradients of all six
    inputs and the state, with decays from the model's range to below the clamp."""
    x, state, cy, cs = sample(2, 2 * CHUNK + 5, 2, 16, decay)
    ref = run("reference", x, state, cy, cs, torch.float64)
    got = run("triton_chunked", x, state, cy, cs, torch.float32)
    assert_gate_a(got, ref)


def test_fp32_decays_near_0_keep_relative_accuracy():
    """Every step forgets the state (w_eff < e^-15): outputs still match, and dw, which is
    itself ~e^-15 times the others, matches relative to its own size (a scheme that
    forms dw as a reverse cumsum of r·dr - k·dk + ... loses it to cancellation)."""
    x, state, cy, cs = sample(1, 2 * CHUNK + 3, 2, 16, "near0", seed=1)
    ref = run("reference", x, state, cy, cs, torch.float64)
    got = run("triton_chunked", x, state, cy, cs, torch.float32)
    assert_gate_a(got, ref, check_vacuous=False)
    dw, dw_ref = got[2]["w"], ref[2]["w"]
    assert 0 < dw_ref.abs().max() < 1e-6  # the regime this test is about
    assert ((dw - dw_ref).norm() / dw_ref.norm()).item() < 1e-5
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()


@pytest.mark.parametrize("decay", ["rwkv7", "mixed", "reset"])
def test_fp64_equals_the_oracle(decay):
    """In fp64 the chunked algebra is exact to rounding, so any slip in the derivation shows."""
    x, state, cy, cs = sample(1, CHUNK + 7, 2, 4, decay, seed=2)
    y_ref, s_ref, g_ref = run("reference", x, state, cy, cs, torch.float64)
    y, s, g = run("triton_chunked", x, state, cy, cs, torch.float64)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-13)
    for n in g_ref:
        # the reset steps' dw is e^-1000 · O(1) exactly, and 0 here (the clamp's gradient)
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-9, atol=1e-13, msg=f"d{n}")


def test_clamped_steps_have_zero_dw_and_reset_the_state():
    x, state, cy, cs = sample(1, 9, 1, 4, "rwkv7", seed=3)
    x["w"][:, 4] = -1000.0
    x["a"][:, 4] = 0.0  # no delta-rule read of the old state either: S_4 = v_4 k_4ᵀ
    _, s, g = run("triton_chunked", x, state, cy, cs, torch.float32)
    assert (x["w"] < W_MIN).sum() == 4 and torch.count_nonzero(g["w"][:, 4]) == 0
    # the state after step 4 cannot depend on the state before it
    _, s2, g2 = run("triton_chunked", x, 7.0 * state, cy, cs, torch.float32)
    torch.testing.assert_close(s2, s, rtol=1e-6, atol=1e-9)
    assert torch.count_nonzero(g["state"]) > 0  # through y_0..y_3


def test_bf16_inputs_round_only_the_outputs():
    """bf16 inputs are computed in fp32: the result equals the fp32 run on the same
    (bf16-representable) values up to the final rounding to bf16."""
    x, state, cy, cs = sample(2, CHUNK + 9, 2, 16, seed=4)
    x = {n: t.to(torch.bfloat16).double() for n, t in x.items()}
    cy = cy.to(torch.bfloat16).double()  # the bf16 run's dL/dy is rounded to bf16 too
    y32, s32, g32 = run("triton_chunked", x, state, cy, cs, torch.float32)
    y16, s16, g16 = run("triton_chunked", x, state, cy, cs, torch.bfloat16)
    half_ulp = 2.0**-8  # bf16 keeps 8 significant bits
    torch.testing.assert_close(y16, y32, rtol=half_ulp, atol=1e-30)
    torch.testing.assert_close(s16, s32, rtol=1e-6, atol=1e-9)  # the state stays fp32
    for n in NAMES:
        torch.testing.assert_close(g16[n], g32[n], rtol=half_ulp, atol=1e-30, msg=f"d{n}")
    torch.testing.assert_close(g16["state"], g32["state"], rtol=1e-6, atol=1e-9)
    # and against the oracle, at bf16 precision
    y_ref, s_ref, _ = run("reference", x, state, cy, cs, torch.float64)
    assert ((y16 - y_ref).norm() / y_ref.norm()).item() < 4e-3
    assert ((s16 - s_ref).norm() / s_ref.norm()).item() < 1e-5


def test_head_size_64():
    """The model's head size, two chunks (T = 20): fp32 against the fp64 oracle by the
    RMS ratio (max-relative measures fp32 rounding at this size), and fp64 exactly."""
    x, state, cy, cs = sample(1, 20, 1, 64, seed=5)
    ref = run("reference", x, state, cy, cs, torch.float64)
    y, s, g = run("triton_chunked", x, state, cy, cs, torch.float32)

    def rms_ratio(got, want):
        return ((got - want).norm() / want.norm()).item()

    assert rms_ratio(y, ref[0]) < 1e-5 and rms_ratio(s, ref[1]) < 1e-5
    for n in ref[2]:
        assert rms_ratio(g[n], ref[2][n]) < 1e-5, n
    y, s, g = run("triton_chunked", x, state, cy, cs, torch.float64)
    torch.testing.assert_close(y, ref[0], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(s, ref[1], rtol=1e-10, atol=1e-13)
    for n in ref[2]:
        torch.testing.assert_close(g[n], ref[2][n], rtol=1e-9, atol=1e-13, msg=f"d{n}")


def test_gradient_flows_in_through_state_out_only():
    """dL/dy = 0: every gradient comes from the final state."""
    x, state, _, cs = sample(1, 2 * CHUNK + 1, 1, 8, "near1", seed=6)
    zero = torch.zeros_like(x["r"])
    ref = run("reference", x, state, zero, cs, torch.float64)
    got = run("triton_chunked", x, state, zero, cs, torch.float32)
    cols = assert_gate_a(got, ref, check_vacuous=False)
    assert all(c.ref_max > 1e-4 for c in cols if c.name not in ("y", "dr"))
    assert torch.count_nonzero(got[2]["r"]) == 0


def test_fp64_equals_the_oracle_over_partial_value_and_key_blocks():
    """N = 48: the backward's value-block loop (32 columns) ends on a half-masked block, the
    state walks take three 16-row blocks and the key blocks end part-masked as well."""
    x, state, cy, cs = sample(1, 2 * CHUNK + 5, 1, 48, "mixed", seed=3)
    y_ref, s_ref, g_ref = run("reference", x, state, cy, cs, torch.float64)
    y, s, g = run("triton_chunked", x, state, cy, cs, torch.float64)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-13)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-9, atol=1e-13, msg=f"d{n}")
