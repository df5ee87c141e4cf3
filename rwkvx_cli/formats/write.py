"""Writing a converted model: safetensors shards streamed tensor by tensor, and output directories
that appear whole or not at all.

The shard writer writes the safetensors format directly (8-byte little-endian header length, a JSON
header of dtype, shape and byte range per tensor, then the raw bytes in that order): its header
needs only shapes and dtypes, so each tensor is read, converted, written and released before the
next, and a conversion never holds the model twice. Files are checked in the tests by
safetensors' own reader and by transformers' loader.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from rwkvx_cli.formats.errors import FormatError, OutputExistsError
from rwkvx_cli.formats.tensors import HF_INDEX, ST_NAMES, TensorSource
from rwkvx_cli.fsio import check_output, check_place, create_new, create_temp, fsync_dir, fsync_file, fsync_path

# transformers' default max_shard_size ("5GB", decimal).
DEFAULT_SHARD_BYTES = 5 * 10**9


def plan_shards(source: TensorSource, max_shard_bytes: int) -> list[list[str]]:
    """Tensors in source order, cut into shards of at most `max_shard_bytes` (a tensor larger than
    that gets a shard of its own, as transformers does)."""
    if max_shard_bytes <= 0:
        raise FormatError(f"the shard size must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    used = 0
    for name in source.names():
        n = source.nbytes(name)
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def _header(source: TensorSource, names: list[str], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        dtype = source.dtype(name)
        if dtype not in ST_NAMES:
            raise FormatError(f"{name}: dtype {dtype} has no safetensors name")
        n = source.nbytes(name)
        entries[name] = {
            "dtype": ST_NAMES[dtype],
            "shape": list(source.shape(name)),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned (the format's recommendation)


def write_safetensors(
    source: TensorSource, path: Path, names: list[str], metadata: dict[str, str], digest=None, dir_fd=None
) -> int:
    """Write `names` of `source` to one new .safetensors file (fsio.create_new: a link planted at `path`
    is replaced, never followed; with `dir_fd`, made in that open directory, `path`'s parent) and fsync
    it; returns the data bytes written. `digest`: a hashlib object fed every byte of the file as it is
    written (a checkpoint's SHA-256 without reading the file back)."""
    header = _header(source, names, metadata)
    total = 0

    def put(data) -> None:
        f.write(data)
        if digest is not None:
            digest.update(data)

    with create_new(path, dir_fd) as f:
        put(len(header).to_bytes(8, "little"))
        put(header)
        for name in names:
            t = source.get(name)
            want = source.nbytes(name)
            if tuple(t.shape) != tuple(source.shape(name)) or t.dtype != source.dtype(name):
                raise FormatError(f"{name}: the source gave {t.dtype} {list(t.shape)}, not what it announced")
            if want:  # copied to the CPU (a checkpoint's tensors may be on the GPU) one tensor at a time
                put(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            total += want
            del t
            source.release(name)
        fsync_file(f)
    return total


def write_shards(
    source: TensorSource, out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES, metadata: dict | None = None
) -> dict:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` shards and `model.safetensors.index.json`
    when the tensors exceed `max_shard_bytes`. Returns {"files": [...], "total_size": bytes}."""
    meta = {"format": "pt", **(metadata or {})}
    shards = plan_shards(source, max_shard_bytes)
    if len(shards) == 1:
        total = write_safetensors(source, out_dir / "model.safetensors", shards[0], meta)
        return {"files": ["model.safetensors"], "total_size": total}
    files, weight_map, total = [], {}, 0
    for i, names in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(source, out_dir / fname, names, meta)
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json(out_dir / HF_INDEX, index)
    return {"files": [*files, HF_INDEX], "total_size": total}


def write_json(path: Path, obj: dict) -> None:
    with create_new(path) as f:
        f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        fsync_file(f)


def check_out_dir(out: Path, force: bool, marker: str = "config.json") -> None:
    """An output directory is new or empty; with `force`, also one that holds `marker` (a model
    directory an export wrote). Never a file, nor a directory of something else."""
    if str(out).strip() == "":
        raise OutputExistsError("the output path is empty")
    check_place(out, "--out")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OutputExistsError(f"--out {out} is not empty; pass --force to replace it")
        if not (out / marker).is_file():
            raise OutputExistsError(f"--out {out} holds files but no {marker}; rwkvx replaces only a model directory")


@contextlib.contextmanager
def atomic_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success it is renamed to `out` (replacing
    an old one only with `force`, see check_out_dir), on any failure it is removed. The sibling is
    made new under an unpredictable name (mkdtemp: nothing planted there beforehand is followed,
    emptied or written into)."""
    out = Path(os.path.abspath(out))
    check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=out.parent))
    try:
        yield tmp
        fsync_dir(tmp)
        old = None
        if out.exists():
            if any(out.iterdir()):
                old = out.with_name(f".{out.name}.old{os.getpid()}")
                os.replace(out, old)
            else:
                out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_file(out: Path, force: bool = False):
    """(temporary file, commit) for a single output file (checked as every output: fsio.check_output):
    write into the file object, then call commit(), which renames it into place."""
    out = check_output(Path(os.path.abspath(out)), force, "--out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, f = create_temp(out)  # made with O_EXCL: a link planted at the temporary name is not followed

    def commit():
        f.close()
        fsync_path(tmp)
        os.replace(tmp, out)
        fsync_dir(out.parent)

    return tmp, f, commit
