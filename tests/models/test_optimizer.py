"""The trainer's AdamW (models/optimizer.py): torch's fused kernel, the for-loop form's values, and a
checkpoint written by another implementation (an older rwkvx: the for-loop form) resumes into it."""

import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import build_model, parameter_groups
from rwkvx_cli.models.optimizer import adamw
from rwkvx_cli.train.checkpointer import check_optimizer_state
from rwkvx_cli.train.distributed import load_full_state


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
