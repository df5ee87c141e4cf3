"""`data merge`: prepared directories (the K shards of a sharded prepare, or any sharing a tokenizer) -> one.

Training reads a list of shards as it is (`open_prepared`, nothing copied); merging is for a tool that wants one
binidx pair, RWKV-LM's trainer for one. The directories are checked as `open_prepared` checks them (the same
tokenizer, a sharded corpus whole, each shard once) and concatenated in its reading order: train.bin is the
training splits one after another, copied in the kernel (copy_file_range), train.idx their document sizes, the
same for val; so the merged directory holds each document of the inputs once, in the order a list of them is read.
meta.json is written last, as by `prepare`: an interrupted merge leaves a directory nothing takes for a finished one.
Loss masks (masks.py) follow their tokens: when any directory has them, each merged split gets one, a directory
without masks contributing ones (its documents carry loss everywhere).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rwkvx_cli.data.binidx import _WRITE_CHUNK, BinIdx, binidx_paths, copy_range, replacing, write_index
from rwkvx_cli.data.masks import mask_path, replacing_mask
from rwkvx_cli.data.prepared import open_prepared, template_of
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import (
    DATA_MARKER,
    atomic_write_text,
    check_writable_dir,
    claim_dir,
    fsync_file,
    names_file,
    write_failure,
)

_SUMMED = ("documents", "bytes", "text_bytes", "tokens", "skipped_records")


@dataclass(frozen=True)
class MergeStats:
    out_dir: Path
    directories: int
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int


def merge_prepared(paths: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> MergeStats:
    """Write the prepared directories `paths` (a list, a directory or a glob, as `open_prepared` takes them) as one
    prepared directory `out_dir`. Refuses an `out_dir` rwkvx did not make, or one of the inputs."""
    from rwkvx_cli.data.prepare import _hold, _prepared_here, remove_stale_temps

    corpus = open_prepared(paths)
    out_dir = check_writable_dir(out_dir, DATA_MARKER, _prepared_here, "data directory")
    resolved = Path(os.path.abspath(out_dir))
    if any(Path(os.path.abspath(d)) == resolved for d in corpus.dirs):
        raise UsageError(f"{out_dir} is one of the directories to merge; name a new one")
    try:
        claim_dir(out_dir, DATA_MARKER)
    except OSError as e:
        raise write_failure(e, out_dir, f"the directories merged are intact; nothing is in {out_dir}") or e from None
    with _hold(out_dir):
        try:
            (out_dir / "meta.json").unlink(missing_ok=True)  # an older one must not vouch for a half-rewritten dir
            remove_stale_temps(out_dir)  # left by a killed prepare or merge
            counts = {"train": _concatenate(out_dir / "train", corpus.train, corpus.dtype),
                      "val": _concatenate(out_dir / "val", corpus.val_parts, corpus.dtype)}
            loss = None
            if corpus.masked:
                loss = {"train": _concatenate_masks(out_dir / "train", corpus.train),
                        "val": _concatenate_masks(out_dir / "val", corpus.val_parts)}
            else:
                for split in ("train", "val"):
                    mask_path(out_dir / split).unlink(missing_ok=True)  # an earlier merge's
            with names_file(out_dir / "tokenizer.json"):
                shutil.copyfile(corpus.dirs[0] / "tokenizer.json", out_dir / "tokenizer.json")
            meta = _merged_meta(corpus.dirs, corpus.metas, counts, loss)
            atomic_write_text(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")  # last: it is complete
        except OSError as e:  # a full disk: say where, and that the inputs are whole
            intact = f"the directories merged are intact; {out_dir} holds no finished merge (no meta.json): " \
                "free space and merge again"
            raise write_failure(e, out_dir, intact) or e from None
    (train_docs, train_tokens), (val_docs, val_tokens) = counts["train"], counts["val"]
    return MergeStats(out_dir, len(corpus.dirs), train_tokens, val_tokens, train_docs, val_docs)


def _concatenate(prefix: Path, opened: list[BinIdx], dtype: np.dtype) -> tuple[int, int]:
    """Write the opened binidx pairs one after another as `prefix`; returns (documents, tokens)."""
    bin_path, idx_path = binidx_paths(prefix)
    with replacing(prefix) as (tmp_bin, tmp_idx):
        with names_file(bin_path), open(tmp_bin, "wb") as dst:
            for data in opened:  # the splits open_prepared checked and mapped
                with open(data.bin_path, "rb") as src:
                    copy_range(src.fileno(), dst.fileno(), 0, len(data.tokens) * dtype.itemsize)
            fsync_file(dst)
        n = sum(len(d.doc_sizes) for d in opened)

        def sizes():
            for d in opened:
                for a in range(0, len(d.doc_sizes), _WRITE_CHUNK):
                    yield np.asarray(d.doc_sizes[a : a + _WRITE_CHUNK], dtype=np.int64)

        with names_file(idx_path):
            write_index(tmp_idx, dtype, n, sizes)
    return n, sum(len(d.tokens) for d in opened)


def _concatenate_masks(prefix: Path, opened: list[BinIdx]) -> int:
    """Write the loss masks of the opened splits (ones for one without) one after another as PREFIX.mask; returns
    how many tokens carry loss."""
    loss = 0
    with replacing_mask(prefix) as tmp, names_file(mask_path(prefix)), open(tmp, "wb") as dst:
        for data in opened:
            if data.mask is None:
                for a in range(0, len(data), _WRITE_CHUNK):
                    dst.write(b"\x01" * (min(len(data), a + _WRITE_CHUNK) - a))
                loss += len(data)
            else:
                with open(mask_path(data.bin_path), "rb") as src:
                    copy_range(src.fileno(), dst.fileno(), 0, len(data))
                loss += int(np.count_nonzero(data.mask))
        fsync_file(dst)
    return loss


def _merged_meta(dirs: list[Path], metas: list[dict], counts: dict, loss: dict | None = None) -> dict:
    """The first directory's meta.json with the counts of all, every source, and what was merged; a setting the
    directories disagree on (val_fraction, seed, ...) is null. With `loss` (tokens that carry loss per split),
    the template of the directories that have masks."""
    first = metas[0]
    meta = {k: v for k, v in first.items() if k not in ("shard", "sources", "template", "mask")}
    for key in _SUMMED:
        meta[key] = sum(int(m.get(key) or 0) for m in metas)
    for key in ("split", "val_fraction", "seed", "text_field"):
        values = {json.dumps(m.get(key)) for m in metas}
        meta[key] = first.get(key) if len(values) == 1 else None
    meta["val_requested"] = sum(int(m.get("val_requested") or 0) for m in metas)
    meta["cuts"] = {**first.get("cuts", {}), "forced": sum(int(m.get("cuts", {}).get("forced", 0)) for m in metas)}
    (train_docs, train_tokens), (val_docs, val_tokens) = counts["train"], counts["val"]
    meta["train"] = {"prefix": "train", "tokens": train_tokens, "documents": train_docs}
    meta["val"] = {"prefix": "val", "tokens": val_tokens, "documents": val_docs}
    if loss is not None:
        meta["train"]["loss_tokens"], meta["val"]["loss_tokens"] = loss["train"], loss["val"]
        masked = next(m for m in metas if template_of(m) is not None)
        meta["template"], meta["mask"] = masked["template"], masked["mask"]
    meta["sources"] = [s for m in metas for s in m.get("sources", [])]
    meta["merged"] = [
        {"dir": str(Path(d).resolve()), "train_tokens": m["train"]["tokens"], "val_tokens": m["val"]["tokens"],
         **({"shard": m["shard"]} if "shard" in m else {})}
        for d, m in zip(dirs, metas, strict=True)
    ]
    return meta
