"""`prepare`: text corpus -> tokenizer + train/val binidx + meta.json.

Every document becomes its tokens followed by `<|eod|>` (id 0). Validation holds out whole documents (chosen at
random by `seed`, never more tokens than asked for) when there are at least two; a single document is cut at the line
boundary nearest to the asked-for size, the head for training and the tail for validation (only the tail ends with
id 0, since only it ends the document).
"""

from __future__ import annotations

import json
import numbers
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rwkvx_cli.data.binidx import dtype_for_vocab, write_binidx
from rwkvx_cli.data.corpus import iter_pieces
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.tokenizer import EOD_ID, BPETokenizer, ByteTokenizer, load_tokenizer, train_tokenizer
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import atomic_write_text, fsync_file

META_FORMAT = "rwkvx-prepared"
META_VERSION = 1
_BATCH_CHARS = 1 << 22  # text handed to one encode_batch call

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PrepareStats:
    out_dir: Path
    tokenizer_kind: str  # "byte", "bpe" (trained here) or "file" (loaded)
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

    @property
    def mb_per_s(self) -> float:
        """Tokenization throughput in MB (1e6 bytes) of input text per second."""
        return self.bytes / 1e6 / max(self.tokenize_seconds, 1e-9)


@dataclass
class _Tokenized:
    doc_sizes: list[int]  # tokens per kept document, eod included
    first_doc_cuts: list[int]  # token offsets of the safe cuts inside document 0
    source_docs: list[int]  # kept documents per input file


def prepare(
    inputs: list[Path],
    out_dir: Path,
    tokenizer_kind: str | os.PathLike = "byte",
    vocab_size: int | None = None,
    val_fraction: float | int = 0.05,
    seed: int = 0,
    progress: Progress | None = None,
) -> PrepareStats:
    """Tokenize `inputs` into `out_dir/{train,val}.{bin,idx}`, `out_dir/tokenizer.json` and `out_dir/meta.json`.

    `tokenizer_kind` is "byte", "bpe" (trained on the inputs, `vocab_size` entries) or a tokenizer file's path.
    `val_fraction` is a fraction of the tokens (float in [0, 1)) or a token count (int). `progress(done, total)` is
    called with input bytes tokenized so far. Bad data raises DataError, bad options UsageError.
    """
    inputs = [Path(p) for p in inputs]
    out_dir = Path(out_dir)
    if not inputs:
        raise UsageError("prepare needs at least one input file")
    sizes = []
    for p in inputs:
        if not p.exists():
            raise DataError(f"input file not found: {p}")
        if not p.is_file():
            raise DataError(f"input {p} is not a file")
        sizes.append(p.stat().st_size)
    total_bytes = sum(sizes)
    _check_val_fraction(val_fraction)

    t0 = time.perf_counter()
    tok, kind, source = _make_tokenizer(tokenizer_kind, inputs, vocab_size)
    tokenizer_seconds = time.perf_counter() - t0
    dtype = dtype_for_vocab(tok.vocab_size)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # an older one must not vouch for a half-rewritten directory
    stream_path = out_dir / f".tokens.tmp{os.getpid()}"
    try:
        t0 = time.perf_counter()
        tz = _tokenize(inputs, tok, dtype, stream_path, progress, total_bytes)
        tokenize_seconds = time.perf_counter() - t0
        total = sum(tz.doc_sizes)
        if total == 0:
            raise DataError(f"the corpus has no text ({', '.join(str(p) for p in inputs)})")
        stream = np.asarray(np.memmap(stream_path, dtype=dtype, mode="r", shape=(total,)))
        offsets = np.concatenate([[0], np.cumsum(tz.doc_sizes)]).tolist()
        n_docs = len(tz.doc_sizes)
        n_val = _val_tokens(val_fraction, total)
        if n_val == 0 or n_docs >= 2:
            split = "documents" if n_val else "none"
            is_val = _choose_val_docs(tz.doc_sizes, n_val, seed) if n_val else [False] * n_docs
            train = (stream[offsets[i] : offsets[i + 1]] for i in range(n_docs) if not is_val[i])
            val = (stream[offsets[i] : offsets[i + 1]] for i in range(n_docs) if is_val[i])
        else:
            cut, split = _cut_single(total, n_val, tz.first_doc_cuts)
            train, val = [stream[:cut]], [stream[cut:]]
        train_sizes = write_binidx(out_dir / "train", train, dtype)
        val_sizes = write_binidx(out_dir / "val", val, dtype)
        del stream, train, val  # release the map before the file goes
    finally:
        stream_path.unlink(missing_ok=True)

    tok.save(out_dir / "tokenizer.json")
    stats = PrepareStats(
        out_dir=out_dir,
        tokenizer_kind=kind,
        vocab_size=tok.vocab_size,
        dtype=dtype.name,
        documents=len(tz.doc_sizes),
        bytes=total_bytes,
        train_tokens=int(train_sizes.sum()),
        val_tokens=int(val_sizes.sum()),
        train_documents=len(train_sizes),
        val_documents=len(val_sizes),
        split=split,
        tokenizer_seconds=tokenizer_seconds,
        tokenize_seconds=tokenize_seconds,
    )
    meta = {
        "format": META_FORMAT,
        "version": META_VERSION,
        "tokenizer": {"kind": kind, "source": source, "file": "tokenizer.json", "eod_id": EOD_ID},
        "vocab_size": stats.vocab_size,
        "dtype": stats.dtype,
        "documents": stats.documents,
        "bytes": stats.bytes,
        "tokens": total,
        "train": {"prefix": "train", "tokens": stats.train_tokens, "documents": stats.train_documents},
        "val": {"prefix": "val", "tokens": stats.val_tokens, "documents": stats.val_documents},
        "split": split,
        "val_fraction": int(val_fraction) if isinstance(val_fraction, numbers.Integral) else float(val_fraction),
        "seed": seed,
        "sources": [
            {"path": str(p.resolve()), "bytes": b, "documents": d}
            for p, b, d in zip(inputs, sizes, tz.source_docs, strict=True)
        ],
    }
    # Written last: a directory with meta.json is complete.
    atomic_write_text(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")
    return stats


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


def _make_tokenizer(kind, inputs: list[Path], vocab_size: int | None):
    if isinstance(kind, str) and kind in ("byte", "bpe"):
        return train_tokenizer(kind, inputs, vocab_size), kind, None
    path = Path(kind)
    if not path.is_file():
        raise UsageError(f"tokenizer must be byte, bpe or the path of a tokenizer file; {path} is not a file")
    tok = load_tokenizer(path)
    if vocab_size is not None and vocab_size != tok.vocab_size:
        raise UsageError(f"vocab_size {vocab_size} does not match the loaded tokenizer's {tok.vocab_size}")
    return tok, "file", str(path.resolve())


def _batches(inputs: list[Path]) -> Iterator[tuple[list[str], list[tuple[int, bool]], int]]:
    """(texts, (input index, doc_end) per text, input bytes) in batches of about _BATCH_CHARS characters."""
    texts: list[str] = []
    owners: list[tuple[int, bool]] = []
    chars = nbytes = 0
    for k, path in enumerate(inputs):
        for piece in iter_pieces(path):
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
    tok: ByteTokenizer | BPETokenizer,
    dtype: np.dtype,
    stream_path: Path,
    progress: Progress | None,
    total_bytes: int,
) -> _Tokenized:
    out = _Tokenized(doc_sizes=[], first_doc_cuts=[], source_docs=[0] * len(inputs))
    eod = np.array([EOD_ID], dtype=dtype)
    current = 0  # tokens so far in the open document
    done = 0
    if progress is not None:
        progress(0, total_bytes)
    with open(stream_path, "wb") as f:
        for texts, owners, nbytes in _batches(inputs):
            for ids, (k, doc_end) in zip(tok.encode_arrays(texts), owners, strict=True):
                if ids.size:
                    f.write(ids.astype(dtype).tobytes())
                    current += ids.size
                    if not out.doc_sizes:
                        out.first_doc_cuts.append(current)
                if doc_end and current:
                    f.write(eod.tobytes())
                    out.doc_sizes.append(current + 1)
                    out.source_docs[k] += 1
                    current = 0
            done += nbytes
            if progress is not None:
                progress(done, total_bytes)
        fsync_file(f)
    return out


def _choose_val_docs(doc_sizes: list[int], n_val: int, seed: int) -> list[bool]:
    """Documents in a seeded random order, each taken while the validation split stays within n_val tokens."""
    is_val = [False] * len(doc_sizes)
    got = 0
    for i in np.random.default_rng(seed).permutation(len(doc_sizes)).tolist():
        if got + doc_sizes[i] <= n_val:
            is_val[i] = True
            got += doc_sizes[i]
            if got == n_val:
                break
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
