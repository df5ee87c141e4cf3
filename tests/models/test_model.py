import math

import pytest
import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import block_kinds, build_model, parameter_groups

CFG = ModelConfig(vocab_size=300, n_layer=3, n_embd=64, head_size=32)


def perturbed(cfg=CFG, seed=0):
    """Init zeroes the output projections, making every block the identity; perturb so
    the recurrence actually shapes the logits."""
    model = build_model(cfg, seed)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def test_state_dict_matches_rwkv_lm_names_and_shapes():
    sd = build_model(CFG, 0).state_dict()
    C, H, N, V = 64, 2, 32, 300
    expect = {"emb.weight": (V, C), "ln_out.weight": (C,), "head.weight": (V, C), "blocks.0.ln0.weight": (C,)}
    for i in range(3):
        b = f"blocks.{i}"
        expect.update({f"{b}.ln1.weight": (C,), f"{b}.ln2.bias": (C,), f"{b}.att.r_k": (H, N)})
        for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"):
            expect[f"{b}.att.{n}"] = (1, 1, C)
        for n in ("receptance", "key", "value", "output"):
            expect[f"{b}.att.{n}.weight"] = (C, C)
        expect.update({f"{b}.att.w1": (C, 32), f"{b}.att.w2": (32, C), f"{b}.att.g1": (C, 32)})
        expect.update({f"{b}.att.ln_x.weight": (C,), f"{b}.ffn.x_k": (1, 1, C)})
        expect.update({f"{b}.ffn.key.weight": (4 * C, C), f"{b}.ffn.value.weight": (C, 4 * C)})
    for name, shape in expect.items():
        assert tuple(sd[name].shape) == shape, name
    assert "blocks.1.ln0.weight" not in sd
    assert not [k for k in sd if not k.startswith(("emb.", "blocks.", "ln_out.", "head."))]


def test_init_is_seeded_and_deterministic():
    a, b, c = build_model(CFG, 7).state_dict(), build_model(CFG, 7).state_dict(), build_model(CFG, 8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.att.receptance.weight"], c["blocks.0.att.receptance.weight"])


def test_init_values_follow_the_better_rwkv7_init():
    model = build_model(CFG, 0)
    C, N, L = 64, 32, 3
    att = model.blocks[1].att
    n = torch.arange(C, dtype=torch.float64)
    r0, r1 = 1 / (L - 1), 1 - 1 / L
    z = ((n % N) - (N - 1) / 2) / ((N - 1) / 2)
    www = -6 + 6 * (n / (C - 1)) ** (1 + r0**0.3)
    torch.testing.assert_close(att.w0.view(-1).double(), www + 0.5 + 2.5 * z * z.abs(), atol=1e-6, rtol=0)
    torch.testing.assert_close(att.x_r.view(-1).double(), 1 - (n / C) ** (0.2 * r1), atol=1e-6, rtol=0)
    torch.testing.assert_close(att.ln_x.weight.detach(), torch.full((C,), (2 / 3) ** 0.7))
    assert torch.count_nonzero(att.output.weight) == 0 and torch.count_nonzero(model.blocks[0].ffn.value.weight) == 0
    assert torch.count_nonzero(att.w1) == 0
    w2 = att.w2.double()  # orthogonal rows with gain 0.1
    torch.testing.assert_close(w2 @ w2.T, 0.01 * torch.eye(32, dtype=torch.float64), atol=1e-6, rtol=0)
    head = model.head.weight.double()  # V > C: gain 0.5 sqrt(V/C), orthonormal columns
    torch.testing.assert_close(head.T @ head, 0.25 * 300 / 64 * torch.eye(64, dtype=torch.float64), atol=1e-5, rtol=0)
    assert model.emb.weight.abs().max() <= 1e-4
    assert att.k_a.mean().item() == pytest.approx(1.02) and att.r_k.mean().item() == pytest.approx(-0.04)


def test_optimizer_groups():
    model = build_model(CFG, 0)
    groups = {g["name"]: g for g in parameter_groups(model, 1e-3, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    w0 = {names[id(p)] for p in groups["w0_2x"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert w0 == {f"blocks.{i}.att.w0" for i in range(3)} and groups["w0_2x"]["lr_scale"] == 2.0
    assert "blocks.0.att.key.weight" in decay and "head.weight" in decay and "blocks.0.att.w1" not in decay
    assert groups["decay"]["weight_decay"] == 0.1 and groups["1x"]["weight_decay"] == 0.0
    total = sum(len(g["params"]) for g in groups.values())
    assert total == len(list(model.parameters()))


def test_state_carries_across_segments_and_tokens():
    model = perturbed()
    idx = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(0))
    full, _ = model(idx)
    first, state = model(idx[:, :11])
    second, _ = model(idx[:, 11:], state)
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-4, atol=1e-5)
    # one token at a time: the O(1) generation path
    state, steps = None, []
    for t in range(idx.shape[1]):
        logits, state = model(idx[:, t : t + 1], state)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    assert abs(full[:, -1] - model(idx[:, -1:])[0][:, 0]).max() > 1e-3  # the state matters


def test_rwkvx_interleaving_rule():
    assert block_kinds(4, 0) == ["rwkv7"] * 4
    assert block_kinds(6, 2) == ["rwkv7"] * 3 + ["moba"] + ["rwkv7"] * 3 + ["moba"]
    assert block_kinds(5, 2) == ["rwkv7", "rwkv7", "moba", "rwkv7", "rwkv7", "moba", "rwkv7"]
    cfg = ModelConfig(vocab_size=64, n_layer=4, n_embd=64, head_size=32, n_attn=2, moba_chunk=4, moba_top_k=1)
    model = perturbed(cfg)
    assert model.kinds == ["rwkv7", "rwkv7", "moba", "rwkv7", "rwkv7", "moba"] and not model.recurrent
    sd = model.state_dict()
    for n in ("receptance", "key", "value", "output"):
        assert tuple(sd[f"blocks.2.att.{n}.weight"].shape) == (64, 64)
    idx = torch.randint(0, 64, (2, 13))
    loss, _ = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert math.isfinite(loss.item()) and model.blocks[2].att.key.weight.grad.abs().max() > 0
