import random
from pathlib import Path

import pytest

from rwkvx_cli.data import ByteTokenizer, WorldTokenizer
from rwkvx_cli.data.cuts import LINES_ONLY, CutRule, cut_text, rule_for, split_pieces
from rwkvx_cli.data.tokenizer import BPETokenizer

from .test_prepare import _hf_family

SHAKESPEARE = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt"
RULES = [CutRule(*map(bool, kinds)) for kinds in [(1, 0, 0), (0, 1, 0), (1, 1, 0), (1, 1, 1), (0, 0, 0)]]


def test_cuts_do_not_depend_on_how_the_text_is_read():
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "\n", "  ", "\n\n", "xyz", "\t", "é", "東", "\nW", " \n", "q" * 25]
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        rule = rng.choice(RULES)
        size, max_chars = rng.randint(1, 20), rng.randint(1, 60)
        whole, rest = cut_text(text, rule, size, max_chars, final=True)
        assert rest == len(text)
        got, carry, base, pos = [], "", 0, 0
        while pos < len(text):
            k = rng.randint(1, 30)
            carry, pos = carry + text[pos : pos + k], pos + k
            cuts, rest = cut_text(carry, rule, size, max_chars, final=pos >= len(text))
            got += [(base + c, kind) for c, kind in cuts]
            base, carry = base + rest, carry[rest:]
        assert got == (whole if text else got)
        bounds = [0, *(c for c, _ in whole), len(text)]
        assert all(0 < b - a <= max(size, max_chars) for a, b in zip(bounds, bounds[1:], strict=False)) or not text
        for c, kind in whole:
            if kind == "line":
                assert text[c - 1] == "\n" and not text[c].isspace() and rule.line
            elif kind == "space":
                assert text[c] == " " and not text[c - 1].isspace() and not text[c + 1].isspace() and rule.space
            elif kind == "forced":
                assert c - bounds[bounds.index(c) - 1] == max_chars


def test_pieces_are_at_most_a_piece_unless_no_cut_is_near():
    text = "a b\n\n  c\nd e f\n\ng\n" * 50 + "x" * 300
    assert split_pieces(text, 40) == split_pieces(text, 40, LINES_ONLY)
    pieces = split_pieces(text, 40, CutRule(True, True))
    assert "".join(pieces) == text and max(map(len, pieces[:-1])) <= 40 and pieces[-1] == "x" * 300
    cuts, _ = cut_text("w" * 50 + " v" * 10, CutRule(True, True), size=8, max_chars=20)
    assert [k for _, k in cuts] == ["forced", "forced", "space", "space", "space"]  # a space within 20, then 8


@pytest.mark.parametrize(
    ("family", "rule"),
    [
        ("bytelevel", "line+space"),
        ("wordpiece", "line+space"),
        ("metaspace-bpe", "space"),  # a space is prepended per input: never after a newline
        ("unigram", "space"),
        ("prepend-normalizer", "none"),  # Prepend("▁") adds it even before a space: documents are encoded whole
    ],
)
def test_rule_of_each_tokenizer_family(family, rule):
    from tokenizers import Tokenizer

    hf = _hf_family(family, SHAKESPEARE.read_text(encoding="utf-8")[:200_000])
    assert rule_for(BPETokenizer(Tokenizer.from_str(hf.to_str()))).name == rule


def test_rule_of_byte_world_and_added_tokens():
    from tokenizers import AddedToken, Tokenizer

    assert rule_for(ByteTokenizer()).name == "any"
    assert rule_for(WorldTokenizer()).name == "line+space"
    hf = _hf_family("bytelevel", SHAKESPEARE.read_text(encoding="utf-8")[:100_000])
    hf.add_tokens([AddedToken("\nKING", normalized=False)])  # matched across any cut after a newline
    assert rule_for(BPETokenizer(Tokenizer.from_str(hf.to_str()))).name == "space"
