"""Peer implementations of the same math, for comparison rows in `rwkvx bench`
(and `rwkvx gradcheck --backend fla`): fla's `chunk_rwkv7` when the
flash-linear-attention package is installed. Never picked by "auto"."""

from __future__ import annotations

import importlib


def fla_unavailable() -> str | None:
    try:
        importlib.import_module("fla.ops.rwkv7")
    except ImportError:
        return "fla (flash-linear-attention) is not installed"
    return None


def wkv7_fla(r, w, k, v, a, b, state):
    """fla's chunked DPLR kernel. fla keeps the state as [key, value], ours is
    [value, key]; both take `w` as the log-decay and `r` unscaled (scale 1)."""
    from fla.ops.rwkv7 import chunk_rwkv7

    y, s_out = chunk_rwkv7(
        r, w, k, v, a, b, scale=1.0, initial_state=state.transpose(-1, -2).contiguous(), output_final_state=True
    )
    return y, s_out.transpose(-1, -2)
