"""Several prepared directories read as one corpus: the K shards of `prepare --num-shards K`, or any prepared
directories that share a tokenizer. Nothing is copied: every split stays a memory map of its own file, and so does
its loss mask (masks.py) where it has one."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rwkvx_cli.data.binidx import BinIdx, _check_vocab
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.masks import ones, open_mask


class TokenChain:
    """Token arrays read as one 1-D sequence, without copying them.

    `len()`, `dtype`, an int index, a slice (a copy of just that range, at most one array's worth per part it
    crosses) and an integer array of positions (a gather) work as on one array; `parts` are the arrays.
    `np.asarray(chain)` copies everything: avoid it on a large corpus."""

    mask = None  # the loss masks of the parts as one TokenChain, where a reader sets them

    def __init__(self, parts: Sequence[np.ndarray]):
        self.parts = [np.asarray(p) if not isinstance(p, np.ndarray) else p for p in parts]
        dtypes = {p.dtype for p in self.parts}
        if len(dtypes) > 1:
            raise DataError(f"token arrays of dtypes {', '.join(sorted(map(str, dtypes)))} cannot be read as one")
        self.dtype = dtypes.pop() if dtypes else np.dtype(np.uint16)
        self.offsets = np.zeros(len(self.parts) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in self.parts], out=self.offsets[1:])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def ndim(self) -> int:
        return 1

    @property
    def tokens(self) -> TokenChain:
        return self

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise IndexError("a TokenChain slice takes step 1 only")
            out = [
                np.asarray(p[max(start - a, 0) : min(stop, b) - a])
                for p, a, b in zip(self.parts, self.offsets[:-1].tolist(), self.offsets[1:].tolist(), strict=True)
                if a < stop and b > start
            ]
            return np.concatenate(out) if out else np.zeros(0, dtype=self.dtype)
        if isinstance(key, (int, np.integer)):
            i = int(key) + n if key < 0 else int(key)
            if not 0 <= i < n:
                raise IndexError(f"index {key} is out of range for {n} tokens")
            k = int(np.searchsorted(self.offsets, i, side="right")) - 1
            return self.parts[k][i - self.offsets[k]]
        idx = np.asarray(key)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"a TokenChain takes ints, slices or integer arrays, not {idx.dtype}")
        flat = np.where(idx < 0, idx + n, idx).reshape(-1)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(f"an index is out of range for {n} tokens")
        part = np.searchsorted(self.offsets, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for k in np.unique(part).tolist():
            sel = part == k
            out[sel] = self.parts[k][flat[sel] - self.offsets[k]]
        return out.reshape(idx.shape)

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(p) for p in self.parts]) if self.parts else np.zeros(0, self.dtype)
        return whole if dtype is None else whole.astype(dtype)

    def check_vocab(self, vocab_size: int, what: str = "the tokens") -> None:
        for p, at in zip(self.parts, self.offsets[:-1].tolist(), strict=True):
            if len(p):
                _check_vocab(p, vocab_size, what, offset=at)

    def __repr__(self) -> str:
        return f"TokenChain({len(self.parts)} parts, {len(self)} tokens, {self.dtype})"


@dataclass(frozen=True)
class PreparedCorpus:
    """Prepared directories as one corpus (`open_prepared`)."""

    dirs: list[Path]  # in reading order: as given, a sharded corpus's shards by index where the first one was
    metas: list[dict]  # each directory's meta.json
    tokenizer: object  # the tokenizer all of them were prepared with (with its end-of-document id)
    train: list[BinIdx]  # each directory's training split, memory-mapped
    val_parts: list[BinIdx]  # each directory's validation split, memory-mapped
    val: TokenChain  # the validation splits as one sequence

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def dtype(self) -> np.dtype:
        return self.train[0].dtype

    @property
    def eod_id(self) -> int:
        return self.tokenizer.eod_id

    @property
    def train_tokens(self) -> list[np.ndarray]:
        """The training token arrays (memory maps), one per directory."""
        return [t.tokens for t in self.train]

    @property
    def weights(self) -> list[int]:
        """Training tokens per directory: drawing from the arrays in these proportions reads them as one corpus."""
        return [len(t) for t in self.train]

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id of every split is below `vocab_size` (reads all the token files)."""
        for split in (*self.train, *self.val_parts):
            split.check_vocab(vocab_size)

    @property
    def masked(self) -> bool:
        """Some directory has loss masks (a corpus of conversations)."""
        return any(t.mask is not None for t in self.train)

    @property
    def train_masks(self) -> list[np.ndarray] | None:
        """Each training split's loss mask (all ones for a directory without one), or None when none has one."""
        return [t.mask if t.mask is not None else ones(len(t)) for t in self.train] if self.masked else None

    @property
    def val_mask(self) -> TokenChain | None:
        """The validation splits' loss masks as one sequence, as `val`, or None when no directory has masks."""
        if not self.masked:
            return None
        return TokenChain([v.mask if v.mask is not None else ones(len(v)) for v in self.val_parts])


def open_prepared(
    paths: str | os.PathLike | Sequence[str | os.PathLike], vocab_size: int | None = None
) -> PreparedCorpus:
    """Open prepared directories (`prepare`'s outputs) as one corpus.

    `paths` is a directory, a glob pattern (its matches, sorted) or a list of those. Each must be a complete
    prepared directory (meta.json written, files as it says). All must hold byte-identical tokenizer.json files and
    the same end-of-document id, vocabulary size and token dtype. Directories that are shards of one sharded
    prepare (meta.json "shard": index, count, corpus) must all be there, each once: a missing or repeated shard is
    an error, since the shards together are the corpus, each document once. A directory may not be named twice.

    The result keeps each directory's training split as its own memory map (`train`; `weights` gives their token
    counts, the proportions that read them as one corpus) and the validation splits as one sequence (`val`, a
    TokenChain: slicing it reads only the slice; its order is the directories' order, so a prefix of it comes
    from the first directories). With `vocab_size`, the tokenizer must not have more ids, and every token id is
    checked below min(vocab_size, the tokenizer's) (this reads every token file). Raises DataError naming the
    directory and the problem.
    """
    from rwkvx_cli.data.prepare import read_prepared_meta
    from rwkvx_cli.data.tokenizer import load_tokenizer

    dirs = _expand(paths)
    metas = []
    for d in dirs:
        if not (d / "meta.json").is_file():
            raise DataError(
                f"{d} is not a prepared directory (no meta.json: not prepared, or its prepare was interrupted)"
            )
        metas.append(read_prepared_meta(d))
    first_tok = _read_bytes(dirs[0] / "tokenizer.json")
    first_eod = _eod(metas[0])
    for d, m in zip(dirs[1:], metas[1:], strict=True):
        if _read_bytes(d / "tokenizer.json") != first_tok:
            raise DataError(f"{dirs[0]} and {d} were prepared with different tokenizers (tokenizer.json differs)")
        if _eod(m) != first_eod:
            raise DataError(f"{dirs[0]} and {d} end documents with different ids ({first_eod} and {_eod(m)})")
        for key in ("vocab_size", "dtype"):
            if m[key] != metas[0][key]:
                raise DataError(f"{dirs[0]} and {d} differ in {key} ({metas[0][key]} and {m[key]})")
    order = _shard_order(dirs, metas)
    dirs, metas = [dirs[i] for i in order], [metas[i] for i in order]
    tokenizer = load_tokenizer(dirs[0] / "tokenizer.json", eod_id=first_eod)
    if tokenizer.vocab_size != metas[0]["vocab_size"]:
        raise DataError(
            f"{dirs[0] / 'meta.json'} says vocab_size {metas[0]['vocab_size']}, its tokenizer.json has "
            f"{tokenizer.vocab_size} (edited?)"
        )
    same_template(dirs, metas)
    train = [open_split(d, "train", m) for d, m in zip(dirs, metas, strict=True)]
    val_parts = [open_split(d, "val", m) for d, m in zip(dirs, metas, strict=True)]
    corpus = PreparedCorpus(dirs, metas, tokenizer, train, val_parts, TokenChain([v.tokens for v in val_parts]))
    if vocab_size is not None:
        if tokenizer.vocab_size > vocab_size:
            raise DataError(
                f"the tokenizer of {dirs[0]} has {tokenizer.vocab_size} ids, more than vocab_size {vocab_size}"
            )
        corpus.check_vocab(min(vocab_size, tokenizer.vocab_size))
    return corpus


def open_split(data_dir: Path, split: str, meta: dict) -> BinIdx:
    """A prepared directory's split ("train" or "val"), with its loss mask when meta.json (read and checked by
    read_prepared_meta) records masks."""
    opened = BinIdx(Path(data_dir) / split)
    if "mask" in meta:
        opened.mask = open_mask(Path(data_dir) / split, len(opened))
    return opened


def template_of(meta: dict) -> dict | None:
    """The chat template a prepared directory was rendered with (meta.json "template"), or None (documents only)."""
    t = meta.get("template")
    return t if isinstance(t, dict) else None


def same_template(dirs: list[Path], metas: list[dict]) -> None:
    """Directories with loss masks must have been rendered with one template (a directory without masks holds
    documents, whose every token carries loss whatever the template)."""
    first = None
    for d, m in zip(dirs, metas, strict=True):
        t = template_of(m)
        if t is None:
            continue
        if first is None:
            first = (d, t)
        elif t.get("sha256") != first[1].get("sha256"):
            raise DataError(
                f"{first[0]} and {d} were rendered with different chat templates ({first[1].get('name')} and "
                f"{t.get('name')}): prepare them with one"
            )


def _expand(paths) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise DataError("no prepared directories given")
    dirs: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            dirs.append(p)
        elif glob.has_magic(str(item)):
            matches = [Path(m) for m in sorted(glob.glob(str(item))) if Path(m).is_dir()]
            if not matches:
                raise DataError(f"no prepared directory matches {item}")
            dirs += matches
        elif p.exists():
            raise DataError(f"{p} is not a directory (a prepared directory holds meta.json, train.bin, ...)")
        else:
            raise DataError(f"prepared directory not found: {p}")
    seen: dict[Path, Path] = {}
    for d in dirs:
        key = d.resolve()
        if key in seen:
            raise DataError(f"{d} is listed twice (as {seen[key]} and {d})")
        seen[key] = d
    return dirs


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None


def _eod(meta: dict) -> int:
    tok = meta.get("tokenizer")
    eod = tok.get("eod_id", 0) if isinstance(tok, dict) else 0
    return eod if isinstance(eod, int) and not isinstance(eod, bool) else 0


def _shard_order(dirs: list[Path], metas: list[dict]) -> list[int]:
    """Indices in reading order; every sharded corpus complete, its shards by index where its first one stood."""
    groups: dict[str, dict[int, int]] = {}
    counts: dict[str, int] = {}
    for i, m in enumerate(metas):
        shard = m.get("shard")
        if not isinstance(shard, dict):
            continue
        cid, index, count = shard.get("corpus"), shard.get("index"), shard.get("count")
        if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
            raise DataError(f"{dirs[i] / 'meta.json'}: shard {shard!r} is not an index and a count")
        if counts.setdefault(cid, count) != count:
            raise DataError(
                f"{dirs[i]} is shard {index} of {count}, but another shard of its corpus says of {counts[cid]}"
            )
        group = groups.setdefault(cid, {})
        if index in group:
            raise DataError(f"{dirs[group[index]]} and {dirs[i]} are both shard {index} of {count} of one corpus")
        group[index] = i
    for cid, group in groups.items():
        missing = sorted(set(range(counts[cid])) - set(group))
        if missing:
            have = ", ".join(str(dirs[i]) for _, i in sorted(group.items()))
            raise DataError(
                f"shard{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {counts[cid]} "
                f"{'are' if len(missing) > 1 else 'is'} missing (given: {have}): the shards together are the corpus"
            )
    order, placed = [], set()
    for i, m in enumerate(metas):
        shard = m.get("shard")
        if not isinstance(shard, dict):
            order.append(i)
        elif shard["corpus"] not in placed:
            placed.add(shard["corpus"])
            order += [j for _, j in sorted(groups[shard["corpus"]].items())]
    return order
