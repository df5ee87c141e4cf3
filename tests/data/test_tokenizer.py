import json

import pytest

from rwkvx_cli.data import BPETokenizer, ByteTokenizer, DataError, load_tokenizer, train_tokenizer
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
    with pytest.raises(DataError, match="it has no such token"):
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
