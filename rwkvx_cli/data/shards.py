"""Slices of a corpus: the units one `prepare` reads (and resumes by), and the disjoint shards of many machines.

The inputs, in order, are one byte space (file after file). Shard i of K covers bytes [S*i//K, S*(i+1)//K) of it
(S: the total size). An uncompressed JSONL file is split by byte range wherever a shard boundary falls in it: a range
holds the lines that start inside it, so the ranges of a file hold each of its lines exactly once. A file that cannot
be read from the middle (.txt, compressed, .parquet) belongs whole to the shard that holds its middle byte. The
shards' documents are thus the corpus's documents, each once, and in corpus order shard after shard.

Within a shard, a JSONL range longer than `unit_bytes` is cut into units of at most that size; every other file is a
unit. `prepare --resume` continues after the last unit it finished.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from rwkvx_cli.data.corpus import input_format

UNIT_BYTES = 1 << 28


@dataclass(frozen=True)
class Unit:
    source: int  # index into the inputs
    start: int  # bytes [start, end) of the file; a file read whole is (0, size)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def splittable(path: Path) -> bool:
    fmt = input_format(path)
    return fmt is not None and fmt.kind == "jsonl" and fmt.compression is None


def plan_units(
    inputs: list[Path], sizes: list[int], num_shards: int = 1, shard_index: int = 0, unit_bytes: int = UNIT_BYTES
) -> list[Unit]:
    """The units of shard `shard_index` of `num_shards`, in corpus order."""
    total = sum(sizes)
    lo, hi = total * shard_index // num_shards, total * (shard_index + 1) // num_shards  # any K: no list of bounds
    last = shard_index == num_shards - 1
    units: list[Unit] = []
    at = 0
    for k, (path, size) in enumerate(zip(inputs, sizes, strict=True)):
        start, end = at, at + size
        at = end
        if splittable(path):
            a, b = max(lo, start) - start, min(hi, end) - start
            for u in range(a, b, unit_bytes):
                units.append(Unit(k, u, min(b, u + unit_bytes)))
        else:
            middle = start + size // 2  # its owner: the last shard starting at or before it
            if lo <= middle and (middle < hi or last):
                units.append(Unit(k, 0, size))
    return units


def corpus_id(inputs: list[Path], sizes: list[int]) -> str:
    """What the shards of one corpus share: its files' names and sizes, in order (paths may differ between
    machines)."""
    listing = json.dumps([[p.name, s] for p, s in zip(inputs, sizes, strict=True)])
    return hashlib.sha256(listing.encode()).hexdigest()[:16]
