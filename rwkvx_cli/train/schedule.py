"""Learning rate by tokens seen: linear warmup, then cosine down to lr_final."""

import math


def lr_at(tokens: int, lr: float, lr_final: float, warmup_tokens: int, total_tokens: int) -> float:
    if warmup_tokens > 0 and tokens < warmup_tokens:
        return lr * (0.01 + 0.99 * tokens / warmup_tokens)
    span = max(total_tokens - warmup_tokens, 1)
    progress = min(max((tokens - warmup_tokens) / span, 0.0), 1.0)
    return lr_final + 0.5 * (lr - lr_final) * (1.0 + math.cos(math.pi * progress))
