"""model.fused: the blocks through the fused block ops (shift_mix, rwkv7_prep, wkv7, rwkv7_out,
channel_mix) compute what the plain torch composition computes, for every layer kind and the
hybrid, with a state carried across segments, under grad_cp and chunked BPTT, in fp64 to rounding
and in fp32 over 50 training steps; the same parameters and names either way."""

import copy
from dataclasses import replace

import pytest
import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import build_model, parameter_groups
from rwkvx_cli.models.losses import micro_batch_loss

BASE = ModelConfig(vocab_size=97, n_layer=3, n_embd=64, head_size=16)
KINDS = {
    "rwkv7": {},
    "rwkvx": {"n_layer": 2, "n_attn": 1, "moba_chunk": 8},
    "rwkv4": {"layers": ["rwkv4", "rwkv4"]},
    "siblings": {"layers": ["gdn", "kda", "rwkv8"]},
}


def pair(kind: str, dtype=torch.float64, seed=0):
    """(fused, unfused) models of one kind with the same perturbed weights (the init zeroes the
    output projections, which would make every block the identity)."""
    cfg = replace(BASE, **KINDS[kind])
    fused = build_model(replace(cfg, fused=True), seed).to(dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=dtype))
    plain = copy.deepcopy(fused)
    for blk in plain.blocks:
        blk.fused = False
    return fused, plain


@pytest.mark.parametrize("kind", KINDS)
def test_fused_equals_unfused_in_fp64_with_a_carried_state(kind):
    fused, plain = pair(kind)
    idx = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(2))
    states = (None, None)
    for piece in (idx[:, :17], idx[:, 17:]):
        (lf, sf), (lp, sp) = fused(piece, states[0]), plain(piece, states[1])
        torch.testing.assert_close(lf, lp, rtol=1e-10, atol=1e-12)
        states = (sf, sp)
    for a, b in zip(states[0], states[1], strict=True):
        if a is not None:
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=1e-12, msg=key)
    (lf.square().sum() + sum(s["wkv"].sum() for s in states[0] if s and "wkv" in s)).backward()
    (lp.square().sum() + sum(s["wkv"].sum() for s in states[1] if s and "wkv" in s)).backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_the_same_parameters_and_names_either_way():
    fused, plain = pair("rwkv7")
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert [n for n, p in fused.named_parameters() if p.requires_grad] == [
        n for n, p in plain.named_parameters() if p.requires_grad
    ]


def test_grad_cp_and_chunked_bptt_give_the_fused_model_s_gradients():
    fused, _ = pair("rwkv7")
    idx = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(3))
    grads = []
    for grad_cp, chunk_len in ((False, 0), (True, 0), (False, 8)):
        model = copy.deepcopy(fused)
        model.grad_checkpointing = grad_cp
        loss, _ = micro_batch_loss(model, idx[:, :-1], idx[:, 1:], None, "chunked", True, chunk_len)
        loss.backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)


def test_token_by_token_equals_the_whole_sequence():
    fused, _ = pair("rwkv7")
    idx = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole, _ = fused(idx)
        state, steps = None, []
        for t in range(idx.shape[1]):
            logits, state = fused(idx[:, t : t + 1], state)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-10, atol=1e-12)


def _train(model, batches, lr=5e-3):
    opt = torch.optim.AdamW(parameter_groups(model, lr, 0.1), lr=lr, betas=(0.9, 0.99), eps=1e-18)
    losses = []
    for idx in batches:
        loss, _ = micro_batch_loss(model, idx[:, :-1], idx[:, 1:], None, "chunked", True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fifty_fp32_training_steps_agree_to_1e5():
    cfg = replace(BASE, n_layer=2)
    fused = build_model(cfg, 0)
    plain = build_model(replace(cfg, fused=False), 0)
    gen = torch.Generator().manual_seed(5)
    # Counting sequences from random starts: learnable, so the weights move far from the init.
    batches = [(torch.randint(0, 97, (4, 1), generator=gen) + torch.arange(33)) % 97 for _ in range(50)]
    a, b = _train(fused, batches), _train(plain, batches)
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    assert rel <= 1e-5, rel
    assert a[-1] < a[0] / 2  # it trained


def test_bf16_autocast_keeps_the_residual_stream_in_fp32_and_matches_unfused():
    fused, plain = pair("rwkv7", torch.float32)
    idx = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(6))
    outs = []
    for model in (fused, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x, state = model.hidden(idx)
        assert x.dtype == torch.float32 and state[1]["att_shift"].dtype == torch.float32
        x.square().mean().backward()
        outs.append((x.detach(), [p.grad for p in model.parameters() if p.grad is not None]))
    (xf, gf), (xp, gp) = outs
    assert (xf - xp).norm() / xp.norm() < 2e-2
    for a, b in zip(gf, gp, strict=True):
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6
