"""Learning rate by tokens seen (`train.lr_schedule`): a linear warmup over warmup_tokens (from 1% of
train.lr), then

- "cosine": a cosine from train.lr down to lr_final at train.tokens (RWKV-LM's schedule);
- "wsd", warmup-stable-decay (MiniCPM, arXiv 2404.06395): train.lr held until the last
  decay_tokens (0: the last fifth of the run), which decay to lr_final, shaped by decay_shape:
  "linear", "1-sqrt" (1 - sqrt(p), Hägele et al., arXiv 2405.18392: lower loss than linear at the
  same length) or "cosine". A stable phase does not depend on where the run will end, so a run
  can be continued, or a decay branched from any of its stable checkpoints (`train.decay_from`),
  as if it had been planned that long from the start.
"""

import math

from rwkvx_cli.config import TrainConfig

DECAY_FRACTION = 0.2  # of the run, when train.decay_tokens is 0


def decay_tokens(t: TrainConfig) -> int:
    """The length of WSD's decay: train.decay_tokens, or a fifth of the run."""
    return t.decay_tokens or int(DECAY_FRACTION * t.tokens)


def decay_start(t: TrainConfig) -> int:
    """Where WSD's decay begins (never inside the warmup); cosine decays from the warmup's end."""
    if t.lr_schedule == "cosine":
        return t.warmup_tokens
    return max(t.tokens - decay_tokens(t), t.warmup_tokens)


def lr_at(tokens: int, t: TrainConfig) -> float:
    if t.warmup_tokens > 0 and tokens < t.warmup_tokens:
        return t.lr * (0.01 + 0.99 * tokens / t.warmup_tokens)
    start = decay_start(t)
    progress = min(max((tokens - start) / max(t.tokens - start, 1), 0.0), 1.0)
    if t.lr_schedule == "cosine" or t.decay_shape == "cosine":
        return t.lr_final + 0.5 * (t.lr - t.lr_final) * (1.0 + math.cos(math.pi * progress))
    keep = 1.0 - progress if t.decay_shape == "linear" else 1.0 - math.sqrt(progress)
    return t.lr_final + (t.lr - t.lr_final) * keep
