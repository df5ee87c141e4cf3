"""Reading a corpus: input types, directories and globs, and documents as pieces, streaming (memory bounded by one
block or line).

Inputs (`SUPPORTED`): `.txt` is one UTF-8 document; `.jsonl` / `.ndjson` hold one document per line (a JSON object
whose `text_field`, default "text", is a string); either may be compressed as `.gz` or `.zst`; `.parquet` holds one
document per row of the `text_field` column. `expand_inputs` turns directories and glob patterns into such files and
refuses any other file type.

`iter_pieces` yields a file's documents in pieces of about PIECE_CHARS characters, cut where `cuts.py` says (by
default only after a newline followed by a non-space character); `prepare` reads through `encode.py`, which uses the
helpers here with the cut rule of its tokenizer.
"""

from __future__ import annotations

import codecs
import glob
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from rwkvx_cli.data.cuts import LINES_ONLY, MAX_PIECE_CHARS, PIECE_CHARS, CutRule, cut_text, split_pieces
from rwkvx_cli.data.errors import DataError

_BLOCK_BYTES = 1 << 22
_MAX_CARRY = MAX_PIECE_CHARS  # text without any safe cut is cut anyway past this many characters (a forced cut)
_PARQUET_ROWS = 1024  # rows per record batch read from a parquet file
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSIONS = (".gz", ".zst")
SUPPORTED = ".txt, .jsonl, .ndjson (each also as .gz or .zst) and .parquet"
_INSTALL = {"zst": "zstandard", "parquet": "pyarrow"}


@dataclass(frozen=True)
class Piece:
    text: str  # may be "" (a blank line, the end of an empty document, or only input progress)
    doc_end: bool  # the last piece of its document
    nbytes: int  # input file bytes (compressed, as on disk) consumed since the previous piece


@dataclass
class Skipped:
    """Bad records skipped under `skip_bad`: how many, and the first one's "file:line: reason"."""

    count: int = 0
    first: str | None = None

    def add(self, message: str) -> None:
        self.count += 1
        if self.first is None:
            self.first = message


@dataclass(frozen=True)
class InputFormat:
    kind: str  # "text", "jsonl" or "parquet"
    compression: str | None  # None, "gz" or "zst"


def input_format(path: str | Path) -> InputFormat | None:
    """The format of an input file by its name, or None if rwkvx does not read that type."""
    name = Path(path).name.lower()
    compression = None
    for suffix in COMPRESSIONS:
        if name.endswith(suffix):
            compression, name = suffix[1:], name[: -len(suffix)]
    if name.endswith(".txt"):
        return InputFormat("text", compression)
    if name.endswith(JSONL_SUFFIXES):
        return InputFormat("jsonl", compression)
    if name.endswith(".parquet") and compression is None:
        return InputFormat("parquet", None)
    return None


def _needs(module: str, what: str):
    try:
        return __import__(module)
    except ImportError:
        raise DataError(f"reading {what} needs {module}: pip install {module} (or 'rwkvx[corpora]')") from None


def _check_readable(path: Path) -> Path:
    fmt = input_format(path)
    if fmt is None:
        raise DataError(f"{path}: unsupported input type; rwkvx reads {SUPPORTED}")
    if fmt.compression == "zst":
        _needs("zstandard", ".zst files")
    if fmt.kind == "parquet":
        _needs("pyarrow", ".parquet files")
    return path


def _dir_files(root: Path) -> list[Path]:
    """The supported files under `root` (recursive, sorted; hidden names skipped; other types ignored)."""
    found = []
    for p in sorted(root.rglob("*")):
        if any(part.startswith(".") for part in p.relative_to(root).parts):
            continue
        if p.is_file() and input_format(p) is not None:
            found.append(p)
    if not found:
        raise DataError(f"input directory {root} holds no {SUPPORTED} files")
    return found


def expand_inputs(inputs: Iterable[str | Path]) -> list[Path]:
    """Files to read, in order: each input is a file, a directory (its supported files, recursively, sorted) or a
    glob pattern (`*`, `?`, `[...]`, `**`; its matches, sorted). A file named twice is read once."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files += _dir_files(p)
        elif p.is_file():
            files.append(p)
        elif glob.has_magic(str(item)):
            matches = sorted(glob.glob(str(item), recursive=True))
            if not matches:
                raise DataError(f"no input matches {item}")
            for m in map(Path, matches):
                files += _dir_files(m) if m.is_dir() else [m]
        elif p.exists():
            raise DataError(f"input {p} is not a regular file")
        else:
            raise DataError(f"input file not found: {p}")
    seen, out = set(), []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            out.append(_check_readable(f))
    if not out:
        raise DataError("no input files")
    return out


def decompressed(f, compression: str | None, path: Path, block_bytes: int = 0) -> Iterator[tuple[bytes, int]]:
    """(data, input bytes read for it) blocks of a file object, decompressed; a cut-off stream is a DataError."""
    block_bytes = block_bytes or _BLOCK_BYTES
    if compression is None:
        while block := f.read(block_bytes):
            yield block, len(block)
        return
    if compression == "gz":
        new = lambda: zlib.decompressobj(zlib.MAX_WBITS | 16)  # noqa: E731 - gzip header and trailer, one member
        errors: tuple = (zlib.error,)
    else:
        zstandard = _needs("zstandard", ".zst files")
        dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)  # also accept `zstd --long=31` files
        new, errors = dctx.decompressobj, (zstandard.ZstdError,)
    d, started = new(), False
    try:
        while raw := f.read(block_bytes):
            pending, nbytes = raw, len(raw)
            while pending:
                out = d.decompress(pending)
                started = True
                if out or nbytes:
                    yield out, nbytes
                    nbytes = 0
                if d.eof:  # a new gzip member or zstd frame may follow
                    pending, d, started = d.unused_data, new(), False
                else:
                    pending = b""
    except errors as e:
        raise DataError(f"{path} is not a valid .{compression} file ({e})") from None
    if started:
        raise DataError(f"{path} is truncated: the .{compression} stream ends before its end marker")


def _text_pieces(path: Path, blocks: Iterator[tuple[bytes, int]], rule: CutRule = LINES_ONLY) -> Iterator[Piece]:
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    carry, offset = "", 0
    while True:
        block, nbytes = next(blocks, (None, 0))
        final = block is None
        try:
            carry += decoder.decode(block or b"", final=final)
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not UTF-8 text (invalid byte near offset {offset + e.start})") from None
        offset += len(block or b"")
        # The undecided tail waits for the next block (it may continue its line); cut_text bounds it.
        cuts, rest = cut_text(carry, rule, PIECE_CHARS, _MAX_CARRY, final=final)
        bounds = [0, *(c for c, _ in cuts)] + ([len(carry)] if final else [])
        pieces = [carry[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        carry = carry[rest:]
        for i, p in enumerate(pieces):
            if p or (final and i == len(pieces) - 1):
                yield Piece(p, final and i == len(pieces) - 1, nbytes)
                nbytes = 0
        if nbytes:
            yield Piece("", False, nbytes)
        if final:
            return


def document_bytes(text, field: str) -> int:
    """The UTF-8 size of a record's text, or a ValueError saying why the record is bad."""
    if not isinstance(text, str):
        raise ValueError(f'expected a JSON object with a string "{field}" field')
    if text.isascii():  # a flag of the string: no copy
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f'"{field}" contains an unpaired surrogate \\u{ord(text[e.start]):04x}') from None


def document_text(text, field: str) -> str:
    """The record's text, or a ValueError saying why the record is bad."""
    document_bytes(text, field)
    return text


def _doc_pieces(text: str, nbytes: int) -> Iterator[Piece]:
    pieces = split_pieces(text)
    for i, p in enumerate(pieces):
        yield Piece(p, i == len(pieces) - 1, nbytes if i == 0 else 0)


def _jsonl_pieces(
    path: Path, blocks: Iterator[tuple[bytes, int]], field: str, skipped: Skipped | None
) -> Iterator[Piece]:
    tail: list[bytes] = []  # the unfinished line, in parts (joined once: a long line stays linear)
    lineno = 0
    for block, nbytes in blocks:
        if nbytes:
            yield Piece("", False, nbytes)
        end = block.rfind(b"\n")
        if end < 0:
            tail.append(block)
            continue
        lines = (b"".join(tail) + block[:end] if tail else block[:end]).split(b"\n")
        tail = [block[end + 1 :]]
        for line in lines:
            lineno += 1
            yield from _jsonl_record(path, lineno, line, field, skipped)
    last = b"".join(tail)
    if last:
        yield from _jsonl_record(path, lineno + 1, last, field, skipped)


def record_field(line: bytes, field: str):
    """The value of `field` in one JSONL record; ValueError saying what is wrong with the line.

    orjson reads it (twice the speed of the json module on long strings); what orjson refuses but json takes (NaN,
    a byte order mark, an unpaired surrogate escape, nesting past 1,024) is read by json, so the records accepted
    and the message for a bad one are json's."""
    try:
        obj = orjson.loads(line)
    except ValueError:
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        except RecursionError:  # json's parser recurses per level: [[[...]]] deeper than Python's stack
            raise ValueError("not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ValueError(f'expected a JSON object with a string "{field}" field')
    return obj.get(field)


def _jsonl_record(path: Path, lineno: int, line: bytes, field: str, skipped: Skipped | None) -> Iterator[Piece]:
    if not line.strip():
        return
    try:
        text = document_text(record_field(line, field), field)
    except ValueError as e:
        message = f"{path}:{lineno}: {e}"
        if skipped is None:
            raise DataError(message) from None
        skipped.add(message)
        return
    yield from _doc_pieces(text, 0)


def parquet_modules():
    _needs("pyarrow", ".parquet files")
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa, pq


def open_parquet(path: Path, field: str):
    """A pyarrow ParquetFile whose column `field` holds strings, or a DataError saying why not."""
    pa, pq = parquet_modules()
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable parquet file ({str(e).splitlines()[0]})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(field).type
    if not _is_string(pa, kind):
        raise DataError(f"{path}: column {field!r} holds {kind}, not strings")
    return pf


def _parquet_pieces(path: Path, field: str, skipped: Skipped | None) -> Iterator[Piece]:
    pa, _ = parquet_modules()
    pf = open_parquet(path, field)
    size, rows = path.stat().st_size, max(pf.metadata.num_rows, 1)
    row, reported = 0, 0
    try:
        for batch in pf.iter_batches(batch_size=_PARQUET_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    message = f'{path}: row {row}: "{field}" is null'
                    if skipped is None:
                        raise DataError(message)
                    skipped.add(message)
                    continue
                yield from _doc_pieces(text, 0)
            done = size * row // rows
            yield Piece("", False, done - reported)
            reported = done
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read parquet file {path}: {str(e).splitlines()[0]}") from None
    if size > reported:
        yield Piece("", False, size - reported)


def _is_string(pa, kind) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)


def iter_pieces(
    path: Path, text_field: str = "text", skip_bad: bool = False, skipped: Skipped | None = None
) -> Iterator[Piece]:
    """The pieces of every document of one input file, in order.

    A bad record (a line that is not JSON, a missing or non-string `text_field`, a null parquet value) raises
    DataError naming the file and line (or row), or with `skip_bad` is left out and counted in `skipped`."""
    path = Path(path)
    fmt = input_format(path)
    if fmt is None:
        raise DataError(f"{path}: unsupported input type; rwkvx reads {SUPPORTED}")
    skipped = (skipped if skipped is not None else Skipped()) if skip_bad else None
    try:
        if fmt.kind == "parquet":
            yield from _parquet_pieces(path, text_field, skipped)
            return
        with open(path, "rb") as f:
            blocks = decompressed(f, fmt.compression, path)
            if fmt.kind == "jsonl":
                yield from _jsonl_pieces(path, blocks, text_field, skipped)
            else:
                yield from _text_pieces(path, blocks)
    except FileNotFoundError:
        raise DataError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise DataError(f"input {path} is a directory; pass its files") from None
    except EOFError:  # defensive: zlib/zstandard report a cut stream above, not here
        raise DataError(f"{path} is truncated") from None
    except OSError as e:
        raise DataError(f"cannot read input {path}: {e.strerror}") from None
