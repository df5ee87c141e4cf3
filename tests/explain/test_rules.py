"""The per-layer LRP rules: the recurrences' gradient form against their explicit splits with
the state-relevance carry (explain/rules.py), the running maximum changing no share, each
layer's modified graph computing the layer's own forward, and seed 004's single-channel L=3
example worked by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from rwkvx_cli.explain.graph import LRPGraph, layer_norm_lrp, wkv4_lrp, wkv7_lrp
from rwkvx_cli.explain.rules import wkv4_relevance, wkv7_relevance
from rwkvx_cli.models.layers import ChannelMix, RWKV4TimeMix, RWKV7TimeMix
from rwkvx_cli.ops.wkv4.reference import wkv4_reference
from rwkvx_cli.ops.wkv7.reference import wkv7_reference

D = torch.float64
B, T, H, N = 2, 7, 2, 3


def randn(gen, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=gen, dtype=D)


def grad_form(fn, v, cotangent):
    """(y, R(v)) with R(v) = v ⊙ ∂<cotangent, y>/∂v: the relevance of v when R(y) = y ⊙ cotangent."""
    v = v.clone().requires_grad_(True)
    y = fn(v)
    (y * cotangent).sum().backward()
    return y.detach(), (v * v.grad).detach()


def wkv4_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = -torch.exp(randn(g, H, N))
    u = randn(g, H, N)
    k = randn(g, B, T, H, N, scale=3.0)  # large keys: the running maximum moves
    return w, u, k, randn(g, B, T, H, N), randn(g, B, T, H, N)


@pytest.mark.parametrize("eps", [0.0, 0.05])
def test_wkv4_gradient_form_is_the_explicit_rule(eps):
    w, u, k, v, cot = wkv4_inputs()
    fresh = (torch.zeros(B, H, N, dtype=D), torch.zeros(B, H, N, dtype=D), torch.full((B, H, N), -1e38, dtype=D))
    y, r_v = grad_form(lambda v: wkv4_lrp(w, u, k, v, eps), v, cot)
    torch.testing.assert_close(y, wkv4_reference(w, u, k, v, fresh)[0], rtol=1e-13, atol=1e-13)
    explicit = wkv4_relevance(w, u, k, v, y * cot, eps)
    torch.testing.assert_close(r_v, explicit, rtol=1e-10, atol=1e-12)
    gap = float((y * cot).sum() - r_v.sum())
    assert abs(gap) < 1e-12 if eps == 0 else abs(gap) > 1e-6  # conserved exactly at ε = 0 only


def test_wkv4_running_maximum_changes_no_share():
    w, u, k, v, cot = wkv4_inputs(1)
    fresh = (torch.zeros(B, H, N, dtype=D), torch.zeros(B, H, N, dtype=D), torch.full((B, H, N), -1e38, dtype=D))
    r_y = wkv4_reference(w, u, k, v, fresh)[0] * cot
    stabilised = wkv4_relevance(w, u, k, v, r_y, stabilised=True)
    plain = wkv4_relevance(w, u, k, v, r_y, stabilised=False)  # the seed's a_t, b_t
    torch.testing.assert_close(stabilised, plain, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stabilised.sum(), r_y.sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eps", [0.0, 0.05])
def test_wkv7_gradient_form_is_the_explicit_rule(eps):
    g = torch.Generator().manual_seed(2)
    r, k, v, cot = (randn(g, B, T, H, N) for _ in range(4))
    w = -torch.exp(randn(g, B, T, H, N) - 1)
    kk = F.normalize(randn(g, B, T, H, N), dim=-1)
    a, b = -kk, kk * torch.rand(B, T, H, N, generator=g, dtype=D)
    y, r_v = grad_form(lambda v: wkv7_lrp(r, w, k, v, a, b, eps), v, cot)
    torch.testing.assert_close(y, wkv7_reference(r, w, k, v, a, b, torch.zeros(B, H, N, N, dtype=D))[0])
    explicit = wkv7_relevance(r, w, k, v, a, b, y * cot, eps)
    torch.testing.assert_close(r_v, explicit, rtol=1e-10, atol=1e-12)
    if eps == 0:
        torch.testing.assert_close(r_v.sum(), (y * cot).sum(), rtol=1e-12, atol=1e-12)


def perturbed(module, seed):
    g = torch.Generator().manual_seed(seed)
    module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=D))
    return module


@pytest.mark.parametrize("layer_id", [0, 1])
def test_modified_graphs_compute_the_layers_forward(layer_id):
    """Detaching changes no value: each layer's forward through LRP's graph returns what the plain one does."""
    g = torch.Generator().manual_seed(3)
    C, hs = 16, 8
    x = randn(g, 2, 9, C)
    v_first = randn(g, 2, 9, C)
    tm7 = perturbed(RWKV7TimeMix(C, hs, layer_id), 4)
    tm4 = perturbed(RWKV4TimeMix(C, hs), 5)
    cm = perturbed(ChannelMix(C), 6)
    ln = perturbed(torch.nn.LayerNorm(C), 7)
    for eps in (0.0, 0.1):
        for mix in (tm7, tm4):
            out, vf, _ = mix(x, v_first)
            out_lrp, vf_lrp, _ = mix(x, v_first, None, LRPGraph(eps))
            torch.testing.assert_close(out_lrp, out, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(vf_lrp, vf, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cm(x, None, LRPGraph(eps))[0], cm(x)[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer_norm_lrp(ln, x, eps), ln(x), rtol=1e-12, atol=1e-12)


# Seed 004's example: one channel, L = 3, the seed's own (unstabilised) notation, x_0 = 0.
X = [0.5, -1.0, 2.0]
MU_R, MU_K, MU_V = 0.6, 0.3, 0.8
W_R, W_K, W_V, W_O = 0.7, 1.2, -0.9, 1.5
W_DECAY, U = 0.4, 0.2  # decay = exp(-w)


def seed_example_by_hand():
    """o_3 and R(x_1..x_3) for R(o_3) = o_3, following the seed's rule step by step."""
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    prev = [0.0, *X[:-1]]
    xr = [MU_R * X[t] + (1 - MU_R) * prev[t] for t in range(3)]
    xk = [MU_K * X[t] + (1 - MU_K) * prev[t] for t in range(3)]
    xv = [MU_V * X[t] + (1 - MU_V) * prev[t] for t in range(3)]
    r = [sig(W_R * z) for z in xr]
    k = [W_K * z for z in xk]
    v = [W_V * z for z in xv]
    decay = math.exp(-W_DECAY)
    a, b, A = 0.0, 0.0, []  # A[t]: the numerator state a after step t
    for t in range(3):
        e = math.exp(U + k[t])
        num, den = a + e * v[t], b + e
        wkv, last = num / den, (a, e, den)
        a, b = decay * a + math.exp(k[t]) * v[t], decay * b + math.exp(k[t])
        A.append(a)
    o3 = W_O * r[2] * wkv
    # W_o is 1x1 (its z-rule passes everything), r_3 a constant gate: R(wkv_3) = o_3.
    a_before, e3, den3 = last
    r_v = [0.0, 0.0, 0.0]
    r_v[2] += (e3 * v[2] / den3) / wkv * o3  # wkv_3 = (1/den) a_2 + (e_3/den) v_3
    r_a = (a_before / den3) / wkv * o3
    for t in (1, 0):  # a_t = decay a_{t-1} + kk_t v_t, with a_0 = 0
        r_v[t] += math.exp(k[t]) * v[t] / A[t] * r_a
        r_a = decay * (A[t - 1] if t else 0.0) / A[t] * r_a
    r_x = [0.0, 0.0, 0.0]
    for t in range(3):  # W_v is 1x1; xv_t = mu_v x_t + (1 - mu_v) x_{t-1}
        r_x[t] += MU_V * X[t] / xv[t] * r_v[t]
        if t:
            r_x[t - 1] += (1 - MU_V) * X[t - 1] / xv[t] * r_v[t]
    return o3, r_x


def test_seed_single_channel_example():
    o3, by_hand = seed_example_by_hand()
    assert sum(by_hand) == pytest.approx(o3, rel=1e-14)  # the seed's claim: it conserves exactly
    assert o3 == pytest.approx(-0.3189854, abs=1e-7)
    assert by_hand == pytest.approx([-0.1245223, 0.3107662, -0.5052293], abs=1e-7)

    tm = RWKV4TimeMix(1, 1).double()
    with torch.no_grad():
        tm.time_decay.fill_(math.log(W_DECAY))  # rwkvx's log decay is -exp(time_decay) = -w
        tm.time_first.fill_(U)
        for p, val in ((tm.time_mix_r, MU_R), (tm.time_mix_k, MU_K), (tm.time_mix_v, MU_V)):
            p.fill_(val)
        for lin, val in ((tm.receptance, W_R), (tm.key, W_K), (tm.value, W_V), (tm.output, W_O)):
            lin.weight.fill_(val)
    x = torch.tensor(X, dtype=D).view(1, 3, 1).requires_grad_(True)
    out, _, _ = tm(x, None, None, LRPGraph())
    out[0, -1, 0].backward()
    assert float(out[0, -1, 0].detach()) == pytest.approx(o3, rel=1e-12)
    with torch.no_grad():
        assert float(tm(x.detach(), None)[0][0, -1, 0]) == pytest.approx(o3, rel=1e-12)
    assert (x * x.grad).detach().view(3).tolist() == pytest.approx(by_hand, rel=1e-12)
