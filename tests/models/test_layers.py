"""Layer patterns and the recurrent relatives' blocks (rwkv4, gdn, kda, rwkv8):
config parsing, state carried across segments and single tokens, gradients
reaching every parameter, seeded init."""

import math

import pytest
import torch

from rwkvx_cli.config import LAYER_KINDS, ConfigError, ModelConfig, load_config
from rwkvx_cli.models import build_model
from rwkvx_cli.models.layers import TIME_MIXES
from rwkvx_cli.models.model import layer_kinds

KINDS = ("rwkv4", "gdn", "kda", "rwkv8")


def small(layers, **kw):
    cfg = ModelConfig(vocab_size=97, n_embd=64, head_size=32, moba_chunk=4, moba_top_k=1, **kw)
    cfg.layers = list(layers)
    cfg.n_layer = len([k for k in layers if k != "moba"])
    cfg.n_attn = len(layers) - cfg.n_layer
    return cfg


def perturbed(cfg, seed=0):
    """Init zeroes the output projections (every block starts as the identity); perturb
    so each time mix shapes the logits."""
    model = build_model(cfg, seed)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.double()


def test_layer_pattern_config():
    cfg = load_config(None, ["model.layers=rwkv7*2,moba,gdn", "model.n_embd=64", "model.head_size=32"])
    assert cfg.model.layers == ["rwkv7", "rwkv7", "moba", "gdn"]
    assert (cfg.model.n_layer, cfg.model.n_attn) == (3, 1)
    assert layer_kinds(cfg.model) == cfg.model.layers
    assert layer_kinds(load_config(None, ["model.n_layer=3", "model.n_attn=1"]).model) == [
        "rwkv7",
        "rwkv7",
        "rwkv7",
        "moba",
    ]
    yaml_list = load_config(None, ["model.layers=[kda, rwkv8, rwkv4]"]).model
    assert yaml_list.layers == ["kda", "rwkv8", "rwkv4"] and yaml_list.n_layer == 3
    for override, message in (
        ("model.layers=rwkv7,gdm", "did you mean 'gdn'"),
        ("model.layers=rwkv7*x", "repeat count"),
        ("model.layers=moba*2", "at least one recurrent layer"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="model.n_layer: 7 disagrees with model.layers"):
        load_config(None, ["model.layers=rwkv7,gdn", "model.n_layer=7"])


def test_every_layer_kind_has_a_time_mix_and_an_unknown_one_is_an_error():
    assert set(TIME_MIXES) == set(LAYER_KINDS)
    cfg = small(["rwkv7"])
    cfg.layers = ["rwkv7", "gdm"]  # past config validation, which names the nearest kind
    with pytest.raises(ValueError, match="unknown layer kind 'gdm'"):
        build_model(cfg, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_block_state_carries_across_segments_and_tokens(kind):
    torch.manual_seed(0)
    model = perturbed(small([kind, "rwkv7", kind]))
    assert model.kinds == [kind, "rwkv7", kind] and model.recurrent
    assert isinstance(model.blocks[0].att, TIME_MIXES[kind]) and hasattr(model.blocks[0], "ln0")
    assert not hasattr(model.blocks[1], "ln0")
    idx = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(0))
    full, _ = model(idx)
    first, state = model(idx[:, :6])
    second, _ = model(idx[:, 6:], state)
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-9, atol=1e-9)
    state, steps = None, []
    for t in range(idx.shape[1]):
        logits, state = model(idx[:, t : t + 1], state)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
    # the carried state matters: the last token alone predicts differently
    assert (full[:, -1] - model(idx[:, -1:])[0][:, 0]).abs().max() > 1e-4
    empty = model.empty_state(2, torch.device("cpu"))
    assert set(empty[0]) == set(state[0]) and all(empty[0][k].shape == state[0][k].shape for k in state[0])


@pytest.mark.parametrize("kind", KINDS)
def test_every_parameter_gets_a_gradient(kind):
    model = perturbed(small([kind, kind]))
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    loss, _ = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert math.isfinite(loss.item())
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


def test_rwkv8_value_heads_and_seeded_init():
    shared = build_model(small(["rwkv8"]), 0)
    per_head = build_model(small(["rwkv8"], rwkv8_shared_value=False), 0)
    att_s, att_p = shared.blocks[0].att, per_head.blocks[0].att
    assert not hasattr(att_s, "value") and att_s.output.weight.shape == (64, 2 * 64)
    assert att_p.value.weight.shape == (64, 64) and att_p.output.weight.shape == (64, 64)
    d = torch.sigmoid(att_s.decay_logit)
    assert 0.74 < d.min() < 0.76 and 0.998 < d.max() < 1  # time scales 4 .. 1024 tokens
    again = build_model(small(["rwkv8"]), 0)
    other = build_model(small(["rwkv8"]), 1)
    sd, sd2, sd3 = shared.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert not torch.equal(sd["blocks.0.att.query.weight"], sd3["blocks.0.att.query.weight"])


def test_delta_layer_gates_follow_published_init():
    model = build_model(small(["gdn", "kda"]), 0)
    for blk in model.blocks:
        A = torch.exp(blk.att.A_log)
        assert A.min() >= 1 and A.max() <= 16
        dt = torch.nn.functional.softplus(blk.att.dt_bias)
        assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6
        assert torch.count_nonzero(blk.att.o_proj.weight) == 0
    assert model.blocks[0].att.dt_bias.shape == (2,) and model.blocks[1].att.dt_bias.shape == (64,)


def test_rwkv4_init_and_decay():
    model = build_model(small(["rwkv4", "rwkv4"]), 0)
    att = model.blocks[0].att
    assert att.time_decay[0].item() == pytest.approx(-5) and att.time_decay[-1].item() == pytest.approx(3)
    assert att.time_first[0].item() == pytest.approx(math.log(0.3))
    assert torch.count_nonzero(att.output.weight) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_square_equals_autograds_relu_squared(dtype):
    """The channel mix's fused relu(x)²: the values and gradients of `relu(x) ** 2`, to the bit
    (up to the sign of a masked zero), in fp32 and bf16."""
    from rwkvx_cli.models.layers.common import relu_square

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 5, 64, generator=g).to(dtype)
    x0[0, 0, :4] = 0.0  # relu's kink: both give a zero gradient there
    dy = torch.randn(x0.shape, generator=g).to(dtype)
    outs, grads = [], []
    for f in (relu_square, lambda x: torch.relu(x) ** 2):
        x = x0.clone().requires_grad_(True)
        y = f(x)
        y.backward(dy)
        outs.append(y.detach())
        grads.append(x.grad)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0], grads[1]) and (grads[0] != 0).any() and (grads[0] == 0).any()
    x = torch.randn(4, 8, dtype=torch.float64, generator=g).requires_grad_(True)
    assert torch.autograd.gradcheck(relu_square, (x,))
