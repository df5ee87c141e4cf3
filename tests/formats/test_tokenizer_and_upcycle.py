"""The tokenizer files of an HF export, read by transformers; the upcycle plan, RWKV-7 -> hybrid."""

import pytest
import torch
from transformers import AutoTokenizer

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.data.tokenizer import BPETokenizer, ByteTokenizer
from rwkvx_cli.data.world import WorldTokenizer
from rwkvx_cli.formats import FormatError, SizeMismatchError, apply_plan, export_hf, plan_table, upcycle_plan
from rwkvx_cli.formats.tokenizer_files import WORLD_NOTE, hf_tokenizer_files
from rwkvx_cli.formats.upcycle import summary
from rwkvx_cli.models import build_model
from tests.formats.conftest import perturbed_model

TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "héllo wörld — ünïcode ✓ 🦆", "<|eod|> inside", ""]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_hf_tokenizer_encodes_like_ours(kind, tmp_path):
    if kind == "byte":
        tok = ByteTokenizer()
        cfg = ModelConfig(vocab_size=257, n_layer=1, n_embd=64, head_size=64)
    else:
        tok = BPETokenizer.train(["the quick brown fox jumps over the lazy dog " * 20, "héllo wörld 🦆"] * 5, 300)
        cfg = ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_embd=64, head_size=64)
    summary_ = export_hf(build_model(cfg, 0).state_dict(), tmp_path / "hf", tokenizer=tok)
    assert summary_["tokenizer"] == f"tokenizer.json ({kind})"
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.eos_token == "<|eod|>" and theirs.eos_token_id == 0
    for text in TEXTS[:-2] + [TEXTS[-1]]:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text), (kind, text)
        assert theirs.decode(ids) == tok.decode(ids)
    # The documented difference: transformers parses a special token's spelling inside text, rwkvx does not.
    assert theirs.encode("<|eod|>", add_special_tokens=False) == [0] != tok.encode("<|eod|>")


def test_world_tokenizer_has_no_hf_files():
    files, note = hf_tokenizer_files(WorldTokenizer())
    assert files == {} and note == WORLD_NOTE


@pytest.fixture
def source_and_target():
    src_cfg = ModelConfig(vocab_size=97, n_layer=4, n_embd=64, head_size=64)
    tgt_cfg = ModelConfig(vocab_size=97, n_layer=4, n_embd=64, head_size=64, n_attn=2)  # r r m r r m
    return perturbed_model(src_cfg).state_dict(), build_model(tgt_cfg, 1).state_dict()


def test_upcycle_follows_rwkv_x_init_moba_from_rwkv(source_and_target):
    source, target = source_and_target
    rows = upcycle_plan(source, target)
    assert summary(rows) == {"load": len(source), "copy": 12, "fresh": 10, "left out": 0}
    new = apply_plan(rows, source, target)
    assert set(new) == set(target)
    # RWKV-7 blocks load in order: target positions 0, 1, 3, 4 are the source's 0, 1, 2, 3.
    for tgt_pos, src_pos in ((0, 0), (1, 1), (3, 2), (4, 3)):
        for part in ("att.w1", "att.receptance.weight", "ffn.x_k", "ln1.weight"):
            assert torch.equal(new[f"blocks.{tgt_pos}.{part}"], source[f"blocks.{src_pos}.{part}"])
    # RWKV-X: MoBA block i copies from RWKV block (i + 1) * (n_rwkv // n_attn) - 1.
    for i, tgt_pos in enumerate((2, 5)):
        src_pos = (i + 1) * (4 // 2) - 1
        for part in ("att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight",
                     "ffn.key.weight", "ffn.value.weight"):  # fmt: skip
            assert torch.equal(new[f"blocks.{tgt_pos}.{part}"], source[f"blocks.{src_pos}.{part}"]), part
        for part in ("ln1.weight", "ln1.bias", "ln2.weight", "ffn.x_k"):
            assert torch.equal(new[f"blocks.{tgt_pos}.{part}"], target[f"blocks.{tgt_pos}.{part}"]), part
    assert torch.equal(new["head.weight"], source["head.weight"])
    table = plan_table(rows)
    assert ("blocks.2.ffn.x_k", "fresh", "-", "MoBA's own (fresh, as RWKV-X)") in table


def test_upcycle_from_a_hybrid_leaves_its_moba_blocks_out(source_and_target):
    _, target = source_and_target
    other = build_model(ModelConfig(vocab_size=97, n_layer=4, n_embd=64, head_size=64, n_attn=1), 2).state_dict()
    rows = upcycle_plan(other, target)
    left = [r.source for r in rows if r.action == "left out"]
    assert left and all(n.startswith("blocks.4.") for n in left)  # the source's MoBA block sits on top


def test_upcycle_refusals(source_and_target):
    source, target = source_and_target
    three = build_model(ModelConfig(vocab_size=97, n_layer=3, n_embd=64, head_size=64), 0).state_dict()
    with pytest.raises(FormatError, match="source has 3 RWKV-7 blocks, the target 4"):
        upcycle_plan(three, target)
    wide = build_model(ModelConfig(vocab_size=97, n_layer=4, n_embd=128, head_size=64), 0).state_dict()
    with pytest.raises(SizeMismatchError, match=r"blocks.0.ln1.weight \[64\] vs blocks.0.ln1.weight \[128\]") as e:
        upcycle_plan(wide, target)
    assert "\n" not in str(e.value)
