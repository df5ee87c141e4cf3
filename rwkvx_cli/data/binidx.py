"""Token files: Megatron / RWKV-LM "binidx" (MMIDIDX) and headerless raw streams.

binidx is a pair of files sharing a prefix. `prefix.bin` is the raw concatenated token stream. `prefix.idx` is,
little-endian:

    magic b"MMIDIDX\\x00\\x00" | <Q version 1 | <B dtype code | <Q n sequences | <Q m doc-index entries
    int32 sizes[n] | int64 byte pointers[n] into .bin | int64 doc_idx[m]   (m = n_docs + 1, doc_idx = 0..n)

Every reader here exposes `.tokens` (a 1-D array, memory-mapped), `len()` (the number of tokens), `.dtype` and
`check_vocab(vocab_size)`.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from rwkvx_cli.data.errors import DataError
from rwkvx_cli.fsio import fsync_dir, fsync_file, temp_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
RAW_SUFFIXES: dict[str, np.dtype] = {".u16": np.dtype(np.uint16), ".i32": np.dtype(np.int32)}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, n sequences, doc-index entries
_SCAN_CHUNK = 1 << 22  # tokens per step of check_vocab
_WRITE_CHUNK = 1 << 24  # tokens per write of BinIdxWriter.add


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 while every id (< vocab_size) fits, as RWKV-LM stores its 65536-token World vocabulary; else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def binidx_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(`prefix.bin`, `prefix.idx`); `prefix` may itself end in .bin or .idx."""
    p = os.fspath(prefix)
    if p.endswith((".bin", ".idx")):
        p = p[:-4]
    return Path(p + ".bin"), Path(p + ".idx")


def _dtype_code(dtype: np.dtype) -> int:
    for code, dt in DTYPE_CODES.items():
        if dt == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no binidx code (one of {', '.join(str(d) for d in DTYPE_CODES.values())})")


class BinIdxWriter:
    """Writes `prefix.bin` / `prefix.idx` incrementally: `add(tokens, sizes)` appends documents, `commit()` makes
    the pair appear. Both files are written under temporary names, synced and then renamed, so a crash (or `abort()`,
    or an exception inside `with`) never leaves a partial file under a final name. Memory holds only the sizes."""

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(self.dtype)
        self._le = self.dtype.newbyteorder("<")
        self.bin_path, self.idx_path = binidx_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin, self._tmp_idx = temp_path(self.bin_path), temp_path(self.idx_path)
        self._sizes = array.array("q")
        self._f = open(self._tmp_bin, "wb")

    @property
    def n_docs(self) -> int:
        return len(self._sizes)

    def add_document(self, doc: np.ndarray) -> None:
        arr = np.asarray(doc)
        if arr.ndim != 1:
            raise ValueError(f"document {self.n_docs} has shape {arr.shape}; expected a 1-D token array")
        self.add(arr, [arr.size])

    def add(self, tokens: np.ndarray, sizes) -> None:
        """Append documents given as their concatenated `tokens` and their `sizes` (summing to len(tokens))."""
        sizes = np.asarray(sizes, dtype=np.int64)
        if int(sizes.sum()) != len(tokens):
            raise ValueError(f"document sizes sum to {int(sizes.sum())}, but {len(tokens)} tokens were given")
        if sizes.size and int(sizes.max()) > np.iinfo(np.int32).max:
            i = self.n_docs + int(np.argmax(sizes > np.iinfo(np.int32).max))
            raise DataError(f"document {i} has {int(sizes.max())} tokens; binidx sizes are int32")
        # Chunked: `tokens` may be a memory map larger than RAM.
        for start in range(0, len(tokens), _WRITE_CHUNK):
            part = np.asarray(tokens[start : start + _WRITE_CHUNK])
            bad = _check_fits(part, self.dtype)
            if bad is not None:
                i = self.n_docs + int(np.searchsorted(np.cumsum(sizes), start + max(bad, 0), side="right"))
                if bad < 0:
                    raise DataError(f"document {i} holds {part.dtype} values, not integer token ids")
                raise DataError(f"document {i} has token id {part[bad]}, which does not fit {self.dtype}")
            self._f.write(part.astype(self._le, copy=False).tobytes())
        self._sizes.extend(sizes.tolist())

    def commit(self) -> np.ndarray:
        """Sync, write the index and rename both into place; returns the document sizes (int64)."""
        try:
            fsync_file(self._f)
            self._f.close()
            sizes = np.frombuffer(self._sizes, dtype=np.int64)
            n = len(sizes)
            pointers = np.zeros(n, dtype=np.int64)
            np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
            with open(self._tmp_idx, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, self._code, n, n + 1))
                f.write(sizes.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(np.arange(n + 1, dtype="<i8").tobytes())
                fsync_file(f)
            # .bin first: a crash between the renames leaves a pair that fails the reader's size check.
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, self.idx_path)
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.bin_path.parent)
        return sizes.copy()

    def abort(self) -> None:
        self._f.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __enter__(self) -> BinIdxWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_index(path: Path, dtype, n: int, size_chunks: Callable[[], Iterable[np.ndarray]]) -> None:
    """Write (and sync) a binidx index of `n` sequences whose sizes `size_chunks()` yields in chunks; it is called
    twice (sizes, then pointers), so the sizes are never all in memory. The bytes equal BinIdxWriter's."""
    dtype = np.dtype(dtype)
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(dtype), n, n + 1))
        count = 0
        for chunk in size_chunks():
            if chunk.size and int(chunk.max()) > np.iinfo(np.int32).max:
                i = count + int(np.argmax(chunk > np.iinfo(np.int32).max))
                raise DataError(f"document {i} has {int(chunk.max())} tokens; binidx sizes are int32")
            f.write(chunk.astype("<i4").tobytes())
            count += chunk.size
        if count != n:
            raise ValueError(f"{count} sizes for an index of {n} sequences")
        at = 0
        for chunk in size_chunks():
            ends = np.cumsum(chunk, dtype=np.int64) * dtype.itemsize + at
            starts = np.concatenate([[at], ends[:-1]]) if chunk.size else ends
            f.write(starts.astype("<i8").tobytes())
            at = int(ends[-1]) if chunk.size else at
        for a in range(0, n + 1, _WRITE_CHUNK):
            f.write(np.arange(a, min(n + 1, a + _WRITE_CHUNK), dtype="<i8").tobytes())
        fsync_file(f)


@contextlib.contextmanager
def replacing(prefix: str | os.PathLike) -> Iterator[tuple[Path, Path]]:
    """Temporary paths to write PREFIX.bin and PREFIX.idx at, renamed over the pair when the block ends (.bin first:
    a crash between the renames leaves a pair whose sizes the reader refuses), removed when it raises."""
    bin_path, idx_path = binidx_paths(prefix)
    tmp_bin, tmp_idx = temp_path(bin_path), temp_path(idx_path)
    try:
        yield tmp_bin, tmp_idx
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
    fsync_dir(bin_path.parent)


def copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Append `length` bytes of file descriptor `src` from `offset` to `dst`, in the kernel where it can
    (copy_file_range: no copy through this process)."""
    end = offset + length
    fast = hasattr(os, "copy_file_range")
    while offset < end:
        if fast:
            try:
                done = os.copy_file_range(src, dst, end - offset, offset)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                fast = False
                continue
            if done == 0:
                raise DataError(f"token stream ended {end - offset} bytes early (truncated?)")
        else:
            block = os.pread(src, min(end - offset, 1 << 24), offset)
            if not block:
                raise DataError(f"token stream ended {end - offset} bytes early (truncated?)")
            view = memoryview(block)
            while view:
                view = view[os.write(dst, view) :]
            done = len(block)
        offset += done


def write_binidx(prefix: str | os.PathLike, documents: Iterable[np.ndarray], dtype) -> np.ndarray:
    """Write `prefix.bin` and `prefix.idx`, one sequence per document; returns the document sizes (int64).

    Atomic as `BinIdxWriter`. Raises DataError if a token does not fit `dtype` or a document is longer than int32
    allows.
    """
    with BinIdxWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)
        return w.commit()


def _check_fits(arr: np.ndarray, dtype: np.dtype) -> int | None:
    """The position of the first value of `arr` that `dtype` cannot hold, -1 if `arr` is not integers, or None."""
    if arr.size == 0 or np.can_cast(arr.dtype, dtype, casting="safe") or dtype.kind == "f":
        return None
    if arr.dtype.kind not in "iub":
        return -1
    info = np.iinfo(dtype)
    if int(arr.min()) >= info.min and int(arr.max()) <= info.max:
        return None
    return int(np.flatnonzero((arr < info.min) | (arr > info.max))[0])


def _check_vocab(tokens: np.ndarray, vocab_size: int, what: str, offset: int = 0) -> None:
    """`offset`: where `tokens` start in what the message names."""
    if tokens.dtype.kind not in "iu":
        raise DataError(f"{what} holds {tokens.dtype} values, not integer token ids")
    for start in range(0, len(tokens), _SCAN_CHUNK):
        part = np.asarray(tokens[start : start + _SCAN_CHUNK])
        if int(part.max()) < vocab_size and int(part.min()) >= 0:
            continue
        wide = part.astype(np.int64)
        pos = int(np.flatnonzero((wide >= vocab_size) | (wide < 0))[0])
        raise DataError(
            f"{what}: token id {int(wide[pos])} at position {offset + start + pos} is outside the vocabulary "
            f"(size {vocab_size}); was it prepared with another tokenizer?"
        )


def _file_size(path: Path, what: str) -> int:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(f"{what} not found: {path}") from None
    except OSError as e:
        raise DataError(f"cannot read {what} {path}: {e.strerror}") from None
    if not path.is_file():
        raise DataError(f"{what} {path} is not a regular file")
    return st.st_size


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # mmap refuses empty files
        return np.empty(0, dtype=dtype)
    try:
        return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", shape=(count,))
    except OSError as e:
        raise DataError(f"cannot map {path}: {e.strerror}") from None


class BinIdx:
    """A validated, memory-mapped binidx pair. `len()` is the number of tokens."""

    mask: np.ndarray | None = None  # the loss mask (masks.py) of a prepared split that has one: set by its opener

    def __init__(self, prefix: str | os.PathLike):
        self.bin_path, self.idx_path = binidx_paths(prefix)
        idx_size = _file_size(self.idx_path, "binidx index")
        bin_size = _file_size(self.bin_path, "binidx token file")
        name = self.idx_path
        try:
            with open(self.idx_path, "rb") as f:
                head = f.read(_HEADER.size)
                if not head:
                    raise DataError(f"{name} is empty, not a binidx index")
                if head[: len(MAGIC)] != MAGIC[: len(head)]:
                    raise DataError(f"{name} is not a binidx index (bad magic {head[: len(MAGIC)]!r})")
                if len(head) < _HEADER.size:
                    raise DataError(
                        f"{name} is truncated: {idx_size} bytes, shorter than the {_HEADER.size}-byte header"
                    )
                _, version, code, n, m = _HEADER.unpack(head)
                if version != VERSION:
                    raise DataError(f"{name} has unsupported binidx version {version} (supported: {VERSION})")
                if code not in DTYPE_CODES:
                    raise DataError(f"{name} has unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
                expected = _HEADER.size + 12 * n + 8 * m
                if idx_size < expected:
                    raise DataError(
                        f"{name} is truncated: {idx_size} bytes, but its header ({n} sequences, {m} doc-index "
                        f"entries) needs {expected}"
                    )
                if idx_size > expected:
                    raise DataError(
                        f"{name} has {idx_size - expected} unexpected bytes after its {expected}-byte index"
                    )
                sizes = np.fromfile(f, dtype="<i4", count=n).astype(np.int64)
                pointers = np.fromfile(f, dtype="<i8", count=n)
                doc_idx = np.fromfile(f, dtype="<i8", count=m)
        except OSError as e:
            raise DataError(f"cannot read binidx index {name}: {e.strerror}") from None

        self.dtype: np.dtype = DTYPE_CODES[code]
        item = self.dtype.itemsize
        if n and sizes.min() < 0:
            i = int(np.argmax(sizes < 0))
            raise DataError(f"{name}: sequence {i} has negative size {int(sizes[i])}")
        expected_ptr = np.zeros(n, dtype=np.int64)
        np.cumsum(sizes[:-1] * item, out=expected_ptr[1:])
        if not np.array_equal(pointers, expected_ptr):
            i = int(np.argmax(pointers != expected_ptr))
            raise DataError(
                f"{name}: pointer {i} is {int(pointers[i])}, but the sizes before it put sequence {i} at byte "
                f"{int(expected_ptr[i])}"
            )
        if m < 1 or doc_idx[0] != 0 or doc_idx[-1] != n or np.any(np.diff(doc_idx) < 0):
            raise DataError(f"{name}: the document index is not a non-decreasing list from 0 to {n}")
        n_tokens = int(sizes.sum())
        if bin_size % item:
            raise DataError(f"{self.bin_path} has {bin_size} bytes, not a multiple of the {item}-byte {self.dtype}")
        if bin_size < n_tokens * item:
            raise DataError(
                f"{self.bin_path} is truncated: {bin_size // item} tokens, but {name} claims {n_tokens} "
                f"({n_tokens * item} bytes)"
            )
        if bin_size > n_tokens * item:
            raise DataError(
                f"{self.bin_path} has {bin_size // item} tokens, more than the {n_tokens} that {name} indexes "
                "(mismatched .bin/.idx pair?)"
            )
        self.doc_sizes: np.ndarray = sizes
        self.tokens: np.ndarray = _map(self.bin_path, self.dtype, n_tokens)

    @property
    def n_docs(self) -> int:
        return len(self.doc_sizes)

    def __len__(self) -> int:
        return len(self.tokens)

    def check_vocab(self, vocab_size: int) -> None:
        _check_vocab(self.tokens, vocab_size, str(self.bin_path))

    def __repr__(self) -> str:
        return f"BinIdx({str(self.bin_path)[:-4]!r}, {len(self)} tokens, {self.n_docs} docs, {self.dtype})"


class RawTokens:
    """A headerless token stream: `.u16` (uint16) or `.i32` (int32), or any name with an explicit dtype."""

    def __init__(self, path: str | os.PathLike, dtype=None):
        self.path = Path(path)
        if dtype is None:
            if self.path.suffix not in RAW_SUFFIXES:
                raise DataError(f"cannot tell the dtype of raw token file {self.path}: name it .u16 or .i32")
            dtype = RAW_SUFFIXES[self.path.suffix]
        self.dtype: np.dtype = np.dtype(dtype)
        if self.dtype.kind not in "iu":
            raise DataError(f"raw token dtype must be an integer type, not {self.dtype}")
        size = _file_size(self.path, "token file")
        if size % self.dtype.itemsize:
            raise DataError(
                f"{self.path} has {size} bytes, not a multiple of the {self.dtype.itemsize}-byte {self.dtype}"
            )
        self.tokens: np.ndarray = _map(self.path, self.dtype, size // self.dtype.itemsize)
        self.doc_sizes: np.ndarray = np.array([len(self.tokens)], dtype=np.int64)

    @property
    def n_docs(self) -> int:
        return 1

    def __len__(self) -> int:
        return len(self.tokens)

    def check_vocab(self, vocab_size: int) -> None:
        _check_vocab(self.tokens, vocab_size, str(self.path))

    def __repr__(self) -> str:
        return f"RawTokens({str(self.path)!r}, {len(self)} tokens, {self.dtype})"


def open_tokens(path: str | os.PathLike) -> BinIdx | RawTokens:
    """Open a token file by its name: `.u16`/`.i32` raw, `.bin`/`.idx` or a bare prefix binidx."""
    p = Path(path)
    if p.suffix in RAW_SUFFIXES:
        return RawTokens(p)
    if p.suffix in (".bin", ".idx"):
        return BinIdx(p)
    bin_path, idx_path = binidx_paths(p)
    if bin_path.exists() or idx_path.exists():
        return BinIdx(p)
    if not p.exists():
        raise DataError(f"token file not found: {p} (nor {bin_path.name}/{idx_path.name})")
    raise DataError(f"unknown token file type: {p} (expected a binidx prefix, .bin/.idx, .u16 or .i32)")
