"""The RWKV World tokenizer: vocab `rwkv_vocab_v20230424` (65536 ids), greedy longest match over a byte trie.

Encoding is byte-identical to the reference `TRIE_TOKENIZER` of the `rwkv` package (tests/data/test_world.py checks
it on mixed text). Three engines give the same ids; the default is the first that works here:

- `native`: greedy longest match in C++ (`csrc/world.cpp`, compiled on first use and cached like the CPU kernels,
  `rwkvx_cli/native.py`). It writes the ids of a whole batch of texts into one uint16 buffer: no Python int per
  token, which is what `prepare` writes (docs/data.md has its speed against the others);
- `rust`: the `pyrwkv-tokenizer` package (Rust, multithreaded `encode_batch`), when there is no C++ compiler;
- `python`: a dict trie here. It cuts the text at boundaries that no vocab token crosses (see `_SEGMENT`) and caches
  the ids of each repeated segment (mostly words with their leading space), which makes it several times faster
  than walking the trie over every byte.

The vocab file ships with rwkvx (`rwkv_vocab_v20230424.txt`, copied unchanged from the Apache-2.0 `rwkv` package
by BlinkDL, with LF line ends), so nothing is downloaded. Id 0 is the end of a document and has no bytes; ids
65530..65535 are unassigned (the model's embedding is padded to 65536) and decode to nothing.

Decoding differs from `TRIE_TOKENIZER.decode` only where that one gives up: on bytes that are not valid UTF-8 it
returns the single string "\\ufffd" for the whole input (and raises KeyError for ids 0 and 65530..65535), while
here each invalid sequence becomes "\\ufffd" (Python's errors="replace") and the rest of the text is kept, the
contract every rwkvx tokenizer follows. For valid UTF-8 both return the same string.
"""

from __future__ import annotations

import ast
import codecs
import functools
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from rwkvx_cli.data.errors import DataError
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import atomic_write_text

VOCAB_NAME = "rwkv_vocab_v20230424"
VOCAB_FILE = Path(__file__).with_name(VOCAB_NAME + ".txt")
VOCAB_SIZE = 65536
EOD_ID = 0
ENGINES = ("native", "rust", "python")
SOURCE = Path(__file__).with_name("csrc") / "world.cpp"

# A boundary between a non-whitespace character and an ASCII whitespace character is crossed by no vocab token,
# except `…\n`, `。\n` and `，\n` (tests/data/test_world.py checks this against the vocab). Greedy longest match
# therefore restarts at every other such boundary, and text cut there encodes piece by piece exactly as a whole.
_WS = " \t\n\r\x0b\x0c"
_GLUE = "…。，"
_SEGMENT = re.compile(f"[{_WS}]*(?:[^{_WS}{_GLUE}]|[{_GLUE}](?!\n)|[{_GLUE}]\n[{_WS}]*)*")
_CACHE_SEGMENT_CHARS = 64  # longer segments are rare; caching them only costs memory
_CACHE_ENTRIES = 1 << 20


@functools.lru_cache(maxsize=2)
def read_vocab(path: str | os.PathLike = VOCAB_FILE) -> list[bytes]:
    """The token bytes by id (index 0, the end of a document, is b"") from a `rwkv_vocab_*.txt` file.

    Each line is `id <Python str or bytes literal> <byte length>`. Plain literals are decoded directly and the few
    with escapes by `ast.literal_eval` (never `eval`: the file is data). Cached: treat the list as read-only.
    """
    table: list[bytes] = [b""]
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read the World vocab {path}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            try:
                i, j = line.index(" "), line.rindex(" ")
                idx, lit, size = int(line[:i]), line[i + 1 : j], int(line[j + 1 :])
                if lit.startswith("b"):
                    tok = codecs.escape_decode(lit[2:-1].encode("ascii"))[0]
                elif "\\" not in lit:
                    tok = lit[1:-1].encode("utf-8")
                else:
                    tok = ast.literal_eval(lit).encode("utf-8")
            except (ValueError, SyntaxError, UnicodeError):
                raise DataError(f"{path}:{lineno}: not a World vocab line") from None
            if idx != len(table) or len(tok) != size:
                raise DataError(f"{path}:{lineno}: expected id {len(table)} of {size} bytes")
            table.append(tok)
    return table


class _PythonEngine:
    """Greedy longest match over a dict trie, with a cache of segment -> ids."""

    def __init__(self, table: list[bytes]):
        # A node is {byte: [id or 0, child node]}; id 0 never names a vocab token.
        root: dict = {}
        for tid, tok in enumerate(table):
            node = root
            for k, b in enumerate(tok):
                entry = node.get(b)
                if entry is None:
                    entry = node[b] = [0, {}]
                if k == len(tok) - 1:
                    entry[0] = tid
                node = entry[1]
        self._root = root
        self._cache: dict[str, list[int]] = {}

    def _walk(self, src: bytes) -> list[int]:
        root, out, i, n = self._root, [], 0, len(src)
        while i < n:
            node, j, best, end = root, i, 0, i + 1
            while j < n:
                entry = node.get(src[j])
                if entry is None:
                    break
                j += 1
                if entry[0]:
                    best, end = entry[0], j
                node = entry[1]
            out.append(best)  # every single byte is a token, so best is set
            i = end
        return out

    def encode(self, text: str) -> list[int]:
        cache, out = self._cache, []
        if len(cache) > _CACHE_ENTRIES:
            cache.clear()
        for seg in _SEGMENT.findall(text):
            ids = cache.get(seg)
            if ids is None:
                ids = self._walk(seg.encode("utf-8"))
                if len(seg) <= _CACHE_SEGMENT_CHARS:
                    cache[seg] = ids
            out += ids
        return out

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class _NativeEngine:
    """The C++ encoder (csrc/world.cpp) over this vocabulary; NativeBuildError when it cannot be built here."""

    def __init__(self, table: list[bytes]):
        import ctypes

        from rwkvx_cli import native

        if sys.byteorder != "little":  # the ids are written as native uint16, read back as little-endian
            raise native.NativeBuildError("the native World encoder writes little-endian ids")
        lib = native.load_library(SOURCE, precision=None)
        lib.rwkvx_world_new.restype = ctypes.c_void_p
        lib.rwkvx_world_new.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64]
        lib.rwkvx_world_free.argtypes = [ctypes.c_void_p]
        lib.rwkvx_world_encode.restype = ctypes.c_int64
        ptr, size = ctypes.c_void_p, ctypes.c_int64
        # trie, text, offsets, number of texts, out, counts
        lib.rwkvx_world_encode.argtypes = [ptr, ctypes.c_char_p, ptr, size, ptr, ptr]
        offsets = np.cumsum([0, *map(len, table)], dtype=np.int64)
        handle = lib.rwkvx_world_new(b"".join(table), offsets.ctypes.data, len(table))
        if not handle:
            raise DataError("the World vocab cannot be encoded by greedy longest match (a byte without a token?)")
        self._lib, self._handle = lib, ctypes.c_void_p(handle)

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.rwkvx_world_free(self._handle)
            self._handle = None

    def encode_packed(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of all `texts`, one after another (uint16), and the id count of each text."""
        data = [t.encode("utf-8") for t in texts]
        offsets = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in data], out=offsets[1:])
        out = np.empty(int(offsets[-1]), dtype=np.uint16)  # a token is at least one byte
        counts = np.empty(len(data), dtype=np.int64)
        n = self._lib.rwkvx_world_encode(
            self._handle, b"".join(data), offsets.ctypes.data, len(data), out.ctypes.data, counts.ctypes.data
        )
        return out[:n], counts

    def encode(self, text: str) -> list[int]:
        return self.encode_packed([text])[0].tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        ids, counts = self.encode_packed(texts)
        return [a.tolist() for a in np.split(ids, np.cumsum(counts)[:-1])] if len(texts) else []


class _RustEngine:
    def __init__(self, vocab_path: Path):
        import pyrwkv_tokenizer

        self._tok = pyrwkv_tokenizer.WorldTokenizer(str(vocab_path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One call tokenizes the texts on all cores (Rust threads).
        return self._tok.encode_batch(list(texts))


def rust_available() -> bool:
    try:
        import pyrwkv_tokenizer  # noqa: F401
    except ImportError:
        return False
    return True


class WorldTokenizer:
    """The RWKV World tokenizer (id 0 = end of document). `engine`: "native", "rust", "python" or None (the first of
    those that works here, decided on the first encode). `table`: the token bytes by id (`.table` of another
    instance), so that the vocab file is not read again (a tokenizer worker gets its parent's)."""

    kind = "world"
    vocab_size = VOCAB_SIZE
    eod_id = EOD_ID
    vocab_name = VOCAB_NAME

    def __init__(self, engine: str | None = None, table: Sequence[bytes] | None = None):
        if engine is not None and engine not in ENGINES:
            raise UsageError(f"unknown World tokenizer engine {engine!r} (rust or python)")
        if engine == "rust" and not rust_available():
            raise UsageError("the rust World tokenizer needs pyrwkv-tokenizer: pip install pyrwkv-tokenizer")
        self.engine = engine
        if table is not None and len(table) != VOCAB_SIZE:
            raise DataError(f"a World table has {VOCAB_SIZE} entries, not {len(table)}")
        self._table: list[bytes] | None = None if table is None else list(table)
        self._impl: _RustEngine | _PythonEngine | None = None  # built on first encode: decoding needs only the table

    @property
    def table(self) -> list[bytes]:
        """Token bytes by id, all 65536 (unassigned ids decode to nothing)."""
        if self._table is None:
            table = read_vocab(VOCAB_FILE)
            self._table = table + [b""] * (VOCAB_SIZE - len(table))
        return self._table

    @property
    def _engine(self) -> _NativeEngine | _RustEngine | _PythonEngine:
        if self._impl is None:
            if self.engine is None:  # the first that works: native needs a C++ compiler, rust its package
                from rwkvx_cli.native import NativeBuildError

                try:
                    self._impl, self.engine = _NativeEngine(self.table), "native"
                except NativeBuildError:
                    self.engine = "rust" if rust_available() else "python"
            if self.engine == "rust":
                self._impl = _RustEngine(VOCAB_FILE)
            elif self.engine == "python":
                self._impl = _PythonEngine(self.table)
            elif self._impl is None:  # asked for by name
                self._impl = _NativeEngine(self.table)
        return self._impl

    def encode(self, text: str) -> list[int]:
        return self._engine.encode(text)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        engine = self._engine
        if isinstance(engine, _NativeEngine):
            ids, counts = engine.encode_packed(texts)
            return np.split(ids.astype(np.int64), np.cumsum(counts)[:-1]) if len(texts) else []
        return [np.asarray(ids, dtype=np.int64) for ids in engine.encode_batch(texts)]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        arr = ids if isinstance(ids, np.ndarray) else np.asarray(list(ids), dtype=np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= VOCAB_SIZE):
            bad = int(arr[(arr < 0) | (arr >= VOCAB_SIZE)][0])
            raise DataError(f"token id {bad} is outside the World vocabulary (0..{VOCAB_SIZE - 1})")
        table = self.table
        return b"".join([table[i] for i in arr.tolist()])

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps(
            {"type": "world", "vocab": VOCAB_NAME, "vocab_size": VOCAB_SIZE, "eod_token": "", "eod_id": EOD_ID}
        )

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def from_json(cls, obj: dict, where: str) -> WorldTokenizer:
        if obj.get("type") != "world":
            raise DataError(f"{where} is not a World tokenizer file")
        if obj.get("vocab", VOCAB_NAME) != VOCAB_NAME:
            raise DataError(f"{where}: World vocab {obj.get('vocab')!r} is not supported (only {VOCAB_NAME})")
        return cls()

    def __repr__(self) -> str:
        return f"WorldTokenizer({VOCAB_NAME}, engine={self.engine!r})"
