"""Document starts (docs/operators.md#document-starts), what every op shares.

An op takes `starts`, a bool [B, T], True where a token begins a document: the state before that
token is the zero state. A recurrence whose state enters each step only through a per-token factor
resets exactly by its inputs: the factor made 0 at the start (OpSpec.reset_inputs), so no kernel
changes; the factor's own gradient there is then 0, as it is in the definition, where it touches
nothing.
"""

from __future__ import annotations

import torch

# The log-decay (log-gate) of a token that starts a document: exp() of it is 0 in every float type
# (bf16 included), and it is finite, so the chunked forms' sums of log-decays stay finite (wkv7's
# triton_chunked clamps it to its W_MIN = -60: e^-60, 1e-26 of the state, is what it carries over).
RESET_LOG_DECAY = -1e4


def at_starts(x: torch.Tensor, starts: torch.Tensor, value: float) -> torch.Tensor:
    """x [B, T, ...] with `value` at the times where starts [B, T] is True (a new tensor)."""
    return x.masked_fill(starts.view(*starts.shape, *(1,) * (x.dim() - 2)), value)
