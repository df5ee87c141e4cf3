"""The trainer's optimizers (models/optimizer.py). AdamW: torch's fused kernel, the for-loop form's values, and a
checkpoint written by another implementation (an older rwkvx: the for-loop form) resumes into it. Muon: which
tensors it takes, its update against the formula in fp64, its state, and how matrices are dealt to ranks."""

import pytest
import torch

from rwkvx_cli.checkpoints.full import load_full_state
from rwkvx_cli.checkpoints.manager import check_optimizer_state
from rwkvx_cli.config import ModelConfig
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.models import build_model, parameter_groups
from rwkvx_cli.models.model import muon_matrices
from rwkvx_cli.models.optimizer import MuonAdamW, adamw, newton_schulz, owners


def _stepped(opt_of, steps=3):
    model = build_model(ModelConfig(vocab_size=50, n_layer=1, n_embd=32, head_size=16), 0)
    opt = opt_of(parameter_groups(model, 1e-3, 0.1))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return model, opt


def test_fused_adamw_takes_the_for_loop_s_steps():
    fused, opt = _stepped(lambda groups: adamw(groups, 1e-3, (0.9, 0.99), 1e-18))
    loop, _ = _stepped(lambda groups: torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99), eps=1e-18))
    assert all(g["fused"] for g in opt.param_groups)
    for a, b in zip(fused.parameters(), loop.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_for_loop_checkpoint_resumes_into_the_fused_optimizer():
    loop, loop_opt = _stepped(lambda groups: torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99), eps=1e-18))
    saved = loop_opt.state_dict()
    assert saved["param_groups"][0]["fused"] is None  # what the for-loop form saves
    model = build_model(ModelConfig(vocab_size=50, n_layer=1, n_embd=32, head_size=16), 1)
    opt = adamw(parameter_groups(model, 1e-3, 0.1), 1e-3, (0.9, 0.99), 1e-18)
    shapes = [p.shape for g in opt.param_groups for p in g["params"]]
    check_optimizer_state(saved, opt.param_groups, shapes, "step_00000003")  # no refusal
    load_full_state(model, opt, loop.state_dict(), saved)
    assert all(g["fused"] is True and g["foreach"] is None for g in opt.param_groups)
    assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].abs().sum() > 0


# -- Muon (train.optimizer=muon) ---------------------------------------------------------------------
def _muon_model(layers=None, n_layer=1):
    extra = {"layers": layers} if layers else {}
    return build_model(ModelConfig(vocab_size=50, n_layer=n_layer, n_embd=32, head_size=16, **extra), 0)


def test_newton_schulz_keeps_the_singular_vectors_and_brings_the_values_near_one():
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    o = newton_schulz(g)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    so = torch.linalg.svdvals(o)
    assert 0.6 < so.min() and so.max() < 1.25, so  # Keller Jordan's coefficients: not exactly 1
    # o = U diag(f(s)) V^T for the same U and V: projecting o on them gives a diagonal matrix
    inner = u.T @ o @ vh.T
    off = inner - torch.diag(torch.diagonal(inner))
    assert off.abs().max() < 1e-6 and torch.diagonal(inner).min() > 0.6
    # a tall matrix is its transpose's transpose
    torch.testing.assert_close(newton_schulz(g.T), o.T, rtol=1e-6, atol=1e-9)


def test_muon_groups_take_the_hidden_matrices_and_nothing_else():
    model = _muon_model(["rwkv7", "moba", "gdn", "kda", "rwkv4", "rwkv8"], 6)
    names = set(muon_matrices(model))
    assert "emb.weight" not in names and "head.weight" not in names
    assert {"blocks.0.att.receptance.weight", "blocks.0.ffn.key.weight", "blocks.1.att.key.weight"} <= names
    assert "blocks.0.att.w1" not in names and "blocks.3.att.f_a.weight" not in names  # LoRA: only on request
    assert "blocks.2.att.conv.weight" not in names and "blocks.5.att.decay_logit" not in names  # not matrices
    with_lora = set(muon_matrices(model, lora=True))
    assert with_lora - names == {
        *(f"blocks.0.att.{k}" for k in ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2")),
        *(f"blocks.3.att.{k}.weight" for k in ("f_a", "f_b", "g_a", "g_b")),
    }
    params = dict(model.named_parameters())
    assert all(params[n].dim() == 2 for n in with_lora)
    groups = parameter_groups(model, 1e-3, 0.1, muon=True)
    assert [g["name"] for g in groups] == ["1x", "w0_2x", "decay", "muon"]
    assert [g["muon"] for g in groups] == [False, False, False, True]
    assert {id(p) for p in groups[3]["params"]} == {id(params[n]) for n in names}
    # every parameter in exactly one group; w0 keeps 2x; decay (2-D only) keeps the embedding and head
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in model.parameters())
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert {by_id[id(p)] for p in groups[2]["params"]} == {
        "emb.weight", "head.weight", "blocks.2.att.conv.weight", "blocks.3.att.conv.weight",
        *(f"blocks.3.att.{k}.weight" for k in ("f_a", "f_b", "g_a", "g_b")),
    }
    assert groups[1]["lr_scale"] == 2.0 and groups[3]["weight_decay"] == 0.1


def _reference_muon(w, grads, lr, wd, mu, steps=5):
    """Muon in fp64 from its formula (models/optimizer.py's docstring), for one matrix."""
    w, buf = w.double().clone(), torch.zeros_like(w, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf = mu * buf + (1 - mu) * g
        o = newton_schulz((1 - mu) * g + mu * buf, steps)
        w = w * (1 - lr * wd) - lr * 0.2 * max(w.shape) ** 0.5 * o
    return w


def test_muon_adamw_steps_matrices_by_muon_and_the_rest_by_torch_s_adamw():
    gen = torch.Generator().manual_seed(1)
    model = _muon_model()
    plain = _muon_model()
    opt = MuonAdamW(parameter_groups(model, 1e-2, 0.1, muon=True), 1e-2, (0.9, 0.99), 1e-18)
    ref = torch.optim.AdamW(parameter_groups(plain, 1e-2, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-18, fused=True)
    matrices = set(muon_matrices(model))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: [torch.randn(p.shape, generator=gen) for _ in range(3)] for n, p in model.named_parameters()}
    for i in range(3):
        for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            p.grad, q.grad = grads[n][i].clone(), grads[n][i].clone()
        opt.step()
        ref.step()
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        if n in matrices:
            want = _reference_muon(start[n], grads[n], 1e-2, 0.1, 0.95).float()
            torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
            assert set(opt.state[p]) == {"step", "momentum_buffer"} and float(opt.state[p]["step"]) == 3
        elif p.requires_grad:
            torch.testing.assert_close(p, q, rtol=0, atol=0)  # AdamW's own step, bit for bit


def test_muon_state_round_trips_and_an_adamw_state_does_not_fit_it():
    model = _muon_model()
    opt = MuonAdamW(parameter_groups(model, 1e-3, 0.1, muon=True), 1e-3, (0.9, 0.99), 1e-18)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    shapes = [p.shape for g in opt.param_groups for p in g["params"]]
    fresh = MuonAdamW(parameter_groups(_muon_model(), 1e-3, 0.1, muon=True), 1e-3, (0.9, 0.99), 1e-18)
    check_optimizer_state(saved, fresh.param_groups, shapes, "step_00000001")
    fresh.load_state_dict(saved)
    assert fresh.param_groups[3]["muon"] and fresh.param_groups[3]["momentum"] == 0.95
    _, adam_opt = _stepped(lambda groups: adamw(groups, 1e-3, (0.9, 0.99), 1e-18), steps=1)
    with pytest.raises(CheckpointError, match="does not fit this run"):
        check_optimizer_state(adam_opt.state_dict(), fresh.param_groups, shapes, "step_00000001")


def test_matrices_are_dealt_to_ranks_by_cost():
    shapes = [(64, 64), (256, 64), (64, 256), (64, 64), (8, 64)]
    assert owners(shapes, 1) == [0] * 5
    two = owners(shapes, 2)
    assert two == owners(shapes, 2) and set(two) == {0, 1}
    assert two[1] != two[2]  # the two largest go to different ranks
    assert owners(shapes, 8).count(0) == 1  # more ranks than matrices: one each at most
