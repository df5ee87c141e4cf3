"""Training windows (random, one pass per epoch, streams, weighted mixtures) and consecutive windows for evaluation.

A window is `ctx_len + 1` tokens `w`; the model reads `w[:-1]` and predicts `w[1:]`. The global batch of a step is
a function of (seed, step) alone, so a run resumes exactly and does not change with the number of ranks: rank r of
world_size takes rows r, r + world_size, ... Every sampler has `batch(step, rank, world_size)`, `starts(step)` and
`epoch(step)`.

Given loss masks (a byte per token, masks.py), `target_masks(step, rank, world_size)` gives the masks of the
targets `w[1:]` of this rank's rows and the count of targets that carry loss in the whole global batch, which every
rank computes alike from (seed, step): the loss's denominator, known before the forward and without communication.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from rwkvx_cli.data.errors import DataError


def _as_array(tokens) -> np.ndarray:
    arr = tokens.tokens if hasattr(tokens, "tokens") else tokens
    if isinstance(arr, torch.Tensor):
        arr = arr.numpy()
    arr = np.asarray(arr)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise DataError(f"token ids must be integers, got {arr.dtype} values")
    return arr


def _check_masks(masks, tokens) -> None:
    if masks is not None and len(masks) != len(tokens):
        raise DataError(f"a loss mask of {len(masks)} bytes for {len(tokens)} tokens")


class WindowSampler:
    """Random `ctx_len + 1`-token windows of `tokens` (an array, or anything with `.tokens` such as BinIdx), and
    of their loss masks `masks` (the same length; None: every target carries loss)."""

    def __init__(self, tokens, ctx_len: int, batch_size: int, seed: int = 0, masks=None):
        if ctx_len < 1:
            raise ValueError(f"ctx_len must be >= 1, got {ctx_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokens = _as_array(tokens)
        if len(self.tokens) < ctx_len + 1:
            raise DataError(
                f"the corpus has {len(self.tokens)} tokens, fewer than one window of ctx_len + 1 = {ctx_len + 1}"
            )
        _check_masks(masks, self.tokens)
        self.masks = masks
        self.ctx_len = ctx_len
        self.batch_size = batch_size
        self.seed = seed
        self._offsets = np.arange(ctx_len + 1)
        self.n_windows = (len(self.tokens) - 1) // ctx_len  # non-overlapping windows: one epoch of targets

    def epoch(self, step: int) -> int:
        """The epoch that `step` is in: samples drawn before it over the windows in one pass (for display)."""
        return step * self.batch_size // self.n_windows

    def starts(self, step: int) -> np.ndarray:
        """The global batch's window starts at `step`: uniform over every full window."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.ctx_len, size=self.batch_size)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 `[batch_size // world_size, ctx_len]`: this rank's rows of the global batch, y = x shifted."""
        _check_rank(self.batch_size, rank, world_size)
        starts = self.starts(step)[rank::world_size]
        w = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return w[:, :-1], w[:, 1:]

    def target_masks(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, int] | None:
        """(bool `[batch_size // world_size, ctx_len]`: which of this rank's targets carry loss, the count of those
        in the whole global batch), or None without masks."""
        if self.masks is None:
            return None
        _check_rank(self.batch_size, rank, world_size)
        m = np.asarray(self.masks[self.starts(step)[:, None] + self._offsets[1:]]) != 0
        return torch.from_numpy(m[rank::world_size]), int(m.sum())


def _check_rank(batch_size: int, rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} is not divisible by world_size {world_size}")


_FEISTEL_ROUNDS = 8
_U = np.uint64


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a cheap, well-mixing hash of uint64 values (wrapping arithmetic)."""
    z = (z ^ (z >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U(27))) * _U(0x94D049BB133111EB)
    return z ^ (z >> _U(31))


def permute(index, n: int, seed: int, epoch: int) -> np.ndarray:
    """`index` (values in [0, n)) mapped by a bijection of range(n) that is a pure function of (seed, epoch).

    A balanced Feistel network over [0, 4^h) with 4^h >= n is a bijection whatever its round function; values that
    land outside [0, n) are mapped again until they fall inside ("cycle walking"), which keeps it a bijection of
    range(n) and takes under 4 rounds on average.
    """
    x = np.asarray(index, dtype=np.int64)
    shape, x = x.shape, x.reshape(-1)
    if x.size and (int(x.min()) < 0 or int(x.max()) >= n):
        raise ValueError(f"indices must be in [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = _U((1 << half) - 1)
    keys = np.random.SeedSequence([seed, epoch, 0x5EED]).generate_state(_FEISTEL_ROUNDS, np.uint64)

    def rounds(v: np.ndarray) -> np.ndarray:
        left, right = v >> _U(half), v & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << _U(half)) | right

    y = rounds(x.astype(np.uint64))
    out = y >= _U(n)
    while out.any():
        y[out] = rounds(y[out])
        out = y >= _U(n)
    return y.astype(np.int64).reshape(shape)


class EpochSampler(WindowSampler):
    """One pass per epoch: the `n_windows = (len - 1) // ctx_len` non-overlapping windows, each exactly once per
    epoch, in a seeded pseudo-random order (`permute`). Global sample g (row j of step s is g = s * batch_size + j)
    is window `permute(g % n_windows, seed, epoch = g // n_windows)`, so a batch may straddle two epochs and any
    step is computed without the ones before it. With `shift`, each epoch moves all windows by the same seeded
    offset within the tokens that do not fill a window, so the left-over tail is not the same every epoch."""

    def __init__(self, tokens, ctx_len: int, batch_size: int, seed: int = 0, shift: bool = True, masks=None):
        super().__init__(tokens, ctx_len, batch_size, seed, masks)
        self.shift = shift
        self.slack = len(self.tokens) - 1 - self.n_windows * ctx_len

    def offset(self, epoch: int) -> int:
        if not self.shift or self.slack == 0:
            return 0
        return int(np.random.default_rng([self.seed, epoch, 0x5EED]).integers(0, self.slack + 1))

    def sample_starts(self, samples) -> np.ndarray:
        """Window starts of global sample indices (any int array)."""
        g = np.asarray(samples, dtype=np.int64)
        epochs, index = np.divmod(g, self.n_windows)
        out = np.empty_like(g)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = self.offset(e) + permute(index[sel], self.n_windows, self.seed, e) * self.ctx_len
        return out

    def starts(self, step: int) -> np.ndarray:
        return self.sample_starts(step * self.batch_size + np.arange(self.batch_size))


def sequential_windows(tokens, ctx_len: int, masks=None) -> Iterator[tuple[torch.Tensor, ...]]:
    """Consecutive windows (x, y) of shape [1, <= ctx_len]: every token after the first is a target exactly once.
    With `masks` (a byte per token), (x, y, m): m bool, which targets carry loss."""
    if ctx_len < 1:
        raise ValueError(f"ctx_len must be >= 1, got {ctx_len}")
    arr = _as_array(tokens)
    _check_masks(masks, arr)
    if len(arr) < 2:
        raise DataError(f"the split has {len(arr)} tokens; evaluation needs at least 2")
    for start in range(0, len(arr) - 1, ctx_len):
        w = torch.from_numpy(np.asarray(arr[start : start + ctx_len + 1]).astype(np.int64))[None]
        if masks is None:
            yield w[:, :-1], w[:, 1:]
        else:
            m = torch.from_numpy(np.asarray(masks[start + 1 : start + ctx_len + 1]) != 0)[None]
            yield w[:, :-1], w[:, 1:], m


class MixtureSampler:
    """Windows from several token sources in proportion to `weights`, every batch a pure function of (seed, step).

    Global samples come in rounds of `round_size`: source s gets `r_s` of each round's slots (its weight share,
    rounded by largest remainder, at least 1), placed by a seeded shuffle of the round. Sample g of the mixture is
    thus the c-th sample of its source, with c computed from g alone, and each source is read by its own
    `EpochSampler` (one pass per epoch of that source, seeded by (seed, source index)).
    """

    def __init__(
        self, sources, weights, ctx_len: int, batch_size: int, seed: int = 0, round_size: int = 4096, masks=None
    ):
        """`masks`: None, or each source's loss mask (None for a source without: every target carries loss)."""
        sources, weights = list(sources), [float(w) for w in weights]
        if not sources:
            raise DataError("a data mixture needs at least one source")
        if len(weights) != len(sources):
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(f"mixture weights must be finite, >= 0 and not all 0, got {weights}")
        keep = [i for i, w in enumerate(weights) if w > 0]
        if round_size < len(keep):
            raise ValueError(f"round_size {round_size} is smaller than the {len(keep)} weighted sources")
        self.ctx_len, self.batch_size, self.seed, self.round_size = ctx_len, batch_size, seed, round_size
        # Every source keeps its sampler (and so its seed stream) by index; zero-weight ones are never drawn.
        if masks is not None and len(masks) != len(sources):
            raise ValueError(f"{len(sources)} sources but {len(masks)} masks")
        self.masks = masks
        self.samplers = [
            EpochSampler(src, ctx_len, 1, seed=_source_seed(seed, i), masks=None if masks is None else masks[i])
            for i, src in enumerate(sources)
        ]
        total = sum(weights)
        share = np.array([weights[i] / total * round_size for i in keep])
        slots = np.maximum(np.floor(share).astype(np.int64), 1)
        while slots.sum() < round_size:
            slots[int(np.argmax(share - slots))] += 1
        while slots.sum() > round_size:
            slots[int(np.argmax(np.where(slots > 1, slots - share, -np.inf)))] -= 1
        self.slots = np.zeros(len(sources), dtype=np.int64)
        self.slots[keep] = slots
        self.weights = self.slots / round_size  # the proportions actually drawn
        self._layout = np.repeat(np.arange(len(sources)), self.slots)
        self._offsets = np.arange(ctx_len + 1)
        self._rounds: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _round(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, its rank among that source's slots) in round r."""
        got = self._rounds.get(r)
        if got is None:
            src = np.random.default_rng([self.seed, r, 0x313]).permutation(self._layout)
            order = np.argsort(src, kind="stable")
            first = np.concatenate([[0], np.cumsum(self.slots)[:-1]])
            rank = np.empty_like(src)
            rank[order] = np.arange(len(src)) - first[src[order]]
            if len(self._rounds) > 4:
                self._rounds.clear()
            got = self._rounds[r] = (src, rank)
        return got

    def sample_sources(self, samples) -> tuple[np.ndarray, np.ndarray]:
        """(source index, that source's own sample count) of global sample indices."""
        g = np.asarray(samples, dtype=np.int64)
        rounds, slot = np.divmod(g, self.round_size)
        source, count = np.empty_like(g), np.empty_like(g)
        for r in np.unique(rounds).tolist():
            sel = rounds == r
            src, rank = self._round(r)
            source[sel] = src[slot[sel]]
            count[sel] = r * self.slots[source[sel]] + rank[slot[sel]]
        return source, count

    def starts(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window start) of each row of the global batch at `step`."""
        source, count = self.sample_sources(step * self.batch_size + np.arange(self.batch_size))
        starts = np.empty_like(count)
        for s in np.unique(source).tolist():
            sel = source == s
            starts[sel] = self.samplers[s].sample_starts(count[sel])
        return source, starts

    def source_epochs(self, step: int) -> list[float]:
        """Passes made over each source before `step` (fractional)."""
        drawn = step * self.batch_size * self.weights
        return [float(d / s.n_windows) for d, s in zip(drawn, self.samplers, strict=True)]

    def epoch(self, step: int) -> int:
        """Passes over the mixture's data by volume: samples drawn over the windows of all weighted sources."""
        windows = sum(s.n_windows for s, n in zip(self.samplers, self.slots, strict=True) if n)
        return step * self.batch_size // windows

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        _check_rank(self.batch_size, rank, world_size)
        source, starts = self.starts(step)
        source, starts = source[rank::world_size], starts[rank::world_size]
        w = np.empty((len(starts), self.ctx_len + 1), dtype=np.int64)
        for s in np.unique(source).tolist():
            sel = source == s
            w[sel] = self.samplers[s].tokens[starts[sel][:, None] + self._offsets]
        w = torch.from_numpy(w)
        return w[:, :-1], w[:, 1:]

    def target_masks(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, int] | None:
        """As WindowSampler.target_masks; a source without a mask carries loss at every target."""
        if self.masks is None:
            return None
        _check_rank(self.batch_size, rank, world_size)
        source, starts = self.starts(step)
        m = np.ones((len(starts), self.ctx_len), dtype=bool)
        for s in np.unique(source).tolist():
            sel = source == s
            if self.samplers[s].masks is not None:
                m[sel] = np.asarray(self.samplers[s].masks[starts[sel][:, None] + self._offsets[1:]]) != 0
        return torch.from_numpy(m[rank::world_size]), int(m.sum())


def _source_seed(seed: int, i: int) -> int:
    return int(np.random.SeedSequence([seed, i, 0x313]).generate_state(1, np.uint64)[0])


class StreamSampler(WindowSampler):
    """Consecutive windows for truncated BPTT: row r reads its own stream, starting at a
    seeded random offset and advancing `ctx_len` tokens per step, so the recurrent state
    left by step s is the right context for step s + 1 (until the stream wraps around)."""

    def starts(self, step: int) -> np.ndarray:
        span = len(self.tokens) - self.ctx_len
        origin = np.random.default_rng([self.seed, 2**31]).integers(0, span, size=self.batch_size)
        return (origin + step * self.ctx_len) % span


def documents(tokens, eod_id: int, chunk: int = 1 << 24) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every document of `tokens` that has a target: it starts at position 0 or after an
    end-of-document id, and ends at its own end-of-document id (included: the prediction that ends it) or
    at the last token; an empty one (an id `eod_id` right after another) has no target and is left out.
    Read in pieces, so that a large memory map is never compared whole."""
    arr = _as_array(tokens)
    n = len(arr)
    found = [np.flatnonzero(np.asarray(arr[lo : lo + chunk]) == eod_id) + lo for lo in range(0, n, chunk)]
    eods = np.concatenate(found).astype(np.int64) if found else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], eods + 1]).astype(np.int64)
    starts = starts[starts < n]
    following = np.searchsorted(eods, starts)  # each start's own end-of-document id, where one follows
    ends = np.full(len(starts), n - 1, dtype=np.int64)
    ends[following < len(eods)] = eods[following[following < len(eods)]]
    keep = ends > starts
    return starts[keep], ends[keep]


class DocumentSampler:
    """train.sampler=documents: every row starts at a document's start and reads `ctx_len + 1` tokens from
    there; the targets past the document's end (its end-of-document id, which carries loss) carry none,
    whatever the tokens there are (the next documents', or the last token repeated past the split's end),
    and a document longer than the window trains on its first `ctx_len` targets (RWKV-PEFT's `pad` rows).
    Global sample g (row j of step s is g = s * batch_size + j) is document `permute(g % n, seed, epoch =
    g // n)` of the n documents: each once per epoch, in a seeded order, any step computed without the
    ones before it. Always gives target masks (the document's extent, and the loss masks where given), so
    the loss is the mean over the global batch's targets that carry loss (docs/training.md#loss-masks)."""

    def __init__(self, tokens, eod_id: int, ctx_len: int, batch_size: int, seed: int = 0, masks=None):
        if ctx_len < 1:
            raise ValueError(f"ctx_len must be >= 1, got {ctx_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokens = _as_array(tokens)
        _check_masks(masks, self.tokens)
        self.masks, self.ctx_len, self.batch_size, self.seed = masks, ctx_len, batch_size, seed
        self.doc_starts, self.doc_ends = documents(self.tokens, eod_id)
        if not len(self.doc_starts):
            raise DataError(f"the split holds no document with a token to predict (end-of-document id {eod_id})")
        self.n_windows = len(self.doc_starts)  # one epoch: every document once
        self._offsets = np.arange(ctx_len + 1)

    def epoch(self, step: int) -> int:
        return step * self.batch_size // self.n_windows

    def rows(self, step: int) -> np.ndarray:
        """The documents of the global batch at `step`."""
        g = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        epochs, index = np.divmod(g, self.n_windows)
        out = np.empty_like(g)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = permute(index[sel], self.n_windows, self.seed, e)
        return out

    def starts(self, step: int) -> np.ndarray:
        return self.doc_starts[self.rows(step)]

    def _positions(self, docs: np.ndarray) -> np.ndarray:
        return np.minimum(self.doc_starts[docs][:, None] + self._offsets, len(self.tokens) - 1)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        _check_rank(self.batch_size, rank, world_size)
        docs = self.rows(step)[rank::world_size]
        w = torch.from_numpy(np.asarray(self.tokens[self._positions(docs)]).astype(np.int64))
        return w[:, :-1], w[:, 1:]

    def target_masks(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, int]:
        """(bool [rows, ctx_len]: which of this rank's targets carry loss, their count in the global batch)."""
        _check_rank(self.batch_size, rank, world_size)
        docs = self.rows(step)
        m = document_masks(self.doc_starts[docs], self.doc_ends[docs], self.ctx_len, self.masks)
        return torch.from_numpy(m[rank::world_size]), int(m.sum())


def document_masks(starts: np.ndarray, ends: np.ndarray, ctx_len: int, masks=None) -> np.ndarray:
    """bool [rows, ctx_len]: the targets of rows read from `starts` that lie in their document (up to its
    `ends`, included) and carry loss by `masks` (None: all)."""
    positions = starts[:, None] + np.arange(1, ctx_len + 1)
    inside = positions <= ends[:, None]
    if masks is not None:
        m = np.asarray(masks[np.minimum(positions, len(masks) - 1)]) != 0
        inside &= m
    return inside


def document_windows(tokens, eod_id: int, ctx_len: int, max_tokens: int, masks=None):
    """Evaluation of train.sampler=documents: each document that starts among the first `max_tokens` tokens,
    read alone from its start (up to `ctx_len` targets): (x [1, ctx_len], y, m bool [1, ctx_len]: the
    targets that lie in the document and carry loss by `masks`, the count of its targets in the window).
    Past the split's end the last token is repeated (m false)."""
    arr = _as_array(tokens)
    _check_masks(masks, arr)
    starts, ends = documents(arr, eod_id)
    offsets = np.arange(ctx_len + 1)
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if s >= max_tokens:
            break
        w = torch.from_numpy(np.asarray(arr[np.minimum(s + offsets, len(arr) - 1)]).astype(np.int64))[None]
        m = document_masks(np.array([s]), np.array([e]), ctx_len, masks)
        yield w[:, :-1], w[:, 1:], torch.from_numpy(m), min(e - s, ctx_len)
