import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rwkvx_cli.data.corpus as corpus
from rwkvx_cli.data import BinIdx, ByteTokenizer, DataError, load_tokenizer, prepare
from rwkvx_cli.errors import UsageError

SHAKESPEARE = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt"


def _docs_of(data: BinIdx) -> list[np.ndarray]:
    ends = np.cumsum(data.doc_sizes)
    return [np.asarray(data.tokens[e - n : e]) for n, e in zip(data.doc_sizes, ends, strict=True)]


def _write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")


def test_single_txt_document_splits_at_a_line(tmp_path):
    calls = []
    stats = prepare([SHAKESPEARE], tmp_path / "out", "byte", progress=lambda d, t: calls.append((d, t)))
    text = SHAKESPEARE.read_text(encoding="utf-8")
    size = SHAKESPEARE.stat().st_size
    train, val = BinIdx(tmp_path / "out" / "train"), BinIdx(tmp_path / "out" / "val")
    assert stats.split == "line" and stats.documents == 1
    assert stats.train_tokens + stats.val_tokens == size + 1 == len(train) + len(val)
    assert abs(stats.val_tokens - 0.05 * (size + 1)) < corpus.PIECE_CHARS  # cut at a piece boundary near 5%
    all_tokens = np.concatenate([train.tokens, val.tokens])
    np.testing.assert_array_equal(all_tokens[:-1], np.frombuffer(text.encode(), np.uint8) + 1)
    assert all_tokens[-1] == 0 and np.count_nonzero(all_tokens == 0) == 1  # eod only after the document
    tok = ByteTokenizer()
    assert tok.decode(train.tokens).endswith("\n") and not tok.decode(val.tokens)[0].isspace()
    assert calls[0] == (0, size) and calls[-1] == (size, size)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:], strict=False))
    assert stats.mb_per_s > 0


def test_jsonl_documents_hold_out_whole_documents(tmp_path):
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcdefgh éß\n"), size=int(rng.integers(5, 60)))) for _ in range(40)]
    _write_jsonl(tmp_path / "a.jsonl", texts[:25])
    (tmp_path / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in texts[25:]) + "\n\n", encoding="utf-8"
    )  # blank lines are skipped
    stats = prepare([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "out", "byte", val_fraction=0.2, seed=3)
    train, val = BinIdx(tmp_path / "out" / "train"), BinIdx(tmp_path / "out" / "val")
    assert stats.split == "documents" and stats.documents == 40
    assert stats.train_documents + stats.val_documents == 40 and stats.val_documents >= 1
    total = stats.train_tokens + stats.val_tokens
    assert total == sum(len(t.encode()) + 1 for t in texts)
    assert 0 < stats.val_tokens <= round(0.2 * total)
    tok = ByteTokenizer()
    decoded = []
    for data in (train, val):
        for doc in _docs_of(data):
            assert doc[-1] == 0 and np.count_nonzero(doc == 0) == 1  # eod ends every document, and only there
            decoded.append(tok.decode(doc))
    assert sorted(decoded) == sorted(texts)
    assert [tok.decode(d) for d in _docs_of(train)] == [
        t for t in texts if t in {tok.decode(d) for d in _docs_of(train)}
    ]

    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab_size"] == 257 and meta["dtype"] == "uint16" and meta["documents"] == 40
    assert meta["train"] == {"prefix": "train", "tokens": stats.train_tokens, "documents": stats.train_documents}
    assert meta["val"]["tokens"] == stats.val_tokens and meta["tokens"] == total
    assert meta["tokenizer"]["kind"] == "byte" and meta["split"] == "documents" and meta["seed"] == 3
    assert [s["documents"] for s in meta["sources"]] == [25, 15]
    assert meta["bytes"] == sum(s["bytes"] for s in meta["sources"])
    assert isinstance(load_tokenizer(tmp_path / "out" / "tokenizer.json"), ByteTokenizer)
    # Same seed, same split; a token count works too.
    again = prepare([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "o2", "byte", val_fraction=0.2, seed=3)
    assert again.val_tokens == stats.val_tokens
    by_count = prepare([tmp_path / "a.jsonl"], tmp_path / "o3", "byte", val_fraction=100)
    assert 0 < by_count.val_tokens <= 100


def test_bpe_txt_and_jsonl_then_reuse_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:30000], encoding="utf-8")
    _write_jsonl(tmp_path / "b.jsonl", ["To be, or not to be.", "All the world's a stage.\nAnd all the men."])
    stats = prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "out", "bpe", vocab_size=320)
    assert stats.vocab_size == 320 and stats.documents == 3 and stats.tokenizer_kind == "bpe"
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    docs = _docs_of(BinIdx(tmp_path / "out" / "train")) + _docs_of(BinIdx(tmp_path / "out" / "val"))
    assert sorted(tok.decode(d) for d in docs) == sorted(
        [(tmp_path / "a.txt").read_text(), "To be, or not to be.", "All the world's a stage.\nAnd all the men."]
    )
    assert all(d[-1] == 0 for d in docs)
    reused = prepare([tmp_path / "b.jsonl"], tmp_path / "o2", tmp_path / "out" / "tokenizer.json", val_fraction=0.0)
    assert reused.tokenizer_kind == "file" and reused.split == "none" and reused.val_tokens == 0
    assert reused.train_documents == 2


def test_errors(tmp_path):
    with pytest.raises(DataError, match=r"input file not found: .*nope\.txt"):
        prepare([tmp_path / "nope.txt"], tmp_path / "out")
    (tmp_path / "empty.txt").write_text("")
    _write_jsonl(tmp_path / "e.jsonl", ["", ""])
    with pytest.raises(DataError, match="the corpus has no text"):
        prepare([tmp_path / "empty.txt", tmp_path / "e.jsonl"], tmp_path / "out")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "oops"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r'bad\.jsonl:2: expected a JSON object with a string "text" field'):
        prepare([tmp_path / "bad.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # the directory the call made is removed again: no temp stream left
    (tmp_path / "mine").mkdir()  # a directory that was there stays, empty as it was
    with pytest.raises(DataError, match=r'bad\.jsonl:2: expected a JSON object'):
        prepare([tmp_path / "bad.jsonl"], tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == []
    (tmp_path / "a.txt").write_text("tiny")
    with pytest.raises(DataError, match="leaves no training data"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", val_fraction=5)
    with pytest.raises(UsageError, match="val_fraction must be in"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", val_fraction=1.5)
    with pytest.raises(UsageError, match="is not a file"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer_kind="sentencepiece")


def test_compressed_directory_with_text_field_and_skip_bad(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    texts = [f"document {i}: " + "words " * i for i in range(30)]
    lines = [json.dumps({"content": t}) for t in texts]
    lines.insert(7, '{"content": null}')
    lines.insert(12, "{broken")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("\n".join(lines[:20]).encode()))
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(gzip.compress("\n".join(lines[20:]).encode()))
    (tmp_path / "in" / "notes.md").write_text("not a corpus file")  # ignored inside a directory
    with pytest.raises(DataError, match=r'a\.jsonl\.zst:8: expected a JSON object with a string "content" field'):
        prepare([tmp_path / "in"], tmp_path / "out", "byte", text_field="content")
    stats = prepare([tmp_path / "in"], tmp_path / "out", "byte", text_field="content", skip_bad=True, seed=1)
    assert stats.documents == 30 and stats.skipped_records == 2
    assert stats.first_skipped.endswith('a.jsonl.zst:8: expected a JSON object with a string "content" field')
    assert stats.text_bytes == sum(len(t.encode()) for t in texts) and stats.bytes < stats.text_bytes  # compressed
    tok = ByteTokenizer()
    docs = _docs_of(BinIdx(tmp_path / "out" / "train")) + _docs_of(BinIdx(tmp_path / "out" / "val"))
    assert sorted(tok.decode(d) for d in docs) == sorted(texts)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["text_field"] == "content" and meta["skipped_records"] == 2
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.jsonl.zst", "b.jsonl.gz"]
    assert [s["documents"] for s in meta["sources"]] == [18, 12]
    with pytest.raises(DataError, match=r"notes\.md: unsupported input type; rwkvx reads \.txt"):
        prepare([tmp_path / "in" / "notes.md"], tmp_path / "o2")


def test_hf_tokenizer_file_with_its_own_eod_id(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet)
    raw.train_from_iterator([SHAKESPEARE.read_text(encoding="utf-8")[:20000]], trainer=trainer)
    raw.save(str(tmp_path / "tok.json"))
    _write_jsonl(tmp_path / "a.jsonl", ["To be, or not to be.", "That is the question."])
    stats = prepare([tmp_path / "a.jsonl"], tmp_path / "out", tmp_path / "tok.json", val_fraction=0.0, eod_id=1)
    assert stats.eod_id == 1
    data = BinIdx(tmp_path / "out" / "train")
    assert [int(d[-1]) for d in _docs_of(data)] == [1, 1] and np.count_nonzero(data.tokens == 1) == 2
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["tokenizer"]["eod_id"] == 1
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json", eod_id=meta["tokenizer"]["eod_id"])
    assert [tok.decode(d) for d in _docs_of(data)] == ["To be, or not to be.", "That is the question."]
    with pytest.raises(UsageError, match="eod_id applies to a loaded tokenizer.json"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "o2", "byte", eod_id=1)


def test_stale_token_stream_of_a_killed_prepare_is_removed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / f".tokens.tmp{dead.pid}").write_bytes(b"\0" * 100)  # left by a prepare killed with -9
    (tmp_path / "a.txt").write_text("some text\n")
    prepare([tmp_path / "a.txt"], out, "byte", val_fraction=0.0)
    assert not list(out.glob(".tokens.tmp*"))


def _hf_family(name: str, text: str):
    """A small tokenizer.json of one family, trained here (offline) with <|eod|> at id 0."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    eod = ["<|eod|>"]
    if name == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=500, special_tokens=eod, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    elif name == "metaspace-bpe":  # Llama/Mistral-style: a space prepended per input, merges such as "\nW"
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=eod)
    elif name == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=500, special_tokens=eod, unk_token="<|eod|>")
    elif name == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=[*eod, "[UNK]"])
    elif name == "prepend-normalizer":  # Llama-2's layout: Prepend + Replace, no pre-tokenizer, byte fallback
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=eod)
    else:
        raise ValueError(name)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)  # lines: no pre-tokenizer is quadratic
    return tok


@pytest.mark.parametrize(
    "family", ["byte", "world", "bytelevel", "metaspace-bpe", "unigram", "wordpiece", "prepend-normalizer"]
)
def test_prepared_ids_equal_encoding_each_whole_document(tmp_path, family):
    # Documents of 10-30k characters: long enough to be cut into pieces (8192 characters).
    text = SHAKESPEARE.read_text(encoding="utf-8")
    rng = np.random.default_rng(4)
    docs = []
    for _ in range(6):
        a, n = int(rng.integers(0, len(text) - 30_000)), int(rng.integers(10_000, 30_000))
        docs.append(text[a : a + n])
    docs.append("Wide  spaces and\ttabs,\r\nWindows lines\n\n  indented\nW\n" * 400)
    _write_jsonl(tmp_path / "a.jsonl", docs)
    kind = family
    hf = None
    if family not in ("byte", "world"):
        hf = _hf_family(family, text[:300_000])
        hf.save(str(tmp_path / "tok.json"))
        kind = tmp_path / "tok.json"
    prepare([tmp_path / "a.jsonl"], tmp_path / "out", kind, val_fraction=0.0)
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    got = [d[:-1].tolist() for d in _docs_of(BinIdx(tmp_path / "out" / "train"))]
    assert len(got) == len(docs)
    for doc, ids in zip(docs, got, strict=True):
        assert ids == tok.encode(doc)  # the whole document in one call
        if hf is not None:
            assert ids == hf.encode(doc, add_special_tokens=False).ids
    assert [tok.decode(ids) for ids in got][:1] == [tok.decode(tok.encode(docs[0]))]


def _long_line_split(tmp_path, monkeypatch, line: str, kind: str = "byte"):
    """A single-line .txt read with small blocks and a small limit for text without a cut point."""
    monkeypatch.setattr(corpus, "_BLOCK_BYTES", 4096)
    monkeypatch.setattr(corpus, "_MAX_CARRY", 30_000)
    (tmp_path / "line.txt").write_text(line, encoding="utf-8")
    stats = prepare([tmp_path / "line.txt"], tmp_path / "out", kind)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    total = stats.train_tokens + stats.val_tokens
    return stats, meta, total


@pytest.mark.parametrize("word", ["lorem ipsum ", "東京 naïve 🚀 "])
def test_one_long_line_holds_out_what_was_asked(tmp_path, monkeypatch, word):
    # No newline at all: no line boundary to cut at, so the split is at exactly the asked-for token count (the
    # previous code recorded the blocks it had to emit without a safe cut as line cuts and held out 30-40%).
    stats, meta, total = _long_line_split(tmp_path, monkeypatch, word * (300_000 // len(word)))
    assert stats.documents == 1 and stats.split == meta["split"] == "tokens"
    assert stats.val_tokens == round(0.05 * total)
    assert meta["val"]["tokens"] == stats.val_tokens


def test_one_line_without_spaces_is_cut_but_never_as_a_line(tmp_path, monkeypatch):
    stats, meta, total = _long_line_split(tmp_path, monkeypatch, "x" * 100_000, kind="world")
    assert stats.split == meta["split"] == "tokens" and stats.val_tokens == round(0.05 * total)
    assert meta["cuts"]["forced"] == stats.forced_cuts == 3  # every 30,000 characters, counted
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    halves = [tok.decode(BinIdx(tmp_path / "out" / split).tokens) for split in ("train", "val")]
    assert halves[0] + halves[1] == "x" * 100_000


def test_single_document_line_split_is_within_the_stated_tolerance(tmp_path):
    from rwkvx_cli.data.prepare import SPLIT_TOLERANCE

    stats = prepare([SHAKESPEARE], tmp_path / "out", "byte", val_fraction=0.2)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    asked = round(0.2 * (stats.train_tokens + stats.val_tokens))
    assert meta["split"] == "line" and meta["val_requested"] == asked
    assert abs(stats.val_tokens - asked) <= SPLIT_TOLERANCE * asked
    # Asked for less than a piece: no line cut is near enough, so the cut is exact (mid-line).
    small = prepare([SHAKESPEARE], tmp_path / "o2", "byte", val_fraction=300)
    assert small.split == "tokens" and small.val_tokens == 300


def test_a_record_nested_past_the_stack_is_a_bad_record(tmp_path):
    """json recurses per level of nesting: a record [[[...]]] tens of thousands deep is a bad record (its line
    named), skipped and counted under skip_bad, in this process, in workers, and while a BPE trains."""
    deep = "[" * 50_000 + "]" * 50_000
    lines = [json.dumps({"text": f"document {i} " * 40}) for i in range(400)]
    lines[250] = deep
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    for workers in (1, 2):
        with pytest.raises(DataError, match=r"a\.jsonl:251: not valid JSON \(nested too deeply\)"):
            prepare([tmp_path / "a.jsonl"], tmp_path / "out", "byte", workers=workers, batch_bytes=20_000)
        assert not (tmp_path / "out").exists()
        stats = prepare([tmp_path / "a.jsonl"], tmp_path / f"skip{workers}", "byte", skip_bad=True,
                        workers=workers, batch_bytes=20_000)
        assert stats.skipped_records == 1 and stats.documents == 399
        assert stats.first_skipped.endswith("a.jsonl:251: not valid JSON (nested too deeply)")
    with pytest.raises(DataError, match=r"a\.jsonl:251: not valid JSON \(nested too deeply\)"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "bpe", "bpe", vocab_size=300)
    stats = prepare([tmp_path / "a.jsonl"], tmp_path / "bpe", "bpe", vocab_size=300, skip_bad=True)
    assert stats.skipped_records == 1 and stats.documents == 399


def test_options_out_of_range_are_refused_before_anything_is_written(tmp_path):
    (tmp_path / "a.txt").write_text("some text\nand more\n")
    out = tmp_path / "out"
    for options, message in [
        ({"seed": -1}, r"seed must be an integer from 0 to 9223372036854775807, got -1"),
        ({"seed": 2**63}, r"seed must be an integer from 0 to"),
        ({"tokenizer_kind": "bpe", "vocab_size": 10**20}, r"vocab_size must be an integer at least 257 .* got 1000"),
        ({"tokenizer_kind": "bpe", "vocab_size": 100}, r"BPE vocab_size must be an integer at least 257"),
    ]:
        with pytest.raises(UsageError, match=message):
            prepare([tmp_path / "a.txt"], out, **options)
        assert not out.exists(), options
    k = 10**20  # shards: planned without a list of their bounds
    owner = -(-10 * k // 19) - 1  # the last shard starting at or before the 19-byte file's middle byte (9)
    assert prepare([tmp_path / "a.txt"], out, seed=2**63 - 1, num_shards=k, shard_index=owner).documents == 1
    assert prepare([tmp_path / "a.txt"], tmp_path / "o2", num_shards=k, shard_index=owner + 1).documents == 0


_KILLED_IN_SPLIT = """
import os, sys
import rwkvx_cli.data.prepare
prep = sys.modules["rwkvx_cli.data.prepare"]
real = prep.write_index
def write_then_die(path, *args):
    real(path, *args)
    if path.name.startswith(".train.idx.tmp"):  # train's pair is written under temporary names, not renamed: kill -9
        os.kill(os.getpid(), 9)
prep.write_index = write_then_die
prep.prepare([sys.argv[1]], sys.argv[2], "byte", workers=1)
"""


def test_a_prepare_killed_while_splitting_leaves_no_temporary_file_after_resume(tmp_path):
    """kill -9 after tokenizing, while the split writes train.bin under its temporary name: the resume, or a fresh
    prepare into the directory, finishes and removes what the killed process left (a second train.bin at corpus
    scale); a live process's temporary files, and files not rwkvx's, are kept."""

    _write_jsonl(tmp_path / "a.jsonl", [f"document {i} " * 30 for i in range(50)])
    out = tmp_path / "out"
    killed = subprocess.Popen([sys.executable, "-c", _KILLED_IN_SPLIT, str(tmp_path / "a.jsonl"), str(out)])
    assert killed.wait() == -9
    assert (out / f".train.bin.tmp{killed.pid}").exists() and not (out / "meta.json").exists()
    stats = prepare([tmp_path / "a.jsonl"], out, "byte", workers=1, resume=True)
    assert stats.resumed_bytes == stats.bytes  # resumed after tokenizing
    assert sorted(p.name for p in out.iterdir()) == sorted([".rwkvx-data", *FILES])
    dead = killed.pid
    planted = [f".val.idx.tmp{dead}", f".meta.json.tmp{dead}", f".tokenizer.json.tmp{dead}", f".tokens.tmp{dead}",
               f"..rwkvx-data.tmp{dead}", ".train.bin.tmp1"]  # pid 1 lives, but it cannot hold this directory's lock
    kept = [".tokenizer.json.tmp1", f".notes.tmp{dead}", f"train.bin.tmp{dead}"]  # a live pid's; not rwkvx's names
    for name in planted + kept:
        (out / name).write_bytes(b"x")
    prepare([tmp_path / "a.jsonl"], out, "byte", workers=1)  # a fresh prepare into the marked directory
    assert sorted(p.name for p in out.iterdir()) == sorted([".rwkvx-data", *FILES, *kept])


FILES = ("train.bin", "train.idx", "val.bin", "val.idx", "meta.json", "tokenizer.json")


def test_a_full_disk_names_the_file_and_what_a_resume_keeps(tmp_path, monkeypatch):
    import errno

    from typer.testing import CliRunner

    from rwkvx_cli.cli import app

    prep = sys.modules["rwkvx_cli.data.prepare"]
    _write_jsonl(tmp_path / "a.jsonl", [f"document {i} " * 30 for i in range(50)])
    out = tmp_path / "out"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write() says it: no file named

    with monkeypatch.context() as m:
        m.setattr(prep, "write_index", full)
        result = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "a.jsonl"), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == (  # after the progress line
        f"error: cannot write {out / 'train.idx'}: No space left on device; {out} holds no finished preparation (no "
        f"meta.json); what was tokenized is kept in {out / '.prepare'}: free space and run again with --resume"
    )
    assert not list(out.glob(".*.tmp*"))  # no temporary file left
    stats = prepare([tmp_path / "a.jsonl"], out, resume=True)
    assert stats.resumed_bytes == stats.bytes and (out / "meta.json").exists()
