import re
from pathlib import Path

import pytest

import rwkvx_cli.data.corpus as corpus
from rwkvx_cli.data import DataError, train_tokenizer
from rwkvx_cli.data.corpus import iter_pieces, split_pieces

SHAKESPEARE = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt"


def test_split_pieces_cuts_only_after_newline_before_text():
    text = "a b\n\n  c\nd e f\n\ng\n" * 50 + "x" * 300
    pieces = split_pieces(text, 40)
    assert "".join(pieces) == text
    assert len(pieces) > 10
    for p, q in zip(pieces, pieces[1:], strict=False):
        assert p.endswith("\n") and not q[0].isspace()
    assert split_pieces("no newline at all " * 10, 16) == ["no newline at all " * 10]


def test_bpe_pieces_encode_like_the_whole_text(tmp_path):
    text = SHAKESPEARE.read_text(encoding="utf-8")[:40000] + "\n\n  indented\r\nwindows\n\t tab\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    tok = train_tokenizer("bpe", [tmp_path / "a.txt"], vocab_size=400)
    pieces = split_pieces(text, 100)
    assert len(pieces) > 100
    ids = [i for a in tok.encode_arrays(pieces) for i in a.tolist()]
    assert ids == tok.encode(text)


def test_text_file_streams_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_BLOCK_BYTES", 7)  # cuts through multi-byte characters
    monkeypatch.setattr(corpus, "PIECE_CHARS", 10)
    text = "Ünïcödé line one\nzwei 東京\n🚀 three\n\nfour\n" * 5
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode("utf-8"))
    pieces = list(iter_pieces(path))
    assert "".join(p.text for p in pieces) == text
    assert [p.doc_end for p in pieces].count(True) == 1 and pieces[-1].doc_end
    assert sum(p.nbytes for p in pieces) == path.stat().st_size


def test_invalid_utf8(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"hello\nworld\xff\xfe")
    with pytest.raises(DataError, match=re.escape("b.txt is not UTF-8 text (invalid byte near offset 11)")):
        list(iter_pieces(tmp_path / "b.txt"))


def test_jsonl_errors_name_file_and_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "ok"}\n\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r'c\.jsonl:3: expected a JSON object with a string "text" field'):
        list(iter_pieces(p))
    p.write_text('{"text": "ok"}\n{"text": "a"\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:2: not valid JSON"):
        list(iter_pieces(p))
    p.write_text('["text"]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:1: expected a JSON object"):
        list(iter_pieces(p))
    p.write_text('{"text": "bad \\ud800 surrogate"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:1: .*unpaired surrogate \\ud800"):
        list(iter_pieces(p))
