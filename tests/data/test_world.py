"""The RWKV World tokenizer against the reference TRIE_TOKENIZER of the `rwkv` package (a test dependency)."""

import json
import os
import random
import re

import numpy as np
import pytest

from rwkvx_cli.data import BinIdx, DataError, WorldTokenizer, load_tokenizer, prepare
from rwkvx_cli.data.corpus import split_pieces
from rwkvx_cli.data.world import VOCAB_FILE, _NativeEngine, read_vocab, rust_available
from rwkvx_cli.errors import UsageError
from rwkvx_cli.native import NativeBuildError

rwkv = pytest.importorskip("rwkv")
from rwkv.rwkv_tokenizer import TRIE_TOKENIZER  # noqa: E402

# One worker runs this module (`make test`: xdist --dist loadgroup), so its module fixture `ref`
# (the reference tokenizer and its cases) is built once, not on each worker taking a test.
pytestmark = pytest.mark.xdist_group("world")

REF_VOCAB = os.path.join(os.path.dirname(rwkv.__file__), "rwkv_vocab_v20230424.txt")
def _native_builds() -> bool:
    try:
        _NativeEngine(read_vocab(VOCAB_FILE))
    except NativeBuildError:
        return False
    return True


ENGINES = [
    "python",
    pytest.param("rust", marks=pytest.mark.skipif(not rust_available(), reason="no pyrwkv-tokenizer")),
    pytest.param("native", marks=pytest.mark.skipif(not _native_builds(), reason="no C++ compiler")),
]


@pytest.fixture(scope="module")
def ref():
    return TRIE_TOKENIZER(REF_VOCAB)


@pytest.fixture(scope="module", params=ENGINES)
def tok(request):
    return WorldTokenizer(request.param)


@pytest.fixture(scope="module")
def cases(ref):
    """(text, reference ids): the mixed texts, 200 random ones and some Shakespeare, encoded once."""
    rng = random.Random(0)
    shakespeare = open(os.path.join(os.path.dirname(__file__), "..", "..", "data", "tinyshakespeare.txt")).read()
    texts = MIXED + [_random_text(rng, rng.randrange(0, 3000)) for _ in range(200)] + [shakespeare[:100000]]
    return [(t, ref.encode(t)) for t in texts]


def _random_text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            out.append(chr(rng.randrange(32, 127)))
        elif r < 0.45:
            out.append(chr(rng.randrange(0x4E00, 0x9FFF)))  # CJK
        elif r < 0.55:
            out.append(chr(rng.randrange(0x1F300, 0x1FAFF)))  # emoji
        elif r < 0.7:
            out.append(rng.choice([" ", "\n", "\r\n", "\t", "  ", "…\n", "。\n", "，\n", "… "]))
        else:
            c = rng.randrange(0, 0x110000)
            out.append(chr(c if not 0xD800 <= c < 0xE000 else 0x41))  # any code point but a lone surrogate
    return "".join(out)


MIXED = [
    "The quick brown fox jumps over the lazy dog.\r\nSecond line\r\n\r\n",
    "東京は日本の首都です。今天是美好的一天。\n한국어 텍스트입니다. Ünïcödé naïve café",
    "emoji 🚀🔥 👨‍👩‍👧‍👦 🇯🇵 with ZWJ \u200d and VS16 \ufe0f",
    'def f(x):\n    return x**2  # comment\n\tif x: pass\n{"a": [1, 2, 3]}\n',
    " " * 1000 + "x" + " " * 129 + "\n" * 300 + "\t" * 77 + "\r\n" * 40,
    # Text whose UTF-8 looks like invalid or odd byte sequences: NUL and C0/C1 controls, U+FFFD itself,
    # noncharacters, the last code point, private use, and Latin-1 letters that spell overlong-encoding bytes.
    "\x00\x01\x7f\x80\x9f\xc0\xc1\xff\ufffd\uffff\ufffe\U0010ffff\ue000 \u00c0\u0080 \u00ed\u00a0\u0080",
    "-" * 500 + "=" * 333 + "a" * 10000,
    "a…\nb。\n\n  x，\ny… \n",
    "",
    "a",
    "\n",
]


def test_shipped_vocab_is_the_reference_vocab(ref):
    table = read_vocab(VOCAB_FILE)
    assert len(table) == 65530 and table[0] == b""
    assert {i: t for i, t in enumerate(table) if i} == ref.idx2token


def test_no_token_crosses_the_segment_boundaries():
    """The python engine's cache relies on this: a (non-whitespace, ASCII whitespace) byte pair occurs inside a
    vocab token only in these three, so greedy longest match restarts at every other such boundary."""
    ws = b" \t\n\r\x0b\x0c"
    pairs = lambda t: zip(t, t[1:], strict=False)  # noqa: E731
    crossing = {t for t in read_vocab(VOCAB_FILE) if any(a not in ws and b in ws for a, b in pairs(t))}
    assert crossing == {"…\n".encode(), "。\n".encode(), "，\n".encode()}
    # And no token holds a newline followed by a non-space: corpus pieces may be cut there.
    assert not [t for t in read_vocab(VOCAB_FILE) if re.search(rb"\n[^\s]", t)]


def test_encode_is_identical_to_the_reference(tok, cases):
    for text, ids in cases:
        assert tok.encode(text) == ids, repr(text[:80])
    assert [a.tolist() for a in tok.encode_arrays([t for t, _ in cases])] == [ids for _, ids in cases]


def test_pieces_encode_like_the_whole_text(tok, ref):
    rng = random.Random(1)
    text = "".join(_random_text(rng, 200) + "\n" + rng.choice(["x", "東", "🚀", "…"]) for _ in range(50))
    pieces = split_pieces(text, 100)
    assert len(pieces) > 10
    assert [i for a in tok.encode_arrays(pieces) for i in a.tolist()] == ref.encode(text)


def test_decode(tok, ref):
    for text in MIXED:
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids) == text
        assert tok.decode(np.asarray([0, *ids, 0], dtype=np.uint16)) == text  # end of document is skipped
    # Invalid UTF-8: each bad sequence is replaced here, the reference gives up on the whole string.
    lone = [0xE6 + 1]  # id 0xE7 is the single byte 0xE6, a lead byte with no continuation
    assert tok.decode_bytes(lone) == b"\xe6"
    assert tok.decode(tok.encode("ok ") + lone + tok.encode(" fine")) == "ok \ufffd fine"
    assert ref.decode(tok.encode("ok ") + lone + tok.encode(" fine")) == "\ufffd"
    assert tok.decode([65530, 65535]) == ""  # unassigned ids of the padded vocabulary
    with pytest.raises(DataError, match="token id 65536 is outside the World vocabulary"):
        tok.decode([65536])
    with pytest.raises(DataError, match="token id -1 is outside"):
        tok.decode([-1])


def test_save_load_and_prepare(tmp_path, ref):
    tok = WorldTokenizer()
    assert tok.kind == "world" and tok.vocab_size == 65536 and tok.eod_id == 0
    tok.save(tmp_path / "tokenizer.json")
    assert json.loads((tmp_path / "tokenizer.json").read_text())["vocab"] == "rwkv_vocab_v20230424"
    assert isinstance(load_tokenizer(tmp_path / "tokenizer.json"), WorldTokenizer)
    (tmp_path / "bad.json").write_text(json.dumps({"type": "world", "vocab": "rwkv_vocab_v20990101"}))
    with pytest.raises(DataError, match="World vocab 'rwkv_vocab_v20990101' is not supported"):
        load_tokenizer(tmp_path / "bad.json")

    docs = ["Hello world.\n東京 🚀", "第二个文档，\n…\n", "x" * 5000 + "\r\n  y"]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    stats = prepare([tmp_path / "c.jsonl"], tmp_path / "out", "world", val_fraction=0.0)
    assert stats.tokenizer_kind == "world" and stats.vocab_size == 65536 and stats.dtype == "uint16"
    data = BinIdx(tmp_path / "out" / "train")
    expected = [i for d in docs for i in [*ref.encode(d), 0]]  # RWKV-LM's make_data layout
    assert data.tokens.tolist() == expected
    assert isinstance(load_tokenizer(tmp_path / "out" / "tokenizer.json"), WorldTokenizer)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "world" and meta["tokenizer"]["eod_id"] == 0


def test_engine_choice(monkeypatch):
    """native where it compiles, else rust where installed, else python; an engine asked for by name or not at all."""
    import rwkvx_cli.data.world as world

    if _native_builds():
        tok = WorldTokenizer()
        assert tok.encode("hello world") == [34550, 40213] and tok.engine == "native"

    def no_compiler(table):
        raise NativeBuildError("no C++ compiler found")

    monkeypatch.setattr(world, "_NativeEngine", no_compiler)
    if rust_available():
        tok = WorldTokenizer()
        assert tok.encode("hello world") == [34550, 40213] and tok.engine == "rust"
    monkeypatch.setattr(world, "rust_available", lambda: False)
    tok = WorldTokenizer()
    assert tok.encode("hello world") == [34550, 40213] and tok.engine == "python"
    with pytest.raises(UsageError, match="pip install pyrwkv-tokenizer"):
        WorldTokenizer("rust")
    with pytest.raises(UsageError, match="unknown World tokenizer engine 'c'"):
        WorldTokenizer("c")


@pytest.mark.skipif(not _native_builds(), reason="no C++ compiler")
def test_native_refuses_a_vocab_greedy_match_cannot_use():
    table = read_vocab(VOCAB_FILE)
    missing = [t if t != b"\xff" else b"" for t in table]  # a byte no token starts with a match for
    with pytest.raises(DataError, match="cannot be encoded by greedy longest match"):
        _NativeEngine(missing)
    with pytest.raises(DataError, match="cannot be encoded by greedy longest match"):
        _NativeEngine([*table, table[300]])  # one token under two ids
    engine = _NativeEngine(table)
    ids, counts = engine.encode_packed(["", "a", "hello world", "\U0010ffff"])
    assert counts.tolist() == [0, 1, 2, 4] and ids.tolist() == [98, 34550, 40213, 245, 144, 192, 192]
    assert engine.encode_packed([])[0].size == 0 and engine.encode_batch([]) == []


def test_a_table_handed_over_is_used_instead_of_the_vocab_file(monkeypatch):
    """prepare's workers get the parent's table (no 65,536-line parse each): the same ids, and the file unread."""
    import rwkvx_cli.data.world as world

    table = WorldTokenizer().table
    monkeypatch.setattr(world, "read_vocab", lambda *a: pytest.fail("the vocab file was read"))
    tok = WorldTokenizer(table=tuple(table))
    assert tok.encode("hello world") == [34550, 40213] and tok.decode([34550, 40213]) == "hello world"
    with pytest.raises(DataError, match="65536 entries, not 3"):
        WorldTokenizer(table=[b"", b"a", b"b"])
