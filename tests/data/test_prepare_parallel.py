"""prepare on N workers, in shards, interrupted and resumed: the same bytes every way."""

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rwkvx_cli.data import BinIdx, DataError, open_prepared, prepare
from rwkvx_cli.data.prepared import TokenChain
from rwkvx_cli.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = ROOT / "data" / "tinyshakespeare.txt"
FILES = ("train.bin", "train.idx", "val.bin", "val.idx", "meta.json", "tokenizer.json")

# sha256 (first 16 hex digits) of train.bin + train.idx + val.bin + val.idx as the code before worker processes
# (commit a108729) wrote them for these inputs, val_fraction 0.05, seed 0.
GOLDEN = {
    "byte": "cfb827c44b8cc949",
    "world": "620d8d5af51bb7bc",
    "bpe": "7ab54ef321d65053",
    "shakespeare-byte": "ed6bebfa171c039c",
    "shakespeare-world": "30ddd6d2c68294ac",
}


def golden_corpus(root: Path) -> list[Path]:
    """~1 MB in four files: JSONL, gzipped JSONL and a .txt; documents from 50 characters to 3x a piece."""
    text = SHAKESPEARE.read_text(encoding="utf-8")
    rng = np.random.default_rng(26)
    docs = []
    for _ in range(110):
        n = int(rng.choice([50, 700, 3000, 9000, 25000]) * rng.uniform(0.6, 1.4))
        a = int(rng.integers(0, len(text) - n))
        docs.append(text[a : a + n])
    docs[3] = ""
    docs[7] = "東京 🚀 naïve — ünïcödé\r\nsecond line\n\n\tindented\n  two spaces\n"
    docs[11] = "x" * 3000 + "\n" + "y " * 2000
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / "a.jsonl", root / "b.jsonl.gz", root / "c.txt", root / "d.jsonl"]
    paths[0].write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:45])))
    gz = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs[45:80]).encode()
    paths[1].write_bytes(gzip.compress(gz, mtime=0))
    paths[2].write_text(text[200_000:260_000], encoding="utf-8")
    paths[3].write_text("\n".join(json.dumps({"text": d}) for d in docs[80:]), encoding="utf-8")
    return paths


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for name in FILES[:4]:
        h.update((out / name).read_bytes())
    return h.hexdigest()[:16]


def _same_files(a: Path, b: Path) -> None:
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _docs(out: Path) -> list[bytes]:
    found = []
    for split in ("train", "val"):
        data = BinIdx(out / split)
        ends = np.cumsum(data.doc_sizes)
        found += [bytes(np.asarray(data.tokens[e - n : e])) for n, e in zip(data.doc_sizes, ends, strict=True)]
    return found


@pytest.mark.parametrize("kind", ["byte", "world", "bpe"])
def test_same_bytes_as_before_and_for_every_number_of_workers(tmp_path, kind):
    paths = golden_corpus(tmp_path / "in")
    vocab = 400 if kind == "bpe" else None
    one = prepare(paths, tmp_path / "w1", kind, vocab_size=vocab, workers=1)
    assert _digest(tmp_path / "w1") == GOLDEN[kind] and one.workers == 1
    meta = json.loads((tmp_path / "w1" / "meta.json").read_text())
    assert meta["val_requested"] == round(0.05 * meta["tokens"]) and meta["cuts"]["forced"] == 0
    for n in (2, 3):
        stats = prepare(paths, tmp_path / f"w{n}", kind, vocab_size=vocab, workers=n, batch_bytes=20_000)
        assert stats.workers == n
        _same_files(tmp_path / "w1", tmp_path / f"w{n}")


@pytest.mark.parametrize("kind", ["byte", "world", "bpe"])
def test_documents_whole_or_in_pieces_give_the_same_bytes(tmp_path, monkeypatch, kind):
    """A JSONL document is encoded as one text up to WHOLE_CHARS, and in pieces cut where the tokenizer's rule allows
    beyond: with that limit at 1,000 characters, every document longer than a piece is cut, as the code before
    this limit cut them, and the bytes are the same as encoding them whole (the test above)."""
    from rwkvx_cli.data import encode

    monkeypatch.setattr(encode, "WHOLE_CHARS", 1000)
    paths = golden_corpus(tmp_path / "in")
    prepare(paths, tmp_path / "out", kind, vocab_size=400 if kind == "bpe" else None, workers=1)
    assert _digest(tmp_path / "out") == GOLDEN[kind]


@pytest.mark.parametrize("kind", ["byte", "world"])
def test_single_document_same_bytes_as_before(tmp_path, kind):
    stats = prepare([SHAKESPEARE], tmp_path / "w1", kind)
    assert stats.split == "line" and _digest(tmp_path / "w1") == GOLDEN[f"shakespeare-{kind}"]
    prepare([SHAKESPEARE], tmp_path / "w2", kind, workers=2, batch_bytes=50_000)  # the pieces: here and to a worker
    _same_files(tmp_path / "w1", tmp_path / "w2")


def _big_jsonl(path: Path, n: int = 3000) -> None:
    text = SHAKESPEARE.read_text(encoding="utf-8")
    rng = np.random.default_rng(1)
    starts = rng.integers(0, len(text) - 3000, size=n)
    lengths = rng.integers(1, 3000, size=n)
    path.write_text("".join(json.dumps({"text": text[a : a + m]}) + "\n" for a, m in zip(starts, lengths, strict=True)))


def test_shards_hold_each_document_once_and_read_as_one_corpus(tmp_path):
    paths = golden_corpus(tmp_path / "in")
    _big_jsonl(tmp_path / "in" / "e.jsonl")  # 4.5 MB: split by byte ranges between the shards
    paths.append(tmp_path / "in" / "e.jsonl")
    prepare(paths, tmp_path / "whole", "world", val_fraction=0.0)
    whole = _docs(tmp_path / "whole")
    for k in (2, 3):
        shards = []
        for i in range(k):
            out = tmp_path / f"k{k}" / f"shard-{i}"
            stats = prepare(paths, out, "world", val_fraction=0.0, num_shards=k, shard_index=i, unit_bytes=300_000)
            assert stats.num_shards == k and stats.shard_index == i
            shards += _docs(out)
        assert shards == whole  # every document once, in corpus order
    # With validation splits: the union of all splits is still the corpus.
    for i in range(3):
        prepare(paths, tmp_path / "v" / f"s{i}", "world", val_fraction=0.1, num_shards=3, shard_index=i, workers=2)
    got = [d for i in range(3) for d in _docs(tmp_path / "v" / f"s{i}")]
    assert sorted(got) == sorted(whole)

    corpus = open_prepared([tmp_path / "v" / "s2", tmp_path / "v" / "s0", tmp_path / "v" / "s1"])
    assert corpus.dirs == [tmp_path / "v" / f"s{i}" for i in range(3)]  # a sharded corpus reads by shard index
    assert open_prepared(str(tmp_path / "v" / "s*")).dirs == corpus.dirs
    metas = [json.loads((d / "meta.json").read_text()) for d in corpus.dirs]
    assert corpus.weights == [m["train"]["tokens"] for m in metas]
    assert all(isinstance(t, np.memmap) for t in corpus.train_tokens)  # mapped, not copied
    assert len(corpus.val) == sum(m["val"]["tokens"] for m in metas)
    val = np.concatenate([np.asarray(BinIdx(d / "val").tokens) for d in corpus.dirs])
    np.testing.assert_array_equal(corpus.val[:], val)
    np.testing.assert_array_equal(corpus.val[100:len(val) - 7], val[100:-7])
    picks = np.array([0, 5, len(val) - 1, len(corpus.val.parts[0]), -1])
    np.testing.assert_array_equal(corpus.val[picks], val[picks])
    assert corpus.val[-1] == val[-1] and corpus.vocab_size == 65536 and corpus.eod_id == 0
    corpus.check_vocab(65536)
    with pytest.raises(DataError, match=r"shard 1 of 3 is missing"):
        open_prepared([tmp_path / "v" / "s0", tmp_path / "v" / "s2"])
    with pytest.raises(DataError, match=r"s0 is listed twice"):
        open_prepared([*(tmp_path / "v" / f"s{i}" for i in range(3)), tmp_path / "v" / "s0"])
    with pytest.raises(DataError, match=r"are both shard 0 of 3"):
        open_prepared([*(tmp_path / "v" / f"s{i}" for i in range(3)), tmp_path / "k3" / "shard-0"])
    with pytest.raises(DataError, match=r"has 65536 ids, more than vocab_size 1000"):
        open_prepared([tmp_path / "whole"], vocab_size=1000)
    with pytest.raises(UsageError, match="each shard would train its own BPE"):
        prepare(paths, tmp_path / "bpe", "bpe", vocab_size=300, num_shards=2, shard_index=0)
    with pytest.raises(UsageError, match=r"shard_index must be in 0\.\.1"):
        prepare(paths, tmp_path / "bad", "byte", num_shards=2, shard_index=2)


def test_open_prepared_refuses_what_is_not_one_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("To be, or not to be.\n" * 50)
    prepare([tmp_path / "a.txt"], tmp_path / "byte", "byte")
    prepare([tmp_path / "a.txt"], tmp_path / "world", "world")
    prepare([tmp_path / "a.txt"], tmp_path / "byte2", "byte", val_fraction=0.1)
    both = open_prepared([tmp_path / "byte", tmp_path / "byte2"])  # any two directories of one tokenizer
    assert len(both.train) == 2 and len(both.val) == len(BinIdx(tmp_path / "byte" / "val")) + len(
        BinIdx(tmp_path / "byte2" / "val")
    )
    with pytest.raises(DataError, match="were prepared with different tokenizers"):
        open_prepared([tmp_path / "byte", tmp_path / "world"])
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match=r"half is not a prepared directory \(no meta.json"):
        open_prepared([tmp_path / "byte", tmp_path / "half"])
    with pytest.raises(DataError, match="no prepared directory matches"):
        open_prepared(str(tmp_path / "nothing-*"))
    meta = json.loads((tmp_path / "byte2" / "meta.json").read_text())
    meta["tokenizer"]["eod_id"] = 3
    (tmp_path / "byte2" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"end documents with different ids \(0 and 3\)"):
        open_prepared([tmp_path / "byte", tmp_path / "byte2"])
    chain = TokenChain([np.arange(a, b, dtype=np.uint16) for a, b in ((0, 3), (0, 0), (10, 14))])
    assert len(chain) == 7 and chain[3] == 10 and chain[2:5].tolist() == [2, 10, 11] and chain[-1] == 13
    with pytest.raises(DataError, match=r"token id 12 at position 5 is outside the vocabulary"):
        chain.check_vocab(12)


def test_errors_name_the_line_whatever_the_worker_or_shard(tmp_path):
    _big_jsonl(tmp_path / "a.jsonl", 2000)
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    lines[1533] = '{"text": 5}\n'
    (tmp_path / "b.jsonl").write_text("".join(lines))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "cut off"}\n' * 100)[:-30])
    inputs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl.gz"]
    message = r'b\.jsonl:1534: expected a JSON object with a string "text" field'
    for workers in (1, 2):  # the truncated archive is read first, but reported after the earlier bad record
        with pytest.raises(DataError, match=message):
            prepare(inputs, tmp_path / "out", "byte", workers=workers, batch_bytes=50_000)
        assert not (tmp_path / "out").exists()  # nothing left, nor the dir it made: a bad corpus is not resumed
    # The second of two shards starts in the middle of b.jsonl: its line numbers still count from the file's start.
    with pytest.raises(DataError, match=message):
        prepare(inputs[:2], tmp_path / "out", "byte", num_shards=2, shard_index=1, batch_bytes=50_000)
    skipped = [
        prepare(inputs[:2], tmp_path / f"skip{w}", "byte", skip_bad=True, workers=w, batch_bytes=50_000)
        for w in (1, 2)
    ]
    assert [s.skipped_records for s in skipped] == [1, 1]
    assert skipped[0].first_skipped == skipped[1].first_skipped and skipped[0].first_skipped.endswith(message[12:])
    _same_files(tmp_path / "skip1", tmp_path / "skip2")


def test_progress_reports_documents_and_tokens(tmp_path):
    paths = golden_corpus(tmp_path / "in")
    reports, plain = [], []
    stats = prepare(
        paths, tmp_path / "out", "byte", workers=2, batch_bytes=100_000,
        on_progress=reports.append, progress=lambda d, t: plain.append((d, t)),
    )
    total = sum(p.stat().st_size for p in paths)
    assert reports[0].bytes_done == 0 and reports[-1].bytes_done == reports[-1].bytes_total == total
    assert [r.bytes_done for r in reports] == sorted(r.bytes_done for r in reports)
    assert reports[-1].documents == stats.documents
    assert reports[-1].tokens == stats.train_tokens + stats.val_tokens
    assert plain == [(r.bytes_done, r.bytes_total) for r in reports] and reports[-1].eta_seconds == 0


# -- interruptions -----------------------------------------------------------------------------------------------------


def _descendants(pid: int) -> set[int]:
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found.update(kids)
        todo += kids
    return found


def _gone(pids: set[int], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = []
        for p in pids:
            try:
                state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(p)
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _wait_for_units(out: Path, proc: subprocess.Popen, units: int, processes: int) -> set[int]:
    """Wait until the prepare in `proc` has finished `units` units and has `processes` descendants (they start while
    it tokenizes); returns those processes."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        try:
            state = json.loads((out / ".prepare" / "state.json").read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("units_done", 0) >= units and len(found := _descendants(proc.pid)) >= processes:
            return found
        time.sleep(0.005)
    raise AssertionError("the prepare did not get going")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture
def slow_corpus(tmp_path):
    """4 MB of JSONL and a BPE tokenizer.json: a prepare of many units that takes a second or two."""
    from .test_prepare import _hf_family

    _big_jsonl(tmp_path / "big.jsonl", 2800)
    _hf_family("bytelevel", SHAKESPEARE.read_text(encoding="utf-8")[:200_000]).save(str(tmp_path / "tok.json"))
    return tmp_path / "big.jsonl", tmp_path / "tok.json"


def test_kill_9_then_resume_gives_the_same_bytes(tmp_path, slow_corpus):
    corpus, tok = slow_corpus
    options = {"batch_bytes": 40_000, "unit_bytes": 100_000}
    prepare([corpus], tmp_path / "ref", tok, **options)
    code = (
        "import sys; from rwkvx_cli.data import prepare; "
        f"prepare([sys.argv[1]], sys.argv[2], sys.argv[3], workers=3, **{options!r})"
    )
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", code, str(corpus), str(out), str(tok)], env=_env())
    procs = _wait_for_units(out, proc, 3, 3)  # the forkserver and two workers (with this process, three tokenize)
    proc.kill()
    proc.wait()
    assert _gone(procs)  # no worker outlives a kill -9 of its prepare
    assert not (out / "meta.json").exists()  # not taken for a finished directory
    state = json.loads((out / ".prepare" / "state.json").read_text())
    assert 3 <= state["units_done"] < -(-corpus.stat().st_size // options["unit_bytes"])
    stats = prepare([corpus], out, tok, resume=True, workers=1, **options)
    assert 0 < stats.resumed_bytes < stats.bytes
    _same_files(tmp_path / "ref", out)
    assert not (out / ".prepare").exists()
    (out / ".prepare").mkdir()
    (out / ".prepare" / "state.json").write_text(json.dumps({**state, "job": {**state["job"], "inputs": []}}))
    with pytest.raises(UsageError, match="with other inputs"):
        prepare([corpus], out, tok, resume=True, **options)
    assert (out / ".prepare" / "state.json").exists() and (out / "meta.json").exists()  # a refusal changes nothing


def test_a_bad_tokenizer_leaves_an_earlier_preparation_intact(tmp_path):
    from rwkvx_cli.data.prepare import read_prepared_meta

    prepare([SHAKESPEARE], tmp_path / "out", "byte")
    with pytest.raises(UsageError, match="is not a file"):
        prepare([SHAKESPEARE], tmp_path / "out", tmp_path / "missing.json")
    assert read_prepared_meta(tmp_path / "out")["split"] == "line"


@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_ctrl_c_or_sigterm_stops_every_worker_and_resume_finishes(tmp_path, slow_corpus, sig, code, word):
    corpus, tok = slow_corpus
    out = tmp_path / "out"
    args = [sys.executable, "-m", "rwkvx_cli", "data", "prepare", str(corpus), "--out", str(out)]
    args += ["--tokenizer", str(tok)]
    proc = subprocess.Popen(
        [*args, "--workers", "3"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    procs: set[int] = set()
    end = time.monotonic() + 60
    while len(procs) < 3 and time.monotonic() < end and proc.poll() is None:  # the forkserver, two workers
        procs = _descendants(proc.pid)
        time.sleep(0.01)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C at a terminal reaches the whole process group
    else:
        os.kill(proc.pid, sig)  # a scheduler's SIGTERM to the command
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err.strip().splitlines()[-1] == word and "Traceback" not in err
    assert _gone(procs) and not (out / "meta.json").exists()
    done = subprocess.run([*args, "--resume", "--workers", "1"], env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "tokenizing" in done.stderr  # a plain progress line: stderr is not a terminal
    prepare([corpus], tmp_path / "ref", tok)
    _same_files(tmp_path / "ref", out)


def test_many_documents_and_no_copy_file_range_give_the_same_bytes(tmp_path, monkeypatch):
    import errno
    import importlib

    prep = importlib.import_module("rwkvx_cli.data.prepare")  # the package's `prepare` is the function

    paths = golden_corpus(tmp_path / "in")
    prepare(paths, tmp_path / "ref", "byte")
    monkeypatch.setattr(prep, "_IN_MEMORY_DOCS", 10)  # the validation choice on memory maps

    def unsupported(*args, **kwargs):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", unsupported)  # the splits copied through this process
    prepare(paths, tmp_path / "out", "byte")
    _same_files(tmp_path / "ref", tmp_path / "out")
    assert not list((tmp_path / "out").glob(".*.tmp*"))


def test_a_shard_without_input_is_an_empty_prepared_directory(tmp_path):
    (tmp_path / "one.txt").write_text("A single document, so one of two shards holds nothing.\n" * 20)
    for i in range(2):
        prepare([tmp_path / "one.txt"], tmp_path / f"s{i}", "byte", num_shards=2, shard_index=i)
    metas = [json.loads((tmp_path / f"s{i}" / "meta.json").read_text()) for i in range(2)]
    assert [m["documents"] for m in metas] == [0, 1] and metas[0]["tokens"] == 0 and metas[0]["sources"] == []
    corpus = open_prepared([tmp_path / "s0", tmp_path / "s1"])
    assert corpus.weights == [0, metas[1]["train"]["tokens"]] and len(corpus.val) == metas[1]["val"]["tokens"]


def test_cli_options_are_checked_in_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("text\n")
    base = [sys.executable, "-m", "rwkvx_cli", "data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o")]
    bad = subprocess.run([*base, "--num-shards", "2", "--shard-index", "2"], env=_env(), capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: shard_index must be in 0..1 (num_shards 2), got 2"
    ok = subprocess.run([*base, "--workers", "3", "--val-fraction", "0"], env=_env(), capture_output=True, text=True)
    assert ok.returncode == 0 and "prepared 1 documents" in ok.stdout and "tokenizing" in ok.stderr


def test_a_unit_whose_tokens_cannot_be_synced_gets_no_state(tmp_path):
    """The state file says a unit is done only after its tokens are on disk; a failed fsync is raised (at the next
    unit or at the end), not lost in the thread that syncs."""
    from rwkvx_cli.data.prepare import _Syncer

    r, w = os.pipe()  # fsync of a pipe fails (EINVAL)
    try:
        syncer = _Syncer(tmp_path, [r])
        syncer.submit({"units_done": 1})
        with pytest.raises(OSError):
            syncer.close()
        assert not (tmp_path / "state.json").exists()
        syncer.abandon()  # after the error, as prepare's cleanup calls it: returns
    finally:
        os.close(r)
        os.close(w)
    ok = _Syncer(tmp_path, [])
    ok.submit({"units_done": 1})
    ok.submit({"units_done": 2})  # the newest state wins
    ok.close()
    assert json.loads((tmp_path / "state.json").read_text()) == {"units_done": 2}
