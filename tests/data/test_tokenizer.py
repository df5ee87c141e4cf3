import json
import random
import re
import string
import time
from pathlib import Path

import pytest

from rwkvx_cli.data import BinIdx, BPETokenizer, ByteTokenizer, DataError, load_tokenizer, prepare, train_tokenizer
from rwkvx_cli.data.tokenizer import MAX_RUN, _long_runs, bound_runs
from rwkvx_cli.errors import UsageError

TEXT = (
    "The quick brown fox jumps over the lazy dog.\n"
    "Pack my box with five dozen liquor jugs!\n"
    "Über naïve café — 東京 🚀 and the fox again.\n"
) * 20


def test_byte_round_trip_non_ascii(tmp_path):
    tok = ByteTokenizer()
    s = "héllo, 東京 🚀\n"
    ids = tok.encode(s)
    assert ids == [b + 1 for b in s.encode("utf-8")]
    assert min(ids) >= 1 and max(ids) <= 256 and tok.vocab_size == 257 and tok.eod_id == 0
    assert tok.decode(ids) == s
    assert tok.decode([0] + ids[:3] + [0] + ids[3:]) == s  # eod is skipped
    assert tok.decode([0xE6 + 1]) == "\ufffd"  # a cut UTF-8 sequence is replaced, not an error
    with pytest.raises(DataError, match="token id 257 is outside the byte vocabulary"):
        tok.decode([257])
    tok.save(tmp_path / "tok.json")
    assert json.loads((tmp_path / "tok.json").read_text())["type"] == "byte"
    assert isinstance(load_tokenizer(tmp_path / "tok.json"), ByteTokenizer)


def test_bpe_train_save_load(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    tok = train_tokenizer("bpe", [tmp_path / "a.txt"], vocab_size=300)
    assert isinstance(tok, BPETokenizer)
    assert tok.vocab_size == 300
    assert tok.eod_id == 0 and tok._tok.id_to_token(0) == "<|eod|>"
    ids = tok.encode(TEXT)
    assert 0 not in ids
    assert len(ids) < 0.6 * len(TEXT.encode("utf-8"))  # merges were learned
    assert tok.decode(ids) == TEXT
    assert tok.decode([0] + ids + [0]) == TEXT
    # "<|eod|>" written in a document is text, not the end-of-document id.
    literal = tok.encode("a <|eod|> b")
    assert 0 not in literal and tok.decode(literal) == "a <|eod|> b"
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(again, BPETokenizer) and again.vocab_size == 300
    assert again.encode(TEXT) == ids
    assert [a.tolist() for a in again.encode_arrays(["fox dog", "", "東京"])] == [
        again.encode("fox dog"),
        [],
        again.encode("東京"),
    ]


def test_loaded_tokenizer_needs_eod_at_zero(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<pad>", "<|eod|>"], show_progress=False)
    raw.train_from_iterator([TEXT], trainer=trainer)
    raw.save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match=r"id 0 must be the end-of-document token '<\|eod\|>', but it has it at id 1"):
        load_tokenizer(tmp_path / "t.json")
    raw = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<pad>"], show_progress=False)
    raw.train_from_iterator([TEXT], trainer=trainer)
    raw.save(str(tmp_path / "t.json"))
    # Any special token may end documents (see test_hf_tokenizer_with_another_eod), but not a padding one.
    with pytest.raises(DataError, match="id 0 is the special token '<pad>', which is not an end-of-document token"):
        load_tokenizer(tmp_path / "t.json")


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(DataError, match="neither a byte tokenizer file nor"):
        load_tokenizer(tmp_path / "other.json")


def test_train_tokenizer_options(tmp_path):
    assert isinstance(train_tokenizer("byte", []), ByteTokenizer)
    with pytest.raises(UsageError, match="fixed vocab_size of 257"):
        train_tokenizer("byte", [], vocab_size=1000)
    with pytest.raises(UsageError, match="at least 257"):
        train_tokenizer("bpe", [], vocab_size=100)
    with pytest.raises(UsageError, match="unknown tokenizer kind 'wordpiece'"):
        train_tokenizer("wordpiece", [])
    with pytest.raises(UsageError, match="fixed vocab_size of 65536"):
        train_tokenizer("world", [], vocab_size=50000)


def _neox_like(tmp_path, specials=("<|endoftext|>", "<|padding|>")) -> Path:
    """A byte-level BPE tokenizer.json laid out like GPT-NeoX 20B's: `<|endoftext|>` is special token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator([TEXT], trainer=trainer)
    path = tmp_path / "neox.json"
    raw.save(str(path))
    return path


def test_hf_tokenizer_with_another_eod(tmp_path):
    path = _neox_like(tmp_path)
    tok = load_tokenizer(path)  # eod_id defaults to 0
    assert isinstance(tok, BPETokenizer) and tok.eod_id == 0 and tok.eod_token == "<|endoftext|>"
    ids = tok.encode("fox <|endoftext|> dog")
    assert 0 not in ids and tok.decode(ids) == "fox <|endoftext|> dog"  # literal special text stays text
    assert tok.decode([0, *ids, 0]) == "fox <|endoftext|> dog"
    with pytest.raises(DataError, match=r"id 1 is the special token '<\|padding\|>', which is not an end-of-doc"):
        load_tokenizer(path, eod_id=1)
    with pytest.raises(DataError, match=r"id 5 is .*an ordinary token, not a special end-of-document token"):
        load_tokenizer(path, eod_id=5)
    with pytest.raises(DataError, match="no token has the end-of-document id 100000"):
        load_tokenizer(path, eod_id=100000)
    with pytest.raises(UsageError, match="eod_id must be a token id"):
        load_tokenizer(path, eod_id=-1)
    path2 = _neox_like(tmp_path, specials=("<s>", "</s>"))
    assert load_tokenizer(path2, eod_id=1).eod_token == "</s>"
    with pytest.raises(DataError, match="id 0 is the special token '<s>', which is not an end-of-document token"):
        load_tokenizer(path2)  # a beginning-of-sequence token


def test_tokenizers_by_name(tmp_path):
    from rwkvx_cli.data import WorldTokenizer

    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer("world"), WorldTokenizer)
    assert isinstance(load_tokenizer("world", eod_id=0), WorldTokenizer)
    with pytest.raises(UsageError, match="the world tokenizer's end-of-document id is 0, not 3"):
        load_tokenizer("world", eod_id=3)
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer("sentencepiece")


def test_bound_runs():
    assert bound_runs("hello world\n" * 100) == ["hello world\n" * 100]
    text = "ab " + "x" * 2500 + " \n" + " " * 3000 + "y"
    parts = bound_runs(text)
    assert "".join(parts) == text
    # No run of only whitespace or only non-whitespace longer than MAX_RUN survives inside a part.
    for part in parts:
        assert all(len(run) <= MAX_RUN for run in re.findall(r"\S+|\s+", part))
    assert bound_runs("abcdefgh", 3) == ["abc", "def", "gh"]


def test_bound_runs_precheck_misses_no_long_run():
    """The block scan that skips the regex for most texts agrees with the regex on runs of every length around
    max_run, at every alignment, for every kind of whitespace."""
    rng = random.Random(0)
    chars = ["a", "é", "\u200b", " ", "\n", "\x1c", "\x85", "\u2028", "\u3000"]  # \u200b is not whitespace
    for _ in range(5000):
        max_run = rng.choice([1, 2, 3, 4, 5, 8, 16])
        text = "".join(rng.choice(chars) * rng.randint(1, 3 * max_run) for _ in range(rng.randint(0, 8)))
        cuts = [c for m in _long_runs(max_run).finditer(text) for c in range(m.start() + max_run, m.end(), max_run)]
        bounds = [0, *cuts, len(text)]
        expected = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] if cuts else [text]
        assert bound_runs(text, max_run) == expected, (text, max_run)


def test_bpe_on_a_long_line_without_whitespace_is_fast(tmp_path):
    """issue 11 item 6: 256 KiB of 'a' took 183 s to prepare (quadratic BPE training over one pre-token)."""
    (tmp_path / "a.txt").write_text("a" * (256 << 10))
    t0 = time.perf_counter()
    stats = prepare([tmp_path / "a.txt"], tmp_path / "out", "bpe", vocab_size=300, val_fraction=0.0)
    assert time.perf_counter() - t0 < 5
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert tok.decode(BinIdx(tmp_path / "out" / "train").tokens) == "a" * (256 << 10)
    assert stats.train_tokens < 256 << 10  # merges were learned
    # Encoding random letters (no merge covers them) and a long run of spaces stays linear too.
    rng = random.Random(0)
    letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(256 << 10))
    t0 = time.perf_counter()
    ids = tok.encode_arrays([letters, " " * (256 << 10)])
    assert time.perf_counter() - t0 < 5
    assert tok.decode(ids[0]) == letters and tok.decode(ids[1]) == " " * (256 << 10)
