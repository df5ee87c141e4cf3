"""Training windows drawn at random, and consecutive windows for evaluation.

A window is `ctx_len + 1` tokens `w`; the model reads `w[:-1]` and predicts `w[1:]`. The global batch of a step is
a function of (seed, step) alone, so a run resumes exactly and does not change with the number of ranks: rank r of
world_size takes rows r, r + world_size, ...
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


class WindowSampler:
    """Random `ctx_len + 1`-token windows of `tokens` (an array, or anything with `.tokens` such as BinIdx)."""

    def __init__(self, tokens, ctx_len: int, batch_size: int, seed: int = 0):
        if ctx_len < 1:
            raise ValueError(f"ctx_len must be >= 1, got {ctx_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokens = _as_array(tokens)
        if len(self.tokens) < ctx_len + 1:
            raise DataError(
                f"the corpus has {len(self.tokens)} tokens, fewer than one window of ctx_len + 1 = {ctx_len + 1}"
            )
        self.ctx_len = ctx_len
        self.batch_size = batch_size
        self.seed = seed
        self._offsets = np.arange(ctx_len + 1)

    def starts(self, step: int) -> np.ndarray:
        """The global batch's window starts at `step`: uniform over every full window."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.ctx_len, size=self.batch_size)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 `[batch_size // world_size, ctx_len]`: this rank's rows of the global batch, y = x shifted."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if self.batch_size % world_size:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by world_size {world_size}")
        starts = self.starts(step)[rank::world_size]
        w = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return w[:, :-1], w[:, 1:]


def sequential_windows(tokens, ctx_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive windows (x, y) of shape [1, <= ctx_len]: every token after the first is a target exactly once."""
    if ctx_len < 1:
        raise ValueError(f"ctx_len must be >= 1, got {ctx_len}")
    arr = _as_array(tokens)
    if len(arr) < 2:
        raise DataError(f"the split has {len(arr)} tokens; evaluation needs at least 2")
    for start in range(0, len(arr) - 1, ctx_len):
        w = torch.from_numpy(np.asarray(arr[start : start + ctx_len + 1]).astype(np.int64))[None]
        yield w[:, :-1], w[:, 1:]


class StreamSampler(WindowSampler):
    """Consecutive windows for truncated BPTT: row r reads its own stream, starting at a
    seeded random offset and advancing `ctx_len` tokens per step, so the recurrent state
    left by step s is the right context for step s + 1 (until the stream wraps around)."""

    def starts(self, step: int) -> np.ndarray:
        span = len(self.tokens) - self.ctx_len
        origin = np.random.default_rng([self.seed, 2**31]).integers(0, span, size=self.batch_size)
        return (origin + step * self.ctx_len) % span
