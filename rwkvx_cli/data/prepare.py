"""`prepare`: text corpus -> tokenizer + train/val binidx + meta.json.

Inputs are read by `corpus.py` (.txt, .jsonl, .jsonl.gz/.zst, .parquet, directories and globs of those), streaming:
tokens go to a temporary file as they come, so memory stays bounded for corpora larger than RAM. Every document
becomes its tokens followed by the tokenizer's end-of-document id (0 unless a loaded tokenizer.json sets another).
Validation holds out whole documents (chosen at random by `seed`, never more tokens than asked for) when there are at
least two; a single document is cut at the line boundary nearest to the asked-for size, the head for training and the
tail for validation (only the tail ends with the end-of-document id, since only it ends the document).
"""

from __future__ import annotations

import array
import json
import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rwkvx_cli.data.binidx import BinIdxWriter, dtype_for_vocab
from rwkvx_cli.data.corpus import Skipped, expand_inputs, iter_pieces
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.tokenizer import NAMES, Tokenizer, load_tokenizer, train_tokenizer
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import DATA_MARKER, atomic_write_text, check_writable_dir, claim_dir, fsync_file

META_FORMAT = "rwkvx-prepared"
META_VERSION = 1
_BATCH_CHARS = 1 << 22  # text handed to one encode_batch call

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PrepareStats:
    out_dir: Path
    tokenizer_kind: str  # "byte", "world", "bpe" (trained here) or "file" (loaded)
    vocab_size: int
    dtype: str
    documents: int
    bytes: int
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int
    split: str  # "documents", "line" (one document cut at a line), "tokens" (cut mid-line: no line boundary) or "none"
    tokenizer_seconds: float  # training or loading the tokenizer
    tokenize_seconds: float
    text_bytes: int = 0  # UTF-8 bytes of document text (`bytes` counts input files as on disk, compressed)
    skipped_records: int = 0  # bad records left out under skip_bad
    first_skipped: str | None = None  # the first one's "file:line: reason"
    eod_id: int = 0

    @property
    def mb_per_s(self) -> float:
        """Tokenization throughput in MB (1e6 bytes) of input files per second."""
        return self.bytes / 1e6 / max(self.tokenize_seconds, 1e-9)

    @property
    def text_mb_per_s(self) -> float:
        """Tokenization throughput in MB of document text (UTF-8) per second."""
        return self.text_bytes / 1e6 / max(self.tokenize_seconds, 1e-9)


@dataclass
class _Tokenized:
    doc_sizes: array.array  # tokens per kept document, eod included ("q": 8 bytes a document)
    first_doc_cuts: list[int]  # token offsets of the safe cuts inside document 0
    source_docs: list[int]  # kept documents per input file
    text_bytes: int = 0
    skipped: Skipped = field(default_factory=Skipped)


def prepare(
    inputs: Sequence[str | os.PathLike],
    out_dir: Path,
    tokenizer_kind: str | os.PathLike = "byte",
    vocab_size: int | None = None,
    val_fraction: float | int = 0.05,
    seed: int = 0,
    progress: Progress | None = None,
    *,
    eod_id: int | None = None,
    text_field: str = "text",
    skip_bad: bool = False,
) -> PrepareStats:
    """Tokenize `inputs` into `out_dir/{train,val}.{bin,idx}`, `out_dir/tokenizer.json` and `out_dir/meta.json`.

    `inputs` are files, directories or glob patterns (`corpus.expand_inputs`). `tokenizer_kind` is "byte", "world",
    "bpe" (trained on the inputs, `vocab_size` entries) or a tokenizer file's path (`eod_id`: its end-of-document
    id, default 0). `val_fraction` is a fraction of the tokens (float in [0, 1)) or a token count (int).
    `text_field` names the document text in JSONL records and parquet columns; a bad record stops with a DataError
    naming file and line, or with `skip_bad` is counted and left out. `progress(done, total)` is called with input
    bytes read so far. Bad data raises DataError, bad options UsageError.
    """
    if not inputs:
        raise UsageError("prepare needs at least one input file")
    inputs = expand_inputs(inputs)
    out_dir = check_writable_dir(out_dir, DATA_MARKER, _prepared_here, "data directory")
    sizes = [p.stat().st_size for p in inputs]
    total_bytes = sum(sizes)
    _check_val_fraction(val_fraction)
    if not isinstance(text_field, str) or not text_field:
        raise UsageError(f"text_field must be a non-empty field name, got {text_field!r}")
    read_options = {"text_field": text_field, "skip_bad": skip_bad}

    t0 = time.perf_counter()
    tok, kind, source = _make_tokenizer(tokenizer_kind, inputs, vocab_size, eod_id, read_options)
    tok.encode_arrays(["warm"])  # builds a lazy engine (World's vocab trie): load time, not tokenization speed
    tokenizer_seconds = time.perf_counter() - t0
    dtype = dtype_for_vocab(tok.vocab_size)

    claim_dir(out_dir, DATA_MARKER)
    (out_dir / "meta.json").unlink(missing_ok=True)  # an older one must not vouch for a half-rewritten directory
    _remove_stale_streams(out_dir)
    stream_path = out_dir / f".tokens.tmp{os.getpid()}"
    try:
        t0 = time.perf_counter()
        tz = _tokenize(inputs, tok, dtype, stream_path, progress, total_bytes, read_options)
        tokenize_seconds = time.perf_counter() - t0
        doc_sizes = np.frombuffer(tz.doc_sizes, dtype=np.int64)
        total = int(doc_sizes.sum())
        if total == 0:
            raise DataError(f"the corpus has no text ({', '.join(str(p) for p in inputs)})")
        stream = np.memmap(stream_path, dtype=dtype, mode="r", shape=(total,))
        n_docs = len(doc_sizes)
        n_val = _val_tokens(val_fraction, total)
        if n_val == 0 or n_docs >= 2:
            split = "documents" if n_val else "none"
            is_val = _choose_val_docs(doc_sizes, n_val, seed) if n_val else np.zeros(n_docs, dtype=bool)
            train_sizes = _write_split(out_dir / "train", stream, doc_sizes, ~is_val, dtype)
            val_sizes = _write_split(out_dir / "val", stream, doc_sizes, is_val, dtype)
        else:
            cut, split = _cut_single(total, n_val, tz.first_doc_cuts)
            train_sizes = _write_split(out_dir / "train", stream[:cut], np.array([cut]), np.ones(1, bool), dtype)
            val_sizes = _write_split(out_dir / "val", stream[cut:], np.array([total - cut]), np.ones(1, bool), dtype)
        del stream  # release the map before the file goes
    finally:
        stream_path.unlink(missing_ok=True)
        if [p.name for p in out_dir.iterdir()] == [DATA_MARKER]:  # failed before writing anything
            (out_dir / DATA_MARKER).unlink()

    tok.save(out_dir / "tokenizer.json")
    stats = PrepareStats(
        out_dir=out_dir,
        tokenizer_kind=kind,
        vocab_size=tok.vocab_size,
        dtype=dtype.name,
        documents=n_docs,
        bytes=total_bytes,
        train_tokens=int(train_sizes.sum()),
        val_tokens=int(val_sizes.sum()),
        train_documents=len(train_sizes),
        val_documents=len(val_sizes),
        split=split,
        tokenizer_seconds=tokenizer_seconds,
        tokenize_seconds=tokenize_seconds,
        text_bytes=tz.text_bytes,
        skipped_records=tz.skipped.count,
        first_skipped=tz.skipped.first,
        eod_id=tok.eod_id,
    )
    meta = {
        "format": META_FORMAT,
        "version": META_VERSION,
        "tokenizer": {"kind": kind, "source": source, "file": "tokenizer.json", "eod_id": tok.eod_id},
        "vocab_size": stats.vocab_size,
        "dtype": stats.dtype,
        "documents": stats.documents,
        "bytes": stats.bytes,
        "text_bytes": stats.text_bytes,
        "tokens": total,
        "train": {"prefix": "train", "tokens": stats.train_tokens, "documents": stats.train_documents},
        "val": {"prefix": "val", "tokens": stats.val_tokens, "documents": stats.val_documents},
        "split": split,
        "val_fraction": int(val_fraction) if isinstance(val_fraction, numbers.Integral) else float(val_fraction),
        "seed": seed,
        "text_field": text_field,
        "skipped_records": stats.skipped_records,
        "sources": [
            {"path": str(p.resolve()), "bytes": b, "documents": d}
            for p, b, d in zip(inputs, sizes, tz.source_docs, strict=True)
        ],
    }
    # Written last: a directory with meta.json is complete.
    atomic_write_text(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")
    return stats


def _prepared_here(out_dir: Path) -> bool:
    """A directory prepared by an rwkvx older than the marker file: its meta.json is ours, or it
    holds the token stream of a prepare that was killed."""
    if any(out_dir.glob(".tokens.tmp*")):
        return True
    try:
        meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == META_FORMAT


def read_prepared_meta(data_dir: Path, tokenizer_vocab: int | None = None) -> dict:
    """A prepared directory's meta.json, checked against what the directory holds: a damaged or
    edited one (not JSON, wrong fields, a vocab_size or dtype the files or the tokenizer's
    `tokenizer_vocab` disagree with) is a DataError."""
    from rwkvx_cli.data.binidx import open_tokens

    path = Path(data_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DataError(f"{path} cannot be read: {e.strerror}") from None
    except ValueError:
        raise DataError(f"{path} is not valid JSON (damaged?); prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise DataError(f"{path} is not an rwkvx prepared-data description; prepare the data again")
    vocab, dtype = meta.get("vocab_size"), meta.get("dtype")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
        raise DataError(f"{path}: vocab_size {vocab!r} is not a vocabulary size")
    if dtype != dtype_for_vocab(vocab).name:
        raise DataError(f"{path}: dtype {dtype!r} does not fit vocab_size {vocab} ({dtype_for_vocab(vocab).name})")
    if tokenizer_vocab is not None and tokenizer_vocab != vocab:
        raise DataError(f"{path} says vocab_size {vocab}, its tokenizer.json has {tokenizer_vocab} (edited?)")
    for split in ("train", "val"):
        info = meta.get(split)
        tokens = info.get("tokens") if isinstance(info, dict) else None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise DataError(f"{path}: {split!r} does not give its token count")
        try:
            opened = open_tokens(Path(data_dir) / f"{split}.bin")
        except (DataError, OSError, ValueError) as e:
            raise DataError(f"{Path(data_dir) / split}.bin: {e}") from None
        if opened.dtype != np.dtype(dtype) or len(opened) != tokens:
            raise DataError(
                f"{path} says {split} holds {tokens} {dtype} tokens; the file holds {len(opened)} {opened.dtype} "
                "(edited or damaged?); prepare the data again"
            )
    return meta


def _remove_stale_streams(out_dir: Path) -> None:
    """Token streams left by a prepare that was killed (its pid is gone) are removed."""
    for p in out_dir.glob(".tokens.tmp*"):
        pid = p.name[len(".tokens.tmp") :]
        if pid.isdigit() and not _alive(int(pid)):
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _write_split(prefix: Path, stream: np.ndarray, doc_sizes: np.ndarray, keep: np.ndarray, dtype) -> np.ndarray:
    """Write the documents of `stream` where `keep` is set, in order, as runs of consecutive kept documents."""
    offsets = np.zeros(len(doc_sizes) + 1, dtype=np.int64)
    np.cumsum(doc_sizes, out=offsets[1:])
    edges = np.flatnonzero(np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8)))
    with BinIdxWriter(prefix, dtype) as w:
        for a, b in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
            w.add(stream[offsets[a] : offsets[b]], doc_sizes[a:b])
        return w.commit()


def _check_val_fraction(val_fraction) -> None:
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real):
        raise UsageError(f"val_fraction must be a fraction in [0, 1) or a token count, got {val_fraction!r}")
    if isinstance(val_fraction, numbers.Integral):
        if val_fraction < 0:
            raise UsageError(f"the validation token count must be >= 0, got {val_fraction}")
    elif not 0.0 <= val_fraction < 1.0:
        raise UsageError(f"val_fraction must be in [0, 1) (or an integer token count), got {val_fraction}")


def _val_tokens(val_fraction: float | int, total: int) -> int:
    n = int(val_fraction) if isinstance(val_fraction, numbers.Integral) else round(float(val_fraction) * total)
    if n >= total:
        raise DataError(f"a validation split of {n} tokens leaves no training data: the corpus has {total} tokens")
    return n


def _make_tokenizer(kind, inputs: list[Path], vocab_size: int | None, eod_id: int | None, read_options: dict):
    if isinstance(kind, str) and kind in (*NAMES, "bpe"):
        if eod_id not in (None, 0):
            raise UsageError(f"eod_id applies to a loaded tokenizer.json; the {kind} tokenizer's is 0")
        return train_tokenizer(kind, inputs, vocab_size, **read_options), kind, None
    path = Path(kind)
    if not path.is_file():
        raise UsageError(
            f"tokenizer must be byte, world, bpe or the path of a tokenizer file; {path} is not a file"
        )
    tok = load_tokenizer(path, eod_id=eod_id)
    if vocab_size is not None and vocab_size != tok.vocab_size:
        raise UsageError(f"vocab_size {vocab_size} does not match the loaded tokenizer's {tok.vocab_size}")
    return tok, "file", str(path.resolve())


def _batches(
    inputs: list[Path], read_options: dict, skipped: Skipped
) -> Iterator[tuple[list[str], list[tuple[int, bool]], int]]:
    """(texts, (input index, doc_end) per text, input bytes) in batches of about _BATCH_CHARS characters."""
    texts: list[str] = []
    owners: list[tuple[int, bool]] = []
    chars = nbytes = 0
    for k, path in enumerate(inputs):
        for piece in iter_pieces(path, skipped=skipped, **read_options):
            nbytes += piece.nbytes
            if piece.text or piece.doc_end:
                texts.append(piece.text)
                owners.append((k, piece.doc_end))
                chars += len(piece.text)
            if chars >= _BATCH_CHARS:
                yield texts, owners, nbytes
                texts, owners, chars, nbytes = [], [], 0, 0
    if texts or nbytes:
        yield texts, owners, nbytes


def _tokenize(
    inputs: list[Path],
    tok: Tokenizer,
    dtype: np.dtype,
    stream_path: Path,
    progress: Progress | None,
    total_bytes: int,
    read_options: dict,
) -> _Tokenized:
    out = _Tokenized(doc_sizes=array.array("q"), first_doc_cuts=[], source_docs=[0] * len(inputs))
    eod = np.array([tok.eod_id], dtype=dtype).tobytes()
    current = 0  # tokens so far in the open document
    done = 0
    if progress is not None:
        progress(0, total_bytes)
    with open(stream_path, "wb") as f:
        for texts, owners, nbytes in _batches(inputs, read_options, out.skipped):
            out.text_bytes += sum(len(t.encode("utf-8")) for t in texts)
            for ids, (k, doc_end) in zip(tok.encode_arrays(texts), owners, strict=True):
                if ids.size:
                    f.write(ids.astype(dtype).tobytes())
                    current += ids.size
                    if not out.doc_sizes:
                        out.first_doc_cuts.append(current)
                if doc_end and current:
                    f.write(eod)
                    out.doc_sizes.append(current + 1)
                    out.source_docs[k] += 1
                    current = 0
            done += nbytes
            if progress is not None:
                progress(done, total_bytes)
        fsync_file(f)
    return out


def _choose_val_docs(doc_sizes: np.ndarray, n_val: int, seed: int) -> np.ndarray:
    """Documents in a seeded random order, each taken while the validation split stays within n_val tokens."""
    n = len(doc_sizes)
    is_val = np.zeros(n, dtype=bool)
    got = 0
    order = np.random.default_rng(seed).permutation(n)
    for start in range(0, n, 1 << 20):  # in chunks: no list of every document
        chunk = order[start : start + (1 << 20)]
        for i, size in zip(chunk.tolist(), doc_sizes[chunk].tolist(), strict=True):
            if got + size <= n_val:
                is_val[i] = True
                got += size
                if got == n_val:
                    return is_val
    if got == 0:  # every document is larger than asked for: hold out the smallest one
        is_val[int(np.argmin(doc_sizes))] = True
    return is_val


def _cut_single(total: int, n_val: int, cuts: list[int]) -> tuple[int, str]:
    """The token offset that splits the only document, preferring a line boundary nearest to total - n_val."""
    target = total - n_val
    inner = [c for c in cuts if 0 < c < total - 1]  # total - 1 is the end of the text, before the eod
    if not inner:
        return target, "tokens"
    return min(inner, key=lambda c: abs(c - target)), "line"
