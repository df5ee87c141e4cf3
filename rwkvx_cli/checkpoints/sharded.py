"""Sharded checkpoints: every rank writes its own rows of the weights and optimizer state, in
parallel, and any number of ranks (or one plain process) reads them back; never pickle.

Layout of `<run>/checkpoints/step_00000100/` written by N ranks:

    shard-00000-of-0000N.safetensors   rank 0's rows of every tensor (safetensors, written by rank 0)
    ...
    shard-0000{N-1}-of-0000N.safetensors
    index.json                         each tensor's global dtype and shape, and which rows of it
                                       each file holds; the optimizer's groups (by parameter name)
    extra.safetensors                  the TBPTT carry, whole (rank 0), as in a full checkpoint
    meta.json                          as a full checkpoint's (store.py), with
                                       "checkpoint_format": "sharded" and every file's SHA-256

Tensors are named `model/<name>` (the model's state_dict) and `optim/<parameter>/<key>` (AdamW's
exp_avg, exp_avg_sq, step). Each is cut along its first dimension into contiguous row ranges,
torch.chunk's layout (rank r holds rows [r * ceil(n / N), ...), possibly none): exactly the
rows an FSDP2 parameter (or its optimizer moment) sharded Shard(0) holds on rank r, so a rank
writes its local tensor as it is, without gathering anything. A tensor every rank holds whole
(a plain or DDP model, FSDP's buffers) is cut the same way, so those writes are parallel too; a
0-dimensional one (AdamW's step) is written by rank 0.

A save is crash-safe as a full checkpoint is: every rank writes into `.tmp-step_N/`, fsyncs its
file and hashes it; when every rank has reported success, rank 0 writes index.json and meta.json
(last) and renames the directory to `step_N` (one rename), so a rank failing or killed at any
moment leaves no directory that looks complete. A rank's error stops every rank with the same
one-line CheckpointError and the partial directory is removed.

Loading checks meta.json (its own checksum), index.json against meta.json's SHA-256 and against
its own rules (the row ranges of every tensor tile it exactly, the files are the N shards), each
shard file's SHA-256 (the files split over the reading ranks) and header (strictly parsed by
formats/tensors.py; its tensors exactly the index's rows for that file), then reads for
each local tensor only the rows it needs, from memory-mapped files (`ShardedSource.rows`): an
FSDP2 rank reads and holds only its own share, whatever N and M are (a plain or DDP model, every
row). Every failure is one line, on every rank, before anything is loaded.

torch's own sharded formats are not used: DCP's default FileSystemWriter pickles its `.metadata`
(and torch.save's every non-tensor value), which its reader unpickles; DCP's
HuggingFaceStorageWriter writes safetensors, but corrupts the file when the state holds a
non-tensor, writes no index in distributed mode, and its reader takes every `*.safetensors` in
the directory and leaves the rows of a missing shard unloaded without a word.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rwkvx_cli.checkpoints import store
from rwkvx_cli.checkpoints.fit import mismatch
from rwkvx_cli.checkpoints.ranks import one_line, rank_world, together
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.formats.checks import is_int, is_number, show, strict_json
from rwkvx_cli.formats.tensors import ST_DTYPES, ST_NAMES, SafetensorsFiles, TensorSource
from rwkvx_cli.formats.write import write_safetensors
from rwkvx_cli.fsio import atomic_write_text, create_new, fsync_dir, fsync_file, remove_entry
from rwkvx_cli.models.optimizer import implementation, restore_implementation

FORMAT = "sharded"  # meta.json's "checkpoint_format"
INDEX = "index.json"
INDEX_FORMAT = "rwkvx-sharded"
INDEX_VERSION = 1
EXTRA = "extra.safetensors"
SHARD_RE = re.compile(r"shard-(\d{5})-of-(\d{5})\.safetensors")
MAX_RANKS = 99999  # five digits in the file names
MAX_INDEX_BYTES = 256 << 20


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def is_sharded(meta: dict) -> bool:
    """Whether a checkpoint's meta.json is a sharded checkpoint's."""
    return meta.get("checkpoint_format") == FORMAT


# -- which rows each rank holds ----------------------------------------------------------------------
def chunk_rows(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of part `index` of `parts` of n rows, as torch.chunk and FSDP2's Shard(0) cut them."""
    size = -(-n // parts) if n else 0
    start = min(index * size, n)
    return start, min(start + size, n)


def _rows(shape) -> int:
    return shape[0] if len(shape) else 1


def _is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _dtensor_rows(t, name: str) -> tuple[int, int]:
    """The global rows [start, stop) a Shard(0) DTensor holds on this rank."""
    from torch.distributed.tensor import Shard

    mesh, placements = t.device_mesh, tuple(t.placements)
    _, world = rank_world()
    if mesh.ndim != 1 or placements != (Shard(0),) or mesh.size() != world:
        raise CheckpointError(
            f"{name} is sharded as {placements} over a {tuple(mesh.shape)} mesh; sharded checkpoints hold "
            f"FSDP2's Shard(0) over all {world} ranks"
        )
    start, stop = chunk_rows(t.shape[0], mesh.size(), mesh.get_local_rank())
    local = t.to_local()
    if tuple(local.shape) != (stop - start, *t.shape[1:]):
        raise CheckpointError(f"{name}: the local shard is {tuple(local.shape)}, not rows {start}..{stop}")
    return start, stop


@dataclass(frozen=True)
class _Piece:
    name: str
    dtype: str  # safetensors' name
    shape: tuple[int, ...]  # global
    start: int
    stop: int
    local: torch.Tensor | None  # this rank's rows (None: it writes none of this tensor)


def _piece(name: str, t: torch.Tensor, rank: int, world: int) -> _Piece:
    if t.dtype not in ST_NAMES:
        raise CheckpointError(f"{name}: dtype {t.dtype} has no safetensors name")
    shape = tuple(t.shape)
    if _is_dtensor(t):
        start, stop = _dtensor_rows(t, name)
        local = t.to_local()
    elif t.dim() == 0:
        start, stop = 0, 1
        local = t if rank == 0 else None
    else:  # held whole by every rank: rank r writes its chunk of the rows
        start, stop = chunk_rows(shape[0], world, rank)
        local = t[start:stop]
    if local is not None and (t.dim() and stop == start):
        local = None
    return _Piece(name, ST_NAMES[t.dtype], shape, start, stop, None if local is None else local.detach())


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of each optimizer group's parameters, in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    except KeyError:
        raise CheckpointError("the optimizer holds a parameter that is not the model's") from None


def _optimizer_parts(model, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """({optim/<param>/<key>: tensor}, the index's "optimizer": groups by name and non-tensor state)."""
    groups = _param_names(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for g, names in zip(optimizer.param_groups, groups, strict=True):
        for p, name in zip(g["params"], names, strict=True):
            for key, val in optimizer.state.get(p, {}).items():
                if isinstance(val, torch.Tensor):
                    tensors[f"optim/{name}/{key}"] = val
                else:
                    scalars.setdefault(name, {})[key] = val
    settings = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": names}
        for g, names in zip(optimizer.param_groups, groups, strict=True)
    ]
    part = {"param_groups": settings, "scalars": scalars}
    try:
        json.dumps(part, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the optimizer's settings are not plain JSON values ({e})") from None
    return tensors, part


# -- saving --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Staged:
    """One rank's share of a sharded checkpoint, ready to be written: the pieces of every tensor (this
    rank's rows, or none) and the index's "optimizer" part."""

    pieces: list[_Piece]
    optimizer: dict | None
    rank: int
    world: int


def stage_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    copy: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Staged:
    """This rank's share of the checkpoint of `model` and `optimizer` (no collective). `copy(name,
    local)`: a copy to write instead of the live rows (background.py's Staging), so that training can go on
    changing them while a writer thread writes the copy; None: the live rows themselves (a save that
    writes before training goes on)."""
    rank, world = rank_world()
    if world > MAX_RANKS:
        raise CheckpointError(f"sharded checkpoints hold at most {MAX_RANKS} ranks, not {world}")
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    opt_part = None
    if optimizer is not None:
        opt_tensors, opt_part = _optimizer_parts(model, optimizer)
        tensors.update(opt_tensors)
    pieces = [_piece(name, t, rank, world) for name, t in tensors.items()]
    if copy is not None:
        pieces = [p if p.local is None else replace(p, local=copy(p.name, p.local)) for p in pieces]
    return Staged(pieces, opt_part, rank, world)


def save_sharded(
    ckpt_root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict,
    keep_last: int,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path | None:
    """Write the checkpoint of `step` from every rank (a collective: every rank calls it, with the same
    arguments; one plain process is one rank). `model`: the module itself (plain, the module DDP wraps,
    or FSDP2-sharded in place); `meta`: meta.json's fields (config, RNG, counters), as for
    full.save_checkpoint; `extra`: tensors rank 0 writes whole (the TBPTT carry). Returns the
    checkpoint's path on rank 0, None on the others; a failure on any rank is a CheckpointError on
    every rank, with the partial directory removed and the earlier checkpoints intact."""
    staged = together(lambda: stage_sharded(model, optimizer), save_failure(ckpt_root, step))
    return write_sharded(ckpt_root, step, staged, meta, keep_last, extra)


def save_failure(ckpt_root: Path, step: int) -> Callable[[str], str]:
    def fail(why: str) -> str:
        return f"cannot write the checkpoint of step {step} in {ckpt_root}: {why}; the earlier checkpoints are intact"

    return fail


def write_sharded(
    ckpt_root: Path | store.Root,
    step: int,
    staged: Staged,
    meta: dict,
    keep_last: int,
    extra: dict[str, torch.Tensor] | None = None,
    group=None,
) -> Path | None:
    """Write a staged checkpoint (stage_sharded's, on every rank): a collective over `group` (None: the
    default process group; a writer thread passes its own, so that its agreements never interleave
    with training's collectives). `ckpt_root`: the checkpoints folder, or on rank 0 the store.Root a
    run holds (rank 0 makes, renames and removes every entry relative to it; the other ranks open
    `.tmp-step_N` by path, and create their file in it new). Returns and fails as save_sharded."""
    held = ckpt_root if isinstance(ckpt_root, store.Root) else None
    ckpt_root = held.path if held is not None else Path(ckpt_root)
    rank, world = staged.rank, staged.world
    pieces = staged.pieces
    final, tmp = f"step_{step:08d}", f".tmp-step_{step:08d}"
    tmp_path = ckpt_root / tmp
    fail = save_failure(ckpt_root, step)
    opened: list[store.Root] = []  # a Root rank 0 opened for this save alone

    def clean() -> None:
        if held is not None:
            held.discard(tmp)

    # 1. Rank 0 makes the temporary directory (removing any left by a crash mid-write: a run has at most
    # one save in flight, so no other is being written).
    def prepare() -> None:
        nonlocal held
        if rank == 0:
            if held is None:
                held = store.Root.open(ckpt_root, parents=True)
                opened.append(held)
            held.begin(tmp)

    # 2. Every rank writes, fsyncs and hashes its own file (the directory exists: rank 0 made it before agreeing).
    def write():
        name = shard_name(rank, world)
        mine = {p.name: p.local for p in pieces if p.local is not None}
        with store.open_dir(tmp_path, held) as dir_fd:
            entry = store.write_tensors(
                mine, tmp_path / name, dir_fd, {"rwkvx_shard": f"{rank}/{world}", "step": str(step)}
            )
        declared = [(p.name, p.dtype, p.shape) for p in pieces]
        chunks = [(p.name, p.start, p.stop) for p in pieces if p.local is not None]
        return name, entry["bytes"], entry["sha256"], declared, chunks

    # 3. Rank 0 checks that the rows tile every tensor, writes index.json and meta.json (last), renames.
    def commit():
        if rank != 0:
            return None
        index = _build_index(world, reports, staged.optimizer)
        listing = {name: {"bytes": size, "sha256": sha} for name, size, sha, _, _ in reports}
        with store.open_dir(tmp_path, held) as dir_fd:
            if extra:
                listing[EXTRA] = store.write_tensors(extra, tmp_path / EXTRA, dir_fd)
            raw = (json.dumps(index, separators=(",", ":")) + "\n").encode("utf-8")
            listing[INDEX] = store.write_new(tmp_path / INDEX, raw, dir_fd)
            body = {**meta, "step": step, "format": store.META_FORMAT, "checkpoint_format": FORMAT, "files": listing}
            body["meta_sha256"] = store.meta_digest(body)
            store.write_new(tmp_path / "meta.json", (json.dumps(body, indent=2) + "\n").encode("utf-8"), dir_fd)
            os.fsync(dir_fd)
        path = held.commit(tmp, final)
        held.prune(keep_last)
        return path

    try:
        together(prepare, fail, clean, group=group)
        reports = together(write, fail, clean, share=True, group=group)
        return together(commit, fail, clean, group=group)
    finally:
        for root in opened:
            root.close()


def _build_index(world: int, reports: list, opt_part: dict | None) -> dict:
    declared = reports[0][3]
    for r, rep in enumerate(reports):
        if rep[3] != declared:
            raise CheckpointError(f"rank {r} holds other tensors (names, dtypes or shapes) than rank 0")
    chunks: dict[str, list[list[int]]] = {name: [] for name, _, _ in declared}
    for r, rep in enumerate(reports):
        for name, start, stop in rep[4]:
            chunks[name].append([r, start, stop])
    tensors = {}
    for name, dtype, shape in declared:
        rows = sorted(chunks[name], key=lambda c: c[1])
        _check_tiling(name, shape, rows)
        tensors[name] = {"dtype": dtype, "shape": list(shape), "chunks": rows}
    return {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "world_size": world,
        "files": [shard_name(r, world) for r in range(world)],
        "tensors": tensors,
        "optimizer": opt_part,
    }


def _check_tiling(name: str, shape, chunks) -> None:
    at, rows = 0, _rows(shape)
    for _, start, stop in chunks:
        if start != at or stop <= start:
            raise CheckpointError(f"{name}: rows {start}..{stop} do not follow row {at} (the shards must tile it)")
        at = stop
    if at != rows or (not len(shape) and chunks and chunks[0][1:] != [0, 1]):
        raise CheckpointError(f"{name}: the shards hold rows 0..{at} of {rows}")


# -- reading: meta.json, index.json, the files -------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[tuple[int, int, int], ...]  # (file, start row, stop row), in row order, tiling the rows


@dataclass(frozen=True)
class Index:
    world_size: int
    files: tuple[str, ...]
    tensors: dict[str, Entry]
    optimizer: dict | None  # {"param_groups": [{..., "params": [names]}], "scalars": {name: {key: value}}}

    def part(self, prefix: str) -> dict[str, Entry]:
        return {k[len(prefix) :]: v for k, v in self.tensors.items() if k.startswith(prefix)}


def read_meta(ckpt: Path) -> dict:
    """A sharded checkpoint's meta.json, checked (fields, its own checksum, the step of its directory,
    the names of its files) without reading any other file."""
    ckpt = Path(ckpt)
    meta = store.read_meta(ckpt)
    where = ckpt / "meta.json"
    if "meta_sha256" not in meta or meta["meta_sha256"] != store.meta_digest(meta):
        raise CheckpointError(f"{where} does not match its own checksum (corrupted)")
    if not is_sharded(meta):
        raise CheckpointError(
            f"{where}: not a sharded checkpoint (checkpoint_format {show(meta.get('checkpoint_format'))})"
        )
    if store.is_step_dir(ckpt) and meta["step"] != store.step_of(ckpt):
        raise CheckpointError(f"{where} says step {meta['step']}, its directory {ckpt.name}")
    files = meta.get("files")
    if not isinstance(files, dict) or INDEX not in files:
        raise CheckpointError(f"{where} lists no {INDEX}")
    for name in files:
        if name not in (INDEX, EXTRA) and not SHARD_RE.fullmatch(name):
            raise CheckpointError(f"{where} lists an unexpected file {show(name)}")
    return meta


def read_index(ckpt: Path, meta: dict) -> Index:
    """index.json, after checking it against its SHA-256 in meta.json and its own rules."""
    ckpt = Path(ckpt)
    path = ckpt / INDEX
    if meta["files"][INDEX]["bytes"] > MAX_INDEX_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_INDEX_BYTES} bytes")
    store.check_file(ckpt / INDEX, meta["files"][INDEX])
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path} is unreadable: {store.io_reason(e)}") from None
    index = parse_index(strict_json(raw, str(path)), str(path))
    shards = {n for n in meta["files"] if SHARD_RE.fullmatch(n)}
    if shards != set(index.files):
        raise CheckpointError(
            f"{ckpt / 'meta.json'} lists other shard files than {path} ({len(shards)} vs {index.world_size})"
        )
    return index


def parse_index(doc: object, where: str) -> Index:
    """An Index from index.json's JSON value; CheckpointError naming the first thing that is wrong."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: {why}")

    if not isinstance(doc, dict):
        raise bad(f"is {show(doc)}, not an object")
    if doc.get("format") != INDEX_FORMAT or doc.get("version") != INDEX_VERSION:
        raise bad(f"not a {INDEX_FORMAT} index of version {INDEX_VERSION}")
    world = doc.get("world_size")
    if not is_int(world) or not 1 <= world <= MAX_RANKS:
        raise bad(f"world_size is {show(world)}")
    files = doc.get("files")
    if files != [shard_name(r, world) for r in range(world)]:
        raise bad(f"files are not the {world} shards shard-<rank>-of-{world:05d}.safetensors")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("tensors is not an object")
    entries: dict[str, Entry] = {}
    for name, e in tensors.items():
        what = f"tensor {show(name)}"
        if not (name.startswith("model/") or name.startswith("optim/")) or len(name) > 4096:
            raise bad(f"{what} is neither model/... nor optim/...")
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "chunks"}:
            raise bad(f"{what} is not an object of dtype, shape and chunks")
        dtype, shape, chunks = e["dtype"], e["shape"], e["chunks"]
        if dtype not in ST_DTYPES:
            raise bad(f"{what}: dtype {show(dtype)} is not a safetensors dtype rwkvx reads")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(is_int(d) and 0 <= d < 2**48 for d in shape)):
            raise bad(f"{what}: shape {show(shape)} is not a list of sizes")
        if not (
            isinstance(chunks, list)
            and all(isinstance(c, list) and len(c) == 3 and all(is_int(x) for x in c) for c in chunks)
        ):
            raise bad(f"{what}: chunks are not [file, start row, stop row] triples")
        if any(not 0 <= c[0] < world for c in chunks) or len({c[0] for c in chunks}) != len(chunks):
            raise bad(f"{what}: a chunk names a file twice or one that is not a shard")
        try:
            _check_tiling(name, shape, chunks)
        except CheckpointError as err:
            raise bad(str(err)) from None
        entries[name] = Entry(ST_DTYPES[dtype], tuple(shape), tuple(tuple(c) for c in chunks))
    opt = doc.get("optimizer")
    if opt is not None:
        _check_optimizer_part(opt, entries, bad)
    elif any(n.startswith("optim/") for n in entries):
        raise bad("optimizer tensors without the optimizer's groups")
    return Index(world, tuple(files), entries, opt)


def _check_optimizer_part(opt: object, entries: dict[str, Entry], bad) -> None:
    if not isinstance(opt, dict) or set(opt) != {"param_groups", "scalars"}:
        raise bad("optimizer is not an object of param_groups and scalars")
    groups, scalars = opt["param_groups"], opt["scalars"]
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"])
        for g in groups
    ):
        raise bad("optimizer.param_groups is not a list of groups naming their parameters")
    for g in groups:
        for key, val in g.items():
            plain = val is None or isinstance(val, (bool, str)) or is_number(val)
            if key != "params" and not (plain or (isinstance(val, list) and all(is_number(x) for x in val))):
                raise bad(f"optimizer group setting {show(key)} is {show(val)}, not a number, flag or name")
    names = [n for g in groups for n in g["params"]]
    if len(set(names)) != len(names):
        raise bad("optimizer.param_groups name a parameter twice")
    known = set(names)
    for name in entries:
        if name.startswith("optim/"):
            param = name[len("optim/") :].rpartition("/")[0]
            if param not in known:
                raise bad(f"optimizer state {show(name)} is for no parameter of the groups")
    if not isinstance(scalars, dict) or not all(
        k in known and isinstance(v, dict) and all(is_number(x) or isinstance(x, bool) or x is None for x in v.values())
        for k, v in scalars.items()
    ):
        raise bad("optimizer.scalars is not an object of the parameters' number values")


def verify(ckpt: Path, share: tuple[int, int] = (0, 1)) -> tuple[dict, Index]:
    """(meta.json, index.json) of a sharded checkpoint, after checking both and the SHA-256 of the files
    in `share` = (i, n): every n-th file from the i-th (a rank's part of the work; (0, 1): all)."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    index = read_index(ckpt, meta)
    names = sorted(n for n in meta["files"] if n != INDEX)
    for name in names[share[0] :: share[1]]:
        store.check_file(ckpt / name, meta["files"][name])
    return meta, index


class ShardedSource(TensorSource):
    """The tensors of a sharded checkpoint whose names start with `prefix` ("model/": the weights),
    as full tensors (`get`) or any rows of them (`rows`), read from the memory-mapped shard files
    (opened, and their headers checked against the index, on first use)."""

    def __init__(self, ckpt: Path, index: Index, prefix: str = "model/"):
        self.ckpt, self.index, self.prefix = Path(ckpt), index, prefix
        self.entries = index.part(prefix)
        self._files: dict[int, SafetensorsFiles] = {}

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str):
        return self.entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].dtype

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def _file(self, i: int) -> SafetensorsFiles:
        if i not in self._files:
            path = self.ckpt / self.index.files[i]
            src = SafetensorsFiles([path])  # a FormatError (a CheckpointError) for any malformed header
            want = {
                name: (e.dtype, (stop - start, *e.shape[1:]) if e.shape else ())
                for name, e in self.index.tensors.items()
                for f, start, stop in e.chunks
                if f == i
            }
            have = {name: (src.dtype(name), tuple(src.shape(name))) for name in src.names()}
            if have != want:
                odd = sorted(set(have) ^ set(want)) or [n for n in want if have[n] != want[n]]
                src.close()
                raise CheckpointError(f"{path} does not hold the rows {INDEX} says it does ({show(odd[0])})")
            if src.metadata.get("rwkvx_shard") != f"{i}/{self.index.world_size}":
                src.close()
                raise CheckpointError(f"{path} is not shard {i} of {self.index.world_size}")
            self._files[i] = src
        return self._files[i]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (the whole of a 0-dimensional one), as a new tensor."""
        full, e = self.prefix + name, self.entries[name]
        if not e.shape:
            f = e.chunks[0][0]
            out = self._file(f).get(full).clone()
            self._file(f).release(full)
            return out
        out = torch.empty((stop - start, *e.shape[1:]), dtype=e.dtype)
        for f, a, b in e.chunks:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                src = self._file(f)
                out[lo - start : hi - start].copy_(src.get(full)[lo - a : hi - a])
                src.release(full)
        return out

    def get(self, name: str) -> torch.Tensor:
        return self.rows(name, 0, _rows(self.entries[name].shape))

    def release(self, name: str) -> None:
        pass  # rows() drops the pages of what it read

    def close(self) -> None:
        for src in self._files.values():
            src.close()
        self._files = {}


# -- loading into a model and optimizer ----------------------------------------------------------------
def _target(live: torch.Tensor, src: ShardedSource, name: str) -> torch.Tensor:
    """What this rank loads for `live`: its own rows as a DTensor placed as `live` is, or the whole tensor."""
    if _is_dtensor(live):
        from torch.distributed.tensor import DTensor

        start, stop = _dtensor_rows(live, name)
        local = src.rows(name, start, stop).to(live.to_local().device)
        return DTensor.from_local(
            local, live.device_mesh, live.placements, run_check=False, shape=live.shape, stride=live.stride()
        )
    return src.rows(name, 0, _rows(src.shape(name)))


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of a floating-point tensor is finite. A NaN or infinity makes the sum NaN or
    infinite in any order of summation, so a finite sum answers at memory speed; a non-finite one
    (or an overflow of finite values) is checked exactly, a block at a time."""
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return True
    return all(bool(torch.isfinite(block).all()) for block in t.reshape(-1).split(1 << 20))


def _check_values(name: str, t: torch.Tensor, source: str) -> None:
    local = t.to_local() if _is_dtensor(t) else t
    if local.is_floating_point() and not _finite(local):
        raise CheckpointError(f"{source}: {name} holds non-finite values")
    if name.endswith("/step") and local.numel() == 1:
        v = float(local)
        if not (1 <= v < 2**53 and v.is_integer()):  # Adam divides by 1 - beta**step
            raise CheckpointError(f"{source}: {name} is {v}, not a count of steps")


def load_sharded(
    ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, verified: bool = False
) -> dict:
    """Load a sharded checkpoint written by any number of ranks into `model` (plain, or FSDP2-sharded
    Shard(0) over this process group: each rank reads only its own rows) and `optimizer` (its state
    and groups; it keeps its own implementation flags). A collective when a process group exists.
    Returns the checkpoint's verified meta.json (RNG, counters, config: the caller's); the TBPTT carry
    is `store.load_extra(ckpt)`. Any failure is the same one-line CheckpointError on every rank,
    before anything is loaded. `verified`: the ranks have just checked the files' SHA-256 (`verify`
    with their shares, as a resume's search for the newest good checkpoint does): not hashed again."""
    ckpt = Path(ckpt)
    rank, world = rank_world()

    def fail(why: str) -> str:
        return why

    # 1. Check meta.json and index.json (every rank), and the files' SHA-256 (split over the ranks).
    def check() -> tuple[dict, Index]:
        if verified:
            meta = read_meta(ckpt)
            return meta, read_index(ckpt, meta)
        return verify(ckpt, (rank, world))

    meta, index = together(check, fail)

    # 2. Read this rank's rows into new tensors, checked against the model and optimizer.
    def read():
        src = ShardedSource(ckpt, index, "model/")
        osrc = ShardedSource(ckpt, index, "optim/")
        try:
            own = model.state_dict()
            saved = {n: torch.empty(e.shape, dtype=e.dtype, device="meta") for n, e in src.entries.items()}
            problems = mismatch(own, saved)
            if problems:
                raise CheckpointError(f"{ckpt} does not match the model: {problems}")
            weights = {n: _target(t, src, n) for n, t in own.items()}
            for n, t in weights.items():
                _check_values(n, t, str(ckpt))
            osd = None if optimizer is None else _read_optimizer(ckpt, index, model, optimizer, osrc)
            return weights, osd
        finally:
            src.close()
            osrc.close()

    weights, osd = together(read, fail)

    # 3. Load (every rank got this far, so none is left waiting in a collective).
    def apply():
        flags = implementation(optimizer) if optimizer is not None else None
        try:
            model.load_state_dict(weights)
            if osd is not None:
                optimizer.load_state_dict(osd)
                restore_implementation(optimizer, flags)
        except (RuntimeError, KeyError, TypeError, OverflowError) as e:  # as manager.load_latest's
            raise CheckpointError(one_line(e)) from None

    together(apply, lambda why: f"{ckpt} cannot be loaded: {why}")
    return meta


def _read_optimizer(ckpt: Path, index: Index, model, optimizer, src: ShardedSource) -> dict | None:
    """The optimizer's state_dict (integer keys, this rank's rows) from the checkpoint; None when it has none."""
    if index.optimizer is None:
        return None
    live = _param_names(model, optimizer)
    saved_groups = index.optimizer["param_groups"]
    if [g["params"] for g in saved_groups] != live:
        raise CheckpointError(
            f"{ckpt}: the optimizer state does not fit this run: its groups hold other parameters "
            f"({[len(g['params']) for g in saved_groups]} vs {[len(g) for g in live]})"
        )
    params = dict(model.named_parameters())
    order = [n for g in live for n in g]
    position = {n: i for i, n in enumerate(order)}
    state: dict[int, dict] = {}
    for key in src.names():
        pname, _, field = key.rpartition("/")
        p = params[pname]
        e = src.entries[key]
        if e.shape and e.shape != tuple(p.shape):
            raise CheckpointError(
                f"{ckpt}: the optimizer state does not fit this run: {key} is {list(e.shape)}, "
                f"the parameter {list(p.shape)}"
            )
        t = _target(p, src, key) if e.shape else src.rows(key, 0, 1)
        _check_values(key, t, str(ckpt))
        state.setdefault(position[pname], {})[field] = t
    for pname, values in index.optimizer["scalars"].items():
        state.setdefault(position[pname], {}).update(values)
    groups, at = [], 0
    for g in saved_groups:
        groups.append({**g, "params": list(range(at, at + len(g["params"])))})
        at += len(g["params"])
    return {"state": state, "param_groups": groups}


# -- one process: full tensors, one tensor at a time -----------------------------------------------------
def consolidate(ckpt: Path) -> tuple[dict, dict[str, torch.Tensor], dict | None]:
    """(meta.json, full weights, full optimizer state_dict in full.py's integer layout or None) of a
    sharded checkpoint, in one process after verifying every file: what full.load_weights and
    load_optimizer_state give for a full checkpoint. Holds the result once (each tensor is read
    straight into its own new tensor)."""
    meta, index = verify(ckpt)
    with ShardedSource(ckpt, index, "model/") as src:
        weights = {n: src.get(n) for n in src.names()}
    if index.optimizer is None:
        return meta, weights, None
    with ShardedSource(ckpt, index, "optim/") as osrc:
        names = [n for g in index.optimizer["param_groups"] for n in g["params"]]
        position = {n: i for i, n in enumerate(names)}
        state: dict[int, dict] = {}
        for key in osrc.names():
            pname, _, field = key.rpartition("/")
            state.setdefault(position[pname], {})[field] = osrc.get(key)
        for pname, values in index.optimizer["scalars"].items():
            state.setdefault(position[pname], {}).update(values)
    groups, at = [], 0
    for g in index.optimizer["param_groups"]:
        groups.append({**g, "params": list(range(at, at + len(g["params"])))})
        at += len(g["params"])
    return meta, weights, {"state": state, "param_groups": groups}


class _Renamed(TensorSource):
    """A ShardedSource under other names (full.py's `state.<index>.<key>` for the optimizer)."""

    def __init__(self, base: ShardedSource, names: dict[str, str]):
        self.base, self.map = base, names  # new name -> base name

    def names(self):
        return list(self.map)

    def shape(self, name):
        return self.base.shape(self.map[name])

    def dtype(self, name):
        return self.base.dtype(self.map[name])

    def get(self, name):
        return self.base.get(self.map[name])

    def close(self):
        self.base.close()


def write_full(ckpt: Path, out: Path) -> Path:
    """A full checkpoint directory (full.py's layout: model.safetensors, optimizer.safetensors,
    extra.safetensors, meta.json) at `out` (a new directory) from a sharded one, one tensor at a
    time: what `rwkvx export --format safetensors` and the readers of full checkpoints take.
    Written under a temporary name and renamed into place."""
    meta, index = verify(ckpt)
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} exists")
    tmp = out.with_name(f".tmp-{out.name}")
    remove_entry(tmp)  # left by a killed export; a link there is unlinked, not followed
    tmp.mkdir(parents=True)
    try:
        body = {k: v for k, v in meta.items() if k not in ("files", "meta_sha256", "checkpoint_format")}
        with ShardedSource(ckpt, index, "model/") as src:
            write_safetensors(src, tmp / "model.safetensors", src.names(), {"format": "pt"})
        if index.optimizer is not None:
            groups = index.optimizer["param_groups"]
            position = {n: i for i, n in enumerate(n for g in groups for n in g["params"])}
            osrc = ShardedSource(ckpt, index, "optim/")
            renamed = {}
            for key in osrc.names():
                pname, _, field = key.rpartition("/")
                renamed[f"state.{position[pname]}.{field}"] = key
            with _Renamed(osrc, renamed) as src:
                write_safetensors(src, tmp / "optimizer.safetensors", list(renamed), {"format": "pt"})
            at, int_groups = 0, []
            for g in groups:
                int_groups.append({**g, "params": list(range(at, at + len(g["params"])))})
                at += len(g["params"])
            scalars = {
                f"{position[p]}.{k}": v for p, vals in index.optimizer["scalars"].items() for k, v in vals.items()
            }
            body["optimizer"] = {"param_groups": int_groups, "scalars": scalars}
        if EXTRA in meta["files"]:
            with open(ckpt / EXTRA, "rb") as src, create_new(tmp / EXTRA) as dst:
                shutil.copyfileobj(src, dst)
                fsync_file(dst)
        listing = {}
        for name in ("model.safetensors", "optimizer.safetensors", EXTRA):
            if (tmp / name).is_file():
                listing[name] = store.file_entry(tmp / name)
        body = {**body, "format": store.META_FORMAT, "files": listing}
        body["meta_sha256"] = store.meta_digest(body)
        atomic_write_text(tmp / "meta.json", json.dumps(body, indent=2) + "\n")
        fsync_dir(tmp)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def consolidate_to_file(ckpt: Path, out: Path, part: str = "model") -> Path:
    """One .safetensors file of a sharded checkpoint's weights (`part` "model", rwkvx's names) or
    optimizer state ("optim", `<parameter>/<key>` names), streamed one tensor at a time; written
    under a temporary name and renamed into place."""
    _, index = verify(ckpt)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with ShardedSource(ckpt, index, f"{part}/") as src:
            write_safetensors(src, tmp, src.names(), {"format": "pt"})
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
