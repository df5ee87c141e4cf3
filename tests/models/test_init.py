"""Every parameter's init rule, per layer kind (docs/model.md#initialisation): an orthogonal matrix's gain read
from its singular values (all equal to the gain), zeros, uniform ranges, constants. RWKV-7 (and RWKV-X's blocks)
follow RWKV-LM train_temp's `generate_init_weight`, which gives every `.weight` matrix its gain as it is, and its
`ortho_init` (gain x sqrt(rows / cols) when rows > cols) for the low-rank matrices and the head; RWKV-4 follows
v4neo, whose `generate_init_weight` scales every matrix so. The per-channel formulas are pinned in test_model.py
and test_layers.py."""

import math

import pytest
import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import build_model

C, V = 64, 300  # V > C: the head's gain is 0.5 sqrt(V / C)
KINDS = ["rwkv7", "rwkv7", "moba", "rwkv4", "gdn", "kda", "rwkv8"]


def orthogonal_gain(w: torch.Tensor) -> float:
    """The gain of an orthogonal matrix: its singular values, which must all be equal."""
    s = torch.linalg.svdvals(w.detach().double())
    assert (s.max() - s.min()) <= 1e-5 * s.max(), f"not orthogonal: singular values {s.min():.6g} .. {s.max():.6g}"
    return s.max().item()


def scaled(gain: float, w: torch.Tensor) -> float:
    rows, cols = w.shape
    return gain * (math.sqrt(rows / cols) if rows > cols else 1.0)


def rule(kind: str, name: str, w: torch.Tensor, key_gain: float):
    """The expected init of a block parameter `name` (relative to the block): ("orthogonal", gain), ("zero",), or
    None for the per-channel formulas pinned elsewhere."""
    if name in ("att.output.weight", "ffn.value.weight") or (
        kind == "rwkv7" and name in ("att.w1", "att.a1", "att.v1", "att.g1")
    ):
        return ("zero",)
    if name == "ffn.key.weight":
        return ("orthogonal", scaled(1.0, w) if kind == "rwkv4" else key_gain)
    if kind in ("rwkv7", "moba"):
        if name in ("att.w2", "att.a2", "att.v2", "att.g2"):
            return ("orthogonal", scaled(0.1, w))  # train_temp's ortho_init
        if name.endswith(".weight") and w.dim() == 2:
            return ("orthogonal", 0.1 if name == "att.key.weight" else 1.0)
    if kind == "rwkv4" and name.endswith(".weight") and w.dim() == 2:
        return ("orthogonal", scaled(0.1 if name == "att.key.weight" else 1.0, w))
    return None


@pytest.mark.parametrize("key_gain", [1.0, 2.0])
def test_every_matrix_has_its_kinds_rule(key_gain):
    cfg = ModelConfig(vocab_size=V, n_embd=C, head_size=32, layers=KINDS, ffn_key_gain=key_gain)
    model = build_model(cfg, 0)
    assert model.emb.weight.abs().max() <= 1e-4 and model.emb.weight.std() > 1e-5  # uniform in ±1e-4
    assert orthogonal_gain(model.head.weight) == pytest.approx(0.5 * math.sqrt(V / C), rel=1e-5)
    checked = 0
    for kind, blk in zip(KINDS, model.blocks, strict=True):
        for name, p in blk.named_parameters():
            expect = rule(kind, name, p, key_gain)
            if expect is None:
                continue
            checked += 1
            if expect[0] == "zero":
                assert torch.count_nonzero(p) == 0, (kind, name)
            else:
                assert orthogonal_gain(p) == pytest.approx(expect[1], rel=1e-5), (kind, name)
        for ln in ("ln1", "ln2"):
            assert torch.all(getattr(blk, ln).weight == 1) and torch.all(getattr(blk, ln).bias == 0)
    assert checked >= 40


def test_a_fresh_rwkv7_s_channel_mix_key_has_unit_singular_values_by_default():
    """RWKV-LM train_temp gives ffn.key [4C, C] gain 1.0 (rwkvx before 2026-12-04: 2.0, v4neo's rule)."""
    model = build_model(ModelConfig(vocab_size=V, n_embd=C, head_size=32, n_layer=2), 0)
    for blk in model.blocks:
        s = torch.linalg.svdvals(blk.ffn.key.weight.detach().double())
        torch.testing.assert_close(s, torch.ones_like(s), rtol=0, atol=1e-5)
