"""Reading a text corpus as documents cut into tokenizer-safe pieces.

`.jsonl` files hold one document per line (`{"text": ...}`); any other file is one UTF-8 document. Long text is cut
into pieces of about PIECE_CHARS characters, only right after a newline followed by a non-space character: no
byte-level BPE pre-token crosses such a point, so encoding the pieces one by one (in parallel) gives the same ids as
encoding the whole text. Those cuts are also the line boundaries where `prepare` may split a single document.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rwkvx_cli.data.errors import DataError

PIECE_CHARS = 8192
_BLOCK_BYTES = 1 << 22
_MAX_CARRY = 1 << 24  # text without any safe cut is emitted anyway past this many characters
_SAFE_CUT = re.compile(r"\n(?=\S)")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class Piece:
    text: str  # may be "" (a blank line, or the end of an empty document)
    doc_end: bool  # the last piece of its document
    nbytes: int  # input bytes consumed since the previous piece (for progress)


def _last_cut(text: str, lo: int, hi: int) -> int | None:
    i = text.rfind("\n", lo, hi)
    while i >= lo:
        if i + 1 < len(text) and _SAFE_CUT.match(text, i):
            return i + 1
        i = text.rfind("\n", lo, i)
    return None


def split_pieces(text: str, size: int | None = None) -> list[str]:
    """Cut `text` at safe points into pieces of about `size` characters (longer where no safe point exists)."""
    size = size or PIECE_CHARS
    pieces, start = [], 0
    while len(text) - start > size:
        cut = _last_cut(text, start + 1, start + size)
        if cut is None:
            m = _SAFE_CUT.search(text, start + size)
            if m is None:
                break
            cut = m.end()
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _text_pieces(path: Path) -> Iterator[Piece]:
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    carry, offset = "", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK_BYTES)
            final = not block
            try:
                carry += decoder.decode(block, final=final)
            except UnicodeDecodeError as e:
                raise DataError(f"{path} is not UTF-8 text (invalid byte near offset {offset + e.start})") from None
            offset += len(block)
            pieces = split_pieces(carry)
            # Keep the uncut tail: the next block may continue its line.
            carry = "" if final or len(pieces[-1]) > _MAX_CARRY else pieces.pop()
            nbytes = len(block)
            for i, p in enumerate(pieces):
                if p or (final and i == len(pieces) - 1):
                    yield Piece(p, final and i == len(pieces) - 1, nbytes)
                    nbytes = 0
            if nbytes:
                yield Piece("", False, nbytes)
            if final:
                return


def _jsonl_pieces(path: Path) -> Iterator[Piece]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                yield Piece("", False, len(line))
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise DataError(f'{path}:{lineno}: expected a JSON object with a string "text" field')
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(
                    f'{path}:{lineno}: "text" contains an unpaired surrogate \\u{ord(text[e.start]):04x}'
                ) from None
            pieces = split_pieces(text)
            for i, p in enumerate(pieces):
                yield Piece(p, i == len(pieces) - 1, len(line) if i == 0 else 0)


def iter_pieces(path: Path) -> Iterator[Piece]:
    """The pieces of every document of one input file, in order."""
    try:
        if path.suffix.lower() in JSONL_SUFFIXES:
            yield from _jsonl_pieces(path)
        else:
            yield from _text_pieces(path)
    except FileNotFoundError:
        raise DataError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise DataError(f"input {path} is a directory; pass its files") from None
    except OSError as e:
        raise DataError(f"cannot read input {path}: {e.strerror}") from None
