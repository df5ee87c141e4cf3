"""Tokenizing a corpus in tasks: what `prepare` hands to its worker processes (or runs itself with one worker).

A task is about `batch_bytes` of one input: a byte range of an uncompressed JSONL file (the worker reads it: the lines
that start inside the range), complete JSONL lines that the reader decompressed, consecutive pieces of a text file's
document, or parquet rows. `Encoder.run(task)` returns the task's tokens already packed in the output dtype, the sizes
of the documents it completed, and what `prepare` records (text bytes, lines, skipped or bad records, the line cuts
inside its first document). Task order is document order, so writing the results in task order gives the same bytes
whatever the number of workers.

With a chat template (`EncoderSpec.template`, template.py) a task also returns its tokens' loss mask, one byte per
token (1: the token carries loss as a target): a JSONL file of conversations or prompt/response pairs is rendered
into spans, each tokenized on its own; a document's tokens (and every eod after a document) all carry loss.

The reader side (`unit_tasks`) runs in the main process; a failure it meets (a truncated archive, invalid UTF-8) is a
`ReadFailure` task, reported in order after every earlier task's result.
"""

from __future__ import annotations

import codecs
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from rwkvx_cli.data import corpus
from rwkvx_cli.data.cuts import CutRule, cut_text
from rwkvx_cli.data.errors import DataError

# A JSONL or parquet document up to this many characters is one text for the tokenizer; a longer one is encoded in
# pieces cut where the tokenizer's rule allows (the same ids), so one call's output stays bounded.
WHOLE_CHARS = 1 << 20

@dataclass(frozen=True)
class EncoderSpec:
    """What a worker needs to build its Encoder (pickled to it once)."""

    kind: str  # "byte", "world" or "bpe"
    tokenizer_json: str | None  # a BPE tokenizer's tokenizer.json text
    world_engine: str | None
    eod_id: int
    dtype: str  # "uint16" or "int32"
    text_field: str
    skip_bad: bool
    rule: str  # CutRule.name
    piece_chars: int
    max_chars: int
    # The World vocabulary's token bytes by id, so that no worker parses its file (65,536 entries: not in a repr).
    world_table: tuple[bytes, ...] | None = field(default=None, repr=False, compare=False)
    # The chat template's JSON (template.Template.to_json) when the corpus holds conversations: tasks then
    # return masks. None: no masks, the tokens of a prepare without templates.
    template: str | None = None


@dataclass(frozen=True)
class RangeTask:
    """The JSONL lines that start in bytes [start, end) of an uncompressed file."""

    path: str
    start: int
    end: int
    shape: str = "text"  # the file's record shape (template.file_shape)


@dataclass(frozen=True)
class LinesTask:
    """Complete JSONL lines (decompressed)."""

    data: bytes
    shape: str = "text"


@dataclass(frozen=True)
class PiecesTask:
    """Consecutive pieces of one text document; `kinds[i]` is the kind of cut after piece i ("end": the document's)."""

    pieces: list[str]
    kinds: list[str]


@dataclass(frozen=True)
class RowsTask:
    """Parquet values (None: a null) from row `first_row` (1-based)."""

    texts: list[str | None]
    first_row: int


class Local:
    """A marker among the tasks that no worker runs: it is its own result, in its place."""


@dataclass(frozen=True)
class ReadFailure(Local):
    """An error met while reading; raised when its turn comes (nothing after it is read)."""

    message: str


class UnitEnd(Local):
    """The end of a unit of input: `prepare` syncs its work directory there."""


Task = RangeTask | LinesTask | PiecesTask | RowsTask


@dataclass
class Encoded:
    tokens: bytes = b""  # packed in the output dtype, little-endian
    sizes: bytes = b""  # int64 tokens (eod included) of each document completed here (JSONL lines, parquet rows)
    cuts: list[int] = field(default_factory=list)  # line cuts inside this task's first document (token offsets)
    text_bytes: int = 0
    lines: int = 0  # JSONL lines read
    skipped: int = 0
    first_skipped: tuple[int, str] | None = None  # (line index in the task, or row, reason)
    bad: tuple[int, str] | None = None  # the first bad record without skip_bad: the task stopped there
    forced: int = 0  # forced cuts (no safe point within max_chars)
    mask: bytes = b""  # with a template: 1 byte per token of `tokens`, 1 where it carries loss


class Encoder:
    """Runs tasks with one tokenizer, single-threaded (a worker process is one core)."""

    def __init__(self, spec: EncoderSpec, tokenizer=None):
        self.spec = spec
        self.rule = CutRule.from_name(spec.rule)
        self.dtype = np.dtype(spec.dtype).newbyteorder("<")
        self._code = {"uint16": "H", "int32": "i"}[spec.dtype]
        self._packers: dict[int, struct.Struct] = {}
        self._encode_many = self._encoder(spec, tokenizer)
        self.template = None
        if spec.template is not None:
            from rwkvx_cli.data.template import Template

            self.template = Template.from_json(spec.template)

    def _encoder(self, spec: EncoderSpec, tokenizer) -> Callable[[list[str]], tuple[np.ndarray, np.ndarray]]:
        """texts -> (their ids one after another in the output dtype, the id count of each text), from `tokenizer`
        (the caller's, in its own process) or one built from spec."""
        if spec.kind == "byte":
            return self._bytes
        if spec.kind == "world":
            from rwkvx_cli.data.world import WorldTokenizer, _NativeEngine

            tok = tokenizer if tokenizer is not None else WorldTokenizer(spec.world_engine, table=spec.world_table)
            engine = tok._engine
            if isinstance(engine, _NativeEngine) and self.dtype == np.dtype("<u2"):
                return engine.encode_packed  # straight into uint16
            one = engine.encode  # one text at a time: the Rust encode_batch spreads over every core
            return lambda texts: self._packed([one(t) for t in texts])
        from tokenizers import Tokenizer

        from rwkvx_cli.data.tokenizer import BPETokenizer, bound_runs

        bpe = tokenizer if tokenizer is not None else BPETokenizer(Tokenizer.from_str(spec.tokenizer_json), spec.eod_id)
        encode = getattr(bpe._tok, "encode_batch_fast", bpe._tok.encode_batch)

        def many(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
            parts, owner = [], []
            for k, t in enumerate(texts):
                split = bound_runs(t)
                parts += split
                owner += [k] * len(split)
            ids, counts = self._packed([e.ids for e in encode(parts, add_special_tokens=False)])
            if len(parts) == len(texts):
                return ids, counts
            return ids, np.bincount(np.asarray(owner, dtype=np.int64), weights=counts, minlength=len(texts)).astype(
                np.int64
            )

        return many

    def _bytes(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        data = [t.encode("utf-8") for t in texts]
        ids = np.frombuffer(b"".join(data), np.uint8).astype(self.dtype) + 1
        return ids, np.fromiter(map(len, data), dtype=np.int64, count=len(data))

    def _packed(self, lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        # Packing a list of ids with struct costs less than numpy's or array's conversion of Python ints.
        packed = b"".join(map(self._pack, lists))
        return np.frombuffer(packed, self.dtype), np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))

    def _pack(self, ids: list[int]) -> bytes:
        n = len(ids)
        packer = self._packers.get(n)
        if packer is None:
            packer = struct.Struct(f"<{n}{self._code}")
            if n <= 1 << 16:  # lengths repeat; struct's own cache holds 100
                self._packers[n] = packer
        try:
            return packer.pack(*ids)
        except struct.error:
            bad = next(i for i in ids if not 0 <= i < (1 << 16 if self._code == "H" else 1 << 31))
            raise DataError(f"token id {bad} does not fit {self.spec.dtype}") from None

    def run(self, task) -> Encoded:
        if isinstance(task, RangeTask):
            out = self._lines(_read_range(task.path, task.start, task.end), task.shape)
        elif isinstance(task, LinesTask):
            out = self._lines(task.data, task.shape)
        elif isinstance(task, PiecesTask):
            out = self._pieces(task)
        elif isinstance(task, RowsTask):
            out = self._rows(task)
        else:
            raise TypeError(f"not a task: {task!r}")
        if self.template is not None and not out.mask and out.tokens:  # documents: every token carries loss
            out.mask = b"\x01" * (len(out.tokens) // self.dtype.itemsize)
        return out

    # -- documents -> tokens -----------------------------------------------------------------------------------------

    def _split(self, text: str) -> tuple[list[str], list[str]]:
        s = self.spec
        if len(text) <= s.piece_chars:
            return [text], ["end"]
        cuts, _ = cut_text(text, self.rule, s.piece_chars, s.max_chars)
        bounds = [0, *(c for c, _ in cuts), len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], [k for _, k in cuts] + ["end"]

    def _documents(self, docs: list[str], out: Encoded) -> None:
        """Tokens of whole documents (each followed by the eod id) into `out`; a document without tokens is left out.

        A document is one text for the tokenizer, except the task's first non-empty one when it is longer than
        piece_chars (its line cuts are where a corpus of that one document may be split) and any longer than
        WHOLE_CHARS (the tokenizer's output for one text stays bounded): those are cut into pieces where the
        tokenizer's rule allows (`cuts.py`), which encode as the whole document does."""
        texts: list[str] = []
        owner: list[int] = []  # the document of each text
        first = next((k for k, t in enumerate(docs) if t), -1)
        first_kinds: list[str] = []
        first_at = 0
        for k, text in enumerate(docs):
            if len(text) > WHOLE_CHARS or (k == first and len(text) > self.spec.piece_chars):
                pieces, kinds = self._split(text)
                out.forced += kinds.count("forced")
                if k == first:
                    first_kinds, first_at = kinds, len(texts)
                texts += pieces
                owner += [k] * len(pieces)
            else:
                texts.append(text)
                owner.append(k)
        ids, counts = self._encode_many(texts)
        if first_kinds:
            ends = np.cumsum(counts[first_at : first_at + len(first_kinds)])
            if ends[-1]:  # a document with tokens
                out.cuts = [int(e) for e, kind in zip(ends, first_kinds, strict=True) if kind == "line"]
        if len(texts) > len(docs):  # a document's count: the sum of its pieces'
            counts = np.bincount(np.asarray(owner), weights=counts, minlength=len(docs)).astype(np.int64)
        kept = counts > 0
        tokens = np.insert(ids, np.cumsum(counts)[kept], np.array(self.spec.eod_id, dtype=self.dtype))
        out.tokens = tokens.tobytes()
        out.sizes = (counts[kept] + 1).astype("<i8").tobytes()

    def _record(self, out: Encoded, where: int, reason: str) -> bool:
        """A bad record: counted under skip_bad (True: go on), else the task's error (False: stop)."""
        if self.spec.skip_bad:
            out.skipped += 1
            if out.first_skipped is None:
                out.first_skipped = (where, reason)
            return True
        out.bad = (where, reason)
        return False

    def _lines(self, data: bytes, shape: str = "text") -> Encoded:
        if self.template is not None and shape != "text":
            return self._records(data, shape)
        out = Encoded()
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        out.lines = len(lines)
        field_name, docs, loads = self.spec.text_field, [], orjson.loads
        for i, line in enumerate(lines):
            if not line or line.isspace():
                continue
            try:
                try:
                    text = loads(line)[field_name]  # the usual record, inline: a call less per document
                except (ValueError, TypeError, KeyError):  # any other: read again, for the record's message
                    text = corpus.record_field(line, field_name)
                nbytes = len(text) if type(text) is str and text.isascii() else corpus.document_bytes(text, field_name)
            except ValueError as e:
                if self._record(out, i, _mixed(line, field_name) or str(e)):
                    continue
                break
            docs.append(text)
            out.text_bytes += nbytes
        self._documents(docs, out)
        return out

    def _records(self, data: bytes, shape: str) -> Encoded:
        """Conversations or prompt/response pairs (JSONL lines of a file of that `shape`) rendered by the template,
        each followed by the eod id, with their masks."""
        from rwkvx_cli.data.template import parse_record

        out = Encoded()
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        out.lines = len(lines)
        records = []
        for i, line in enumerate(lines):
            if not line or line.isspace():
                continue
            try:
                spans = self.template.record_spans(parse_record(line), shape, self.spec.text_field)
            except ValueError as e:
                if self._record(out, i, str(e)):
                    continue
                break
            records.append(spans)
            out.text_bytes += sum(len(t) if t.isascii() else len(t.encode("utf-8")) for t, _ in spans)
        self._spans(records, out)
        return out

    def _spans(self, records: list[list[tuple[str, bool]]], out: Encoded) -> None:
        """The tokens and masks of `records` (each a list of (text, carries loss) spans) into `out`: each span
        tokenized on its own (one longer than WHOLE_CHARS in pieces, as a document), each record followed by the
        eod id, which carries loss when the record's last span does; a record without tokens is left out."""
        spans = [span for r in records for span in r]
        if not spans:
            return
        texts = [t for t, _ in spans]
        flags = np.fromiter((loss for _, loss in spans), dtype=np.uint8, count=len(spans))
        per_record = np.fromiter(map(len, records), dtype=np.int64, count=len(records))
        if max(map(len, texts)) > WHOLE_CHARS:  # a span too long for one call: in pieces, as a document
            pieces, owner = [], []
            for k, text in enumerate(texts):
                parts, kinds = self._split(text) if len(text) > WHOLE_CHARS else ([text], ["end"])
                out.forced += kinds.count("forced")
                pieces += parts
                owner += [k] * len(parts)
            ids, counts = self._encode_many(pieces)
            counts = np.bincount(np.asarray(owner), weights=counts, minlength=len(texts)).astype(np.int64)
        else:
            ids, counts = self._encode_many(texts)
        mask = np.repeat(flags, counts)
        record = np.repeat(np.arange(len(records)), per_record)  # of each span
        sizes = np.bincount(record, weights=counts, minlength=len(records)).astype(np.int64)
        last = np.cumsum(per_record) - 1  # each record's last span
        kept = sizes > 0
        at = np.cumsum(sizes)[kept]
        out.tokens = np.insert(ids, at, np.array(self.spec.eod_id, dtype=self.dtype)).tobytes()
        out.mask = np.insert(mask, at, flags[last[kept]]).tobytes()
        out.sizes = (sizes[kept] + 1).astype("<i8").tobytes()

    def _rows(self, task: RowsTask) -> Encoded:
        out = Encoded()
        docs = []
        for i, text in enumerate(task.texts):
            if text is None:
                if self._record(out, task.first_row + i, f'"{self.spec.text_field}" is null'):
                    continue
                break
            docs.append(text)
        out.text_bytes = sum(len(t.encode("utf-8")) for t in docs)
        self._documents(docs, out)
        return out

    def _pieces(self, task: PiecesTask) -> Encoded:
        """Pieces of a text document: its tokens only (the reader's side adds the eod at the document's end)."""
        out = Encoded()
        out.text_bytes = sum(len(t.encode("utf-8")) for t in task.pieces)
        ids, counts = self._encode_many(task.pieces)
        ends = np.cumsum(counts)
        out.cuts = [int(e) for e, kind in zip(ends, task.kinds, strict=True) if kind == "line"]
        out.forced = task.kinds.count("forced")
        out.tokens = ids.tobytes()
        return out


def _mixed(line: bytes, field_name: str) -> str | None:
    """Why a record that is not a document is bad in a file of documents: it has another shape."""
    from rwkvx_cli.data.template import SHAPES, parse_record, record_shape

    try:
        shape = record_shape(parse_record(line), field_name)
    except ValueError:
        return None
    if shape in (None, "text"):
        return None
    return f"{SHAPES[shape]}, in a file of documents (its first record's shape): one shape per file"


def _read_range(path: str, start: int, end: int) -> bytes:
    """The lines that start in [start, end), each whole: a line is read by the range where it starts."""
    try:
        with open(path, "rb") as f:
            pos = 0
            if start > 0:
                f.seek(start - 1)
                pos = start - 1 + len(f.readline())  # the rest of the line that started before `start`
            if pos >= end:
                return b""
            f.seek(pos)
            data = f.read(end - pos)
            if data and not data.endswith(b"\n"):
                data += f.readline()
            return data
    except OSError as e:
        raise DataError(f"cannot read input {path}: {e.strerror}") from None


def count_line_starts(path: Path, offset: int) -> int:
    """How many lines start before byte `offset` of a file (for the line numbers of a range read from the middle)."""
    if offset <= 0:
        return 0
    n, left = 1, offset - 1  # line 1 starts at 0; another after every newline before offset - 1
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n


# -- the reader side: one unit of input -> tasks -----------------------------------------------------------------------


def unit_tasks(
    path: Path, start: int, end: int, spec: EncoderSpec, batch_bytes: int, processes: int = 1, first: bool = False,
    last: bool = False, shape: str = "text",
) -> Iterator[tuple[Task | ReadFailure, int]]:
    """(task, input bytes it accounts for) for bytes [start, end) of one input (a whole file unless it is an
    uncompressed JSONL split by range). `processes` tokenize; `first` / `last`: the job's first / last unit
    (`ranges`); `shape`: a JSONL file's record shape (template.file_shape)."""
    fmt = corpus.input_format(path)
    if fmt is None:
        yield ReadFailure(f"{path}: unsupported input type; rwkvx reads {corpus.SUPPORTED}"), end - start
        return
    try:
        if fmt.kind == "jsonl" and fmt.compression is None:
            for a, b in ranges(start, end, batch_bytes, processes, first, last):
                yield RangeTask(str(path), a, b, shape), b - a
        elif fmt.kind == "jsonl":
            yield from _compressed_jsonl_tasks(path, fmt.compression, batch_bytes, shape)
        elif fmt.kind == "text":
            yield from _text_tasks(path, fmt.compression, spec, batch_bytes)
        else:
            yield from _parquet_tasks(path, spec.text_field, batch_bytes)
    except DataError as e:
        yield ReadFailure(str(e)), 0
    except FileNotFoundError:
        yield ReadFailure(f"input file not found: {path}"), 0
    except OSError as e:
        yield ReadFailure(f"cannot read input {path}: {e.strerror}"), 0


def ranges(
    start: int, end: int, batch_bytes: int, processes: int = 1, first: bool = False, last: bool = False
) -> Iterator[tuple[int, int]]:
    """[a, b) ranges one after another over [start, end), batch_bytes each. With more than one process, the job's
    first ranges grow from batch_bytes / 64, doubling (this process runs the first while the workers start: one of
    full size kept them waiting for it, a second and more with BPE), and its last shrink toward the end, each a
    quarter of what is left per process, down to batch_bytes / 64 (so the processes finish close together instead
    of all but one waiting on a last full-size task)."""
    floor = max(1, batch_bytes // 64)
    parallel = processes > 1
    size = floor if first and parallel else batch_bytes
    a = start
    while a < end:
        step = min(size, max(floor, (end - a) // (4 * processes))) if last and parallel else size
        b = min(end, a + step)
        yield a, b
        a, size = b, min(batch_bytes, size * 2)


def _compressed_jsonl_tasks(
    path: Path, compression: str, batch_bytes: int, shape: str = "text"
) -> Iterator[tuple[LinesTask, int]]:
    with open(path, "rb") as f:
        parts: list[bytes] = []
        size = nbytes = 0
        for block, n in corpus.decompressed(f, compression, path):
            nbytes += n
            parts.append(block)
            size += len(block)
            if size >= batch_bytes:
                data = b"".join(parts)
                end = data.rfind(b"\n") + 1
                if end:
                    yield LinesTask(data[:end], shape), nbytes
                    parts, size, nbytes = [data[end:]], len(data) - end, 0
                else:
                    parts = [data]  # one line longer than a batch: read on to its end
        data = b"".join(parts)
        if data or nbytes:
            yield LinesTask(data, shape), nbytes


def _text_tasks(path: Path, compression: str | None, spec: EncoderSpec, batch_bytes: int) -> Iterator:
    rule = CutRule.from_name(spec.rule)
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    carry, offset = "", 0
    pieces: list[str] = []
    kinds: list[str] = []
    chars = nbytes = 0
    with open(path, "rb") as f:
        blocks = corpus.decompressed(f, compression, path, corpus._BLOCK_BYTES)
        while True:
            block, n = next(blocks, (None, 0))
            final = block is None
            nbytes += n
            try:
                carry += decoder.decode(block or b"", final=final)
            except UnicodeDecodeError as e:
                yield ReadFailure(f"{path} is not UTF-8 text (invalid byte near offset {offset + e.start})"), nbytes
                return
            offset += len(block or b"")
            cuts, rest = cut_text(carry, rule, spec.piece_chars, spec.max_chars, final=final)
            at = 0
            for c, kind in cuts:
                pieces.append(carry[at:c])
                kinds.append(kind)
                chars += c - at
                at = c
            if final:
                pieces.append(carry[at:])
                kinds.append("end")
                yield PiecesTask(pieces, kinds), nbytes
                return
            carry = carry[rest:]
            if chars >= batch_bytes:
                yield PiecesTask(pieces, kinds), nbytes
                pieces, kinds, chars, nbytes = [], [], 0, 0


def _parquet_tasks(path: Path, text_field: str, batch_bytes: int) -> Iterator[tuple[RowsTask, int]]:
    pa, pq = corpus.parquet_modules()
    pf = corpus.open_parquet(path, text_field)
    size, rows = path.stat().st_size, max(pf.metadata.num_rows, 1)
    row, reported = 0, 0
    texts: list[str | None] = []
    chars = 0
    first = 1
    try:
        for batch in pf.iter_batches(batch_size=corpus._PARQUET_ROWS, columns=[text_field]):
            values = batch.column(0).to_pylist()
            texts += values
            row += len(values)
            chars += sum(len(t) for t in values if t is not None)
            if chars >= batch_bytes:
                done = size * row // rows
                yield RowsTask(texts, first), done - reported
                reported, first, texts, chars = done, row + 1, [], 0
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read parquet file {path}: {str(e).splitlines()[0]}") from None
    yield RowsTask(texts, first), size - reported


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
