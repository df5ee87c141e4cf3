import gzip
import json
import re
from pathlib import Path

import pytest

import rwkvx_cli.data.corpus as corpus
from rwkvx_cli.data import DataError, train_tokenizer
from rwkvx_cli.data.corpus import expand_inputs, iter_pieces, split_pieces

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


def _docs(path, **options) -> list[str]:
    """The documents of one input file, joined from their pieces."""
    docs, cur = [], []
    for p in iter_pieces(path, **options):
        cur.append(p.text)
        if p.doc_end:
            docs.append("".join(cur))
            cur = []
    return docs


DOCS = ["first document\nwith two lines", "", "東京 🚀 third\r\n", "x" * 20000 + "\nlong"]


def _jsonl_bytes(docs, field="text") -> bytes:
    return "".join(json.dumps({field: d, "meta": 1}) + "\n" for d in docs).encode("utf-8")


def test_compressed_jsonl_and_text(tmp_path, monkeypatch):
    zstandard = pytest.importorskip("zstandard")
    monkeypatch.setattr(corpus, "_BLOCK_BYTES", 100)  # many blocks, cut anywhere
    raw = _jsonl_bytes(DOCS)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw[:500]) + gzip.compress(raw[500:]))  # two members
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "a.ndjson").write_bytes(raw)
    text = "plain\ntext 東京\n" * 100
    (tmp_path / "t.txt.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(text.encode()))
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(text.encode()))
    nonempty = [d for d in DOCS if d]
    for name in ("a.jsonl.gz", "a.jsonl.zst", "a.ndjson"):
        assert [d for d in _docs(tmp_path / name) if d] == nonempty, name
        pieces = list(iter_pieces(tmp_path / name))
        assert sum(p.nbytes for p in pieces) == (tmp_path / name).stat().st_size  # progress counts file bytes
    for name in ("t.txt.zst", "t.txt.gz"):
        assert _docs(tmp_path / name) == [text]


def test_text_field_and_skip_bad(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(_jsonl_bytes(["a", "b"], field="content") + b'{"content": 3}\nnot json\n{"content": "c"}')
    with pytest.raises(DataError, match=r'c\.jsonl:3: expected a JSON object with a string "content" field'):
        _docs(p, text_field="content")
    with pytest.raises(DataError, match=r'c\.jsonl:1: expected a JSON object with a string "text" field'):
        _docs(p)
    skipped = corpus.Skipped()
    assert _docs(p, text_field="content", skip_bad=True, skipped=skipped) == ["a", "b", "c"]  # no final newline
    assert skipped.count == 2
    assert skipped.first.endswith('c.jsonl:3: expected a JSON object with a string "content" field')


def test_truncated_and_corrupt_archives(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    raw = _jsonl_bytes(DOCS * 50)
    gz, zst = gzip.compress(raw), zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    (tmp_path / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    (tmp_path / "cut.jsonl.zst").write_bytes(zst[: len(zst) // 2])
    (tmp_path / "junk.jsonl.gz").write_bytes(b"this is not gzip at all")
    bad = bytearray(zst)
    bad[len(bad) // 2] ^= 0xFF
    (tmp_path / "bad.jsonl.zst").write_bytes(bytes(bad))
    for name in ("cut.jsonl.gz", "cut.jsonl.zst"):
        with pytest.raises(DataError, match=rf"{re.escape(name)} is truncated: the \.(gz|zst) stream ends before"):
            list(iter_pieces(tmp_path / name))
    with pytest.raises(DataError, match=r"junk\.jsonl\.gz is not a valid \.gz file"):
        list(iter_pieces(tmp_path / "junk.jsonl.gz"))
    with pytest.raises(DataError, match=r"bad\.jsonl\.zst is not a valid \.zst file \(.*\)$"):
        list(iter_pieces(tmp_path / "bad.jsonl.zst"))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS, "body": [d.upper() for d in DOCS]})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    assert [d for d in _docs(tmp_path / "a.parquet") if d] == [d for d in DOCS if d]
    assert _docs(tmp_path / "a.parquet", text_field="body")[0] == DOCS[0].upper()
    assert sum(p.nbytes for p in iter_pieces(tmp_path / "a.parquet")) == (tmp_path / "a.parquet").stat().st_size
    with pytest.raises(DataError, match=r"a\.parquet: no column 'content' \(columns: id, text, body\)"):
        _docs(tmp_path / "a.parquet", text_field="content")
    with pytest.raises(DataError, match=r"a\.parquet: column 'id' holds int64, not strings"):
        _docs(tmp_path / "a.parquet", text_field="id")
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r'n\.parquet: row 2: "text" is null'):
        _docs(tmp_path / "n.parquet")
    skipped = corpus.Skipped()
    assert _docs(tmp_path / "n.parquet", skip_bad=True, skipped=skipped) == ["a", "c"] and skipped.count == 1
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"fake\.parquet is not a readable parquet file"):
        _docs(tmp_path / "fake.parquet")


def test_expand_inputs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / ".hidden").mkdir()
    for name in ("d/b.txt", "d/a.jsonl", "d/sub/c.txt", "d/README.md", "d/.hidden/x.txt", "d/.y.txt", "e.txt"):
        (tmp_path / name).write_text("x")
    assert [p.relative_to(tmp_path).as_posix() for p in expand_inputs([tmp_path / "d"])] == [
        "d/a.jsonl",
        "d/b.txt",
        "d/sub/c.txt",
    ]  # other types in a directory are left out; hidden names too
    assert [p.name for p in expand_inputs([str(tmp_path / "d" / "*.txt"), tmp_path / "e.txt"])] == ["b.txt", "e.txt"]
    assert [p.name for p in expand_inputs([str(tmp_path / "**" / "c.txt")])] == ["c.txt"]
    assert len(expand_inputs([tmp_path / "e.txt", tmp_path / "e.txt", tmp_path / "d"])) == 4  # read once
    with pytest.raises(DataError, match=r"README\.md: unsupported input type; rwkvx reads \.txt, \.jsonl"):
        expand_inputs([tmp_path / "d" / "README.md"])
    with pytest.raises(DataError, match=r"README\.md: unsupported input type"):
        expand_inputs([str(tmp_path / "d" / "*")])  # a glob is explicit: every match must be readable
    with pytest.raises(DataError, match="no input matches"):
        expand_inputs([str(tmp_path / "*.parquet")])
    with pytest.raises(DataError, match="input file not found"):
        expand_inputs([tmp_path / "nope.txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"input directory .*empty holds no \.txt, \.jsonl"):
        expand_inputs([tmp_path / "empty"])


def test_missing_optional_package_names_the_pip_command(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_zstd(name, *args, **kwargs):
        if name in ("zstandard", "pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zstd)
    (tmp_path / "a.jsonl.zst").write_bytes(b"")
    (tmp_path / "a.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"reading \.zst files needs zstandard: pip install zstandard"):
        expand_inputs([tmp_path / "a.jsonl.zst"])
    with pytest.raises(DataError, match=r"reading \.parquet files needs pyarrow: pip install pyarrow"):
        list(iter_pieces(tmp_path / "a.parquet"))
