"""Named tensors read one at a time, so that converting a checkpoint never holds two copies of it.

A `TensorSource` gives names, shapes and dtypes without reading any data, and each tensor on
request. The readers:

- `SafetensorsFiles`: one or more .safetensors files (an HF shard set, an rwkvx checkpoint's
  model.safetensors), memory-mapped. The header is parsed here and each tensor is a zero-copy
  view of the mapping; `release(name)` drops its pages from this process's memory afterwards.
  safetensors' `safe_open` copies every tensor it returns and keeps the touched pages mapped,
  so a whole state dict through it costs the file's size twice; the tests check this reader
  against `safe_open` tensor by tensor.
- `PthSource`: a .pth/.pt state dict through `torch.load(weights_only=True, mmap=True)` (never
  unpickling code); files from before torch's zip format cannot be mapped and load whole.
- `DictSource`: tensors already in memory.

`MappedSource` renames and reshapes another source lazily (`Rule`s), which is what every format
conversion here is.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from rwkvx_cli.formats.checks import U64_MAX, is_int, show, strict_json
from rwkvx_cli.formats.errors import FormatError

# safetensors' dtype names (the format's spec) and torch's.
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}

Shape = tuple[int, ...]


class TensorSource:
    """Names in order, shape and dtype of each (no data read), and the tensor itself on request.
    A returned tensor may be a read-only view of a mapped file: copy it before writing into it."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> Shape:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def release(self, name: str) -> None:
        """The caller is done with `name`: a mapped reader may drop its pages (the data stays on disk)."""

    def close(self) -> None:
        pass

    def shapes(self) -> dict[str, Shape]:
        return {n: self.shape(n) for n in self.names()}

    def nbytes(self, name: str) -> int:
        n = 1
        for d in self.shape(name):
            n *= d
        return n * torch.empty((), dtype=self.dtype(name)).element_size()

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DictSource(TensorSource):
    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._t = dict(tensors)

    def names(self) -> list[str]:
        return list(self._t)

    def shape(self, name: str) -> Shape:
        return tuple(self._t[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._t[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return self._t[name]

    def __contains__(self, name: str) -> bool:
        return name in self._t


@dataclass(frozen=True)
class _Entry:
    file: int
    dtype: torch.dtype
    shape: Shape
    begin: int  # absolute byte offset in the file
    end: int


# The dtypes safetensors' format knows that rwkvx does not read (8-bit floats, unsigned integers
# wider than a byte, sub-byte floats, complex): refused by name rather than as unknown.
ST_OTHER_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "U16", "U32", "U64", "C64")
MAX_HEADER = 100_000_000  # safetensors' own limit on the header's length


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where the data starts) of a .safetensors file: its length and JSON
    checked (strict_json), its entries not yet (`safetensors_entries`)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path} is not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > min(size - 8, MAX_HEADER):
                raise FormatError(f"{path} is not a safetensors file (header length {n}, file {size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = strict_json(raw, f"{path}'s header")
    except FormatError as e:
        raise FormatError(f"{path} is not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path} is not a safetensors file (its header is {show(header)}, not an object)")
    return header, 8 + n


def safetensors_entries(path: Path, header: dict, start: int, size: int) -> tuple[dict[str, str], dict[str, _Entry]]:
    """(metadata, {name: entry} in file order) of a parsed header, after checking every field as
    safetensors' own reader does and more: each entry an object of a known dtype, a shape of
    integers and two integer data_offsets; the byte ranges in order, contiguous from the data's
    first byte to the file's last, each `shape x itemsize` long. One FormatError per file, naming
    the tensor and the field."""
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        what = show(meta) if not isinstance(meta, dict) else "an object whose values are not all strings"
        raise FormatError(f"{path}: __metadata__ is {what}, not an object of strings")
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {show(name)}"
        if not isinstance(info, dict):
            raise FormatError(f"{where} is {show(info)}, not an object of dtype, shape and data_offsets")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in info:
                raise FormatError(f"{where} has no {field}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in ST_DTYPES:
            known = dtype in ST_OTHER_DTYPES if isinstance(dtype, str) else False
            why = "a safetensors dtype rwkvx does not read" if known else "not a safetensors dtype"
            raise FormatError(f"{where}: dtype {show(dtype)} is {why} (rwkvx reads {', '.join(ST_DTYPES)})")
        if not (isinstance(shape, list) and all(is_int(d) and 0 <= d <= U64_MAX for d in shape)):
            raise FormatError(f"{where}: shape is {_spell(shape)}, not a list of sizes (integers >= 0)")
        two = isinstance(offsets, list) and len(offsets) == 2
        if not (two and all(is_int(x) and 0 <= x <= U64_MAX for x in offsets)):
            raise FormatError(f"{where}: data_offsets is {_spell(offsets)}, not two byte offsets (integers >= 0)")
        n = 1
        for d in shape:  # safetensors' rule: the running product, in order, fits 64 bits
            n *= d
            if n > U64_MAX:
                raise FormatError(f"{where}: shape {_spell(shape)} overflows 64-bit sizes")
        if n == 0 and not _makes_empty(shape):  # torch's sizes are int64: [0, 2**63] is no tensor
            raise FormatError(f"{where}: shape {_spell(shape)} overflows 64-bit sizes (torch's)")
        nbytes = n * _itemsize(ST_DTYPES[dtype])
        begin, end = offsets
        if end - begin != nbytes:
            raise FormatError(
                f"{where}: data_offsets {offsets} hold {end - begin} bytes, but {dtype} {_spell(shape)} is "
                f"{nbytes} bytes"
            )
        entries[name] = _Entry(0, ST_DTYPES[dtype], tuple(shape), start + begin, start + end)
    at = start  # the byte ranges, in order, must tile the data exactly (as safetensors checks)
    ordered = dict(sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)))
    for name, e in ordered.items():
        if e.begin != at:
            how = "overlaps the tensor before it" if e.begin < at else f"leaves a gap of {e.begin - at} bytes before it"
            raise FormatError(
                f"{path}: tensor {show(name)}: data_offsets [{e.begin - start}, {e.end - start}] {how} "
                "(the byte ranges must be contiguous and not overlap)"
            )
        at = e.end
    if at != size:
        what = "is shorter than" if at > size else f"has {size - at} bytes after"
        raise FormatError(f"{path} {what} its tensors' data (truncated, or not a safetensors file)")
    return dict(meta or {}), ordered


def _makes_empty(shape: list[int]) -> bool:
    """Whether torch makes a zero-size tensor of `shape` as safetensors' reader does (an empty tensor
    reshaped): its sizes are int64, and some shapes overflow its strides."""
    try:
        torch.empty(0, device="meta").reshape(shape)
    except (RuntimeError, TypeError, OverflowError, ValueError):
        return False
    return True


def _spell(value: object) -> str:
    """A short list of integers as it is, anything else by `show`."""
    if isinstance(value, list) and len(value) <= 8 and all(is_int(x) and abs(x) < 10**30 for x in value):
        return str(value)
    return show(value)


class SafetensorsFiles(TensorSource):
    def __init__(self, paths: Iterable[Path]):
        self.paths = [Path(p) for p in paths]
        self._maps: list[mmap.mmap | None] = []
        self._files = []
        self._entries: dict[str, _Entry] = {}
        self.metadata: dict[str, str] = {}
        for i, path in enumerate(self.paths):
            header, start = read_safetensors_header(path)
            try:
                size = path.stat().st_size
            except OSError as e:
                raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
            metadata, entries = safetensors_entries(path, header, start, size)
            self.metadata.update(metadata)
            for name, entry in entries.items():
                if name in self._entries:
                    raise FormatError(
                        f"tensor {show(name)} is in both {self.paths[self._entries[name].file]} and {path}"
                    )
                self._entries[name] = dataclasses.replace(entry, file=i)
            self._maps.append(None)
            self._files.append(None)

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> Shape:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _map(self, i: int) -> mmap.mmap:
        if self._maps[i] is None:
            f = open(self.paths[i], "rb")
            self._files[i] = f
            # A private mapping is writable (torch.frombuffer wants that) and never writes back.
            self._maps[i] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[i]

    def get(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        n = _numel(e.shape)
        if n == 0:  # as safetensors makes it (the header check tried the same on the meta device)
            return torch.empty(0, dtype=e.dtype).reshape(e.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(self._map(e.file), dtype=e.dtype, count=n, offset=e.begin)
        return flat.view(e.shape)

    def release(self, name: str) -> None:
        e = self._entries[name]
        mm = self._maps[e.file]
        if mm is None or not hasattr(mm, "madvise") or e.end == e.begin:
            return
        page = mmap.PAGESIZE
        begin = e.begin - e.begin % page
        try:
            mm.madvise(mmap.MADV_DONTNEED, begin, e.end - begin)
        except (OSError, ValueError):  # not every platform drops pages on request; only memory is at stake
            pass

    def close(self) -> None:
        for i, mm in enumerate(self._maps):
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a tensor still points into it; the mapping goes with the tensor
                    pass
                self._files[i].close()
        self._maps = [None] * len(self._maps)


class PthSource(DictSource):
    """A flat {name: tensor} .pth state dict, mapped where torch can map it."""

    def __init__(self, path: Path):
        path = Path(path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as e:
                    if "mmap" not in str(e):
                        raise
                    sd = torch.load(path, map_location="cpu", weights_only=True)  # pre-zip format: loads whole
        except Exception as e:  # noqa: BLE001 - a foreign file fails in many ways (zip, pickle, EOF); all mean unreadable
            raise FormatError(f"{path} is not a weights-only state dict: {load_failure(e)}") from None
        if not isinstance(sd, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()
        ):
            raise FormatError(f"{path} does not hold a flat state dict of named tensors")
        for k, v in sd.items():  # weights_only also unpickles sparse and quantized tensors: not weights here
            if v.layout != torch.strided or v.is_quantized or v.device.type != "cpu":
                raise FormatError(f"{path}: tensor {show(k)} is not a plain dense tensor ({v.layout}, {v.dtype})")
        super().__init__(sd)
        self.path = path


def load_failure(e: Exception) -> str:
    """Why torch.load(weights_only=True) refused a file, without torch's advice to retry with
    weights_only=False: that runs the file's code, which rwkvx never does for a file from elsewhere."""
    text = str(e)
    if "Weights only load failed" in text or "weights_only" in text:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        what = f" (it would call {found.group(1)})" if found else ""
        return f"it holds Python objects besides tensors{what}; rwkvx never unpickles code"
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# -- lazy renaming -------------------------------------------------------------------------------

# How a tensor's layout changes between two formats. Each op has its inverse in INVERSE.
OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "same": lambda t: t,
    "t": lambda t: t.t(),  # a Linear's [out, in] against a plain matrix's [in, out]
    "flat": lambda t: t.reshape(-1),  # [1, 1, C] -> [C]
    "unflat": lambda t: t.reshape(1, 1, -1),  # [C] -> [1, 1, C]
}
INVERSE = {"same": "same", "t": "t", "flat": "unflat", "unflat": "flat"}


def op_shape(op: str, shape: Shape) -> Shape:
    if op == "t":
        if len(shape) != 2:
            raise FormatError(f"cannot transpose a tensor of shape {list(shape)}")
        return (shape[1], shape[0])
    if op == "flat":
        return (_numel(shape),)
    if op == "unflat":
        return (1, 1, _numel(shape))
    return tuple(shape)


@dataclass(frozen=True)
class Rule:
    """Output tensor `dst` is `op(src)`; with `src` None it is zeros of `shape` (a tensor the other
    format lacks and the target needs)."""

    dst: str
    src: str | None
    op: str = "same"
    shape: Shape | None = None


class MappedSource(TensorSource):
    """`rules` applied lazily to `base`; `dtype` (optional) casts every floating tensor."""

    def __init__(self, base: TensorSource, rules: list[Rule], dtype: torch.dtype | None = None):
        self.base, self.rules, self.cast = base, {r.dst: r for r in rules}, dtype
        if len(self.rules) != len(rules):
            raise FormatError("two rules write the same tensor")

    def names(self) -> list[str]:
        return list(self.rules)

    def __contains__(self, name: str) -> bool:
        return name in self.rules

    def shape(self, name: str) -> Shape:
        r = self.rules[name]
        return tuple(r.shape) if r.src is None else op_shape(r.op, self.base.shape(r.src))

    def dtype(self, name: str) -> torch.dtype:
        r = self.rules[name]
        dt = torch.float32 if r.src is None else self.base.dtype(r.src)
        return self.cast if self.cast is not None and dt.is_floating_point else dt

    def get(self, name: str) -> torch.Tensor:
        r = self.rules[name]
        if r.src is None:
            return torch.zeros(r.shape, dtype=self.dtype(name))
        t = OPS[r.op](self.base.get(r.src))
        return t.to(self.cast) if self.cast is not None and t.is_floating_point() else t

    def release(self, name: str) -> None:
        r = self.rules[name]
        if r.src is not None:
            self.base.release(r.src)

    def close(self) -> None:
        self.base.close()


def materialize(source: TensorSource) -> dict[str, torch.Tensor]:
    """Every tensor of `source` as an independent, contiguous tensor (copied out of any mapping)."""
    out = {}
    for name in source.names():
        out[name] = source.get(name).contiguous().clone()
        source.release(name)
    return out


def as_source(weights: TensorSource | Mapping[str, torch.Tensor]) -> TensorSource:
    return weights if isinstance(weights, TensorSource) else DictSource(weights)


HF_INDEX = "model.safetensors.index.json"


def from_store(path: Path) -> bool:
    """Whether the directory `path` is read through the checkpoint store (an rwkvx checkpoint, run
    directory or checkpoints folder: runs/weights.py's open_source), not by open_tensors: not an HF
    shard set, not a bare model.safetensors."""
    bare = (path / "model.safetensors").is_file() and not (path / "meta.json").is_file()
    return not (path / HF_INDEX).is_file() and not bare


def open_tensors(path: str | os.PathLike) -> TensorSource:
    """The tensors at `path`, lazily: an HF directory (sharded or not) or one holding a bare
    model.safetensors, a .safetensors file, or a .pth/.pt state dict (an rwkvx checkpoint: `from_store`)."""
    path = Path(path)
    if path.is_dir():
        if (path / HF_INDEX).is_file():
            return open_shards(path)
        if not from_store(path):
            return SafetensorsFiles([path / "model.safetensors"])
        raise FormatError(f"{path} is a directory without model.safetensors or {HF_INDEX}")
    if not path.is_file():
        raise FormatError(f"weights not found: {path}")
    if path.suffix == ".safetensors":
        return SafetensorsFiles([path])
    if path.suffix in (".pth", ".pt"):
        return PthSource(path)
    raise FormatError(f"{path}: expected a .safetensors or .pth file, or a directory")


def open_shards(path: Path) -> SafetensorsFiles:
    """The shards of an HF directory's index, opened and checked against it."""
    weight_map = hf_index(path)
    source = SafetensorsFiles(sorted({path / f for f in weight_map.values()}))
    check_index(weight_map, source, path / HF_INDEX)
    return source


def hf_shards(path: Path) -> list[Path]:
    """The shard files an HF `model.safetensors.index.json` names, each checked to exist."""
    return sorted({path / f for f in hf_index(path).values()})


def hf_index(path: Path) -> dict[str, str]:
    """The weight map of an HF directory's `model.safetensors.index.json` ({tensor: shard file}),
    checked: strict JSON, a non-empty object of strings, each shard a plain file name in `path`.
    Which tensors there are is the shards' to say (as transformers, which loads every tensor of
    every shard the map names); `check_index` holds each entry to its shard."""
    index = path / HF_INDEX
    try:
        raw = index.read_bytes()
    except OSError as e:
        raise FormatError(f"cannot read {index}: {e.strerror or e}") from None
    try:
        doc = strict_json(raw, str(index))
    except FormatError as e:
        raise FormatError(f"{index} is not a safetensors index: {e}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        what = show(weight_map) if isinstance(doc, dict) and "weight_map" in doc else "missing"
        raise FormatError(f"{index} is not a safetensors index: its weight_map is {what}, not an object")
    if not weight_map:
        raise FormatError(f"{index}: weight_map is empty (it names no tensor and no shard)")
    for name, f in weight_map.items():
        if not isinstance(f, str):
            raise FormatError(f"{index}: weight_map[{show(name)}] is {show(f)}, not a shard file name")
        if f in ("", ".", "..") or Path(f).name != f or "\\" in f or not (path / f).is_file():
            raise FormatError(f"{index}: weight_map[{show(name)}] names a shard {show(f)} that is not a file in {path}")
    return weight_map


def check_index(weight_map: Mapping[str, str], source: SafetensorsFiles, index: Path) -> None:
    """Every tensor the index names is in the shard it names (a tensor it leaves out is read from
    its shard all the same)."""
    for name, f in weight_map.items():
        if name not in source or source.paths[source._entries[name].file].name != f:
            raise FormatError(f"{index}: weight_map[{show(name)}] says {show(f)}, but that shard has no such tensor")
