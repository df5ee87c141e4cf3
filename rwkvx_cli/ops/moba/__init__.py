"""moba: mixture-of-block sparse causal attention (RWKV-X hybrid layers; docs/operators.md#moba).

Per batch and head, with chunk size c and scale 1/sqrt(N), query t in chunk
ct = t // c attends:
- its own chunk causally (keys ct*c .. t), always;
- the `top_k` earlier chunks j < ct with the best gate score q_t · mean(K_j),
  computed in fp32 or better.

`top_k` counts earlier chunks only; the current chunk comes on top (seed 000's
convention; MoonshotAI's MoBA counts the current chunk inside top_k, so their
top_k = ours + 1). With `top_k <= 0`, or `top_k >= ct`, every earlier chunk is
kept, and with `top_k >= T / c` the op is dense causal softmax attention.
Softmax runs over the selected keys only; the others get weight exactly 0. The
selection is a hard top-k: the backward treats it as fixed. Exact ties are
broken by torch.topk (deterministic for a given input and device, but not
promised to agree between backends). No positional encoding. The registry
entry (backends, gradient-check sampler and cases) is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_same_layout
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("q", "k", "v")


def moba(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int,
    top_k: int,
    backend: str = "auto",
) -> torch.Tensor:
    """MoBA attention over [B, T, H, N] inputs; returns y [B, T, H, N] in the input dtype."""
    check_same_layout(INPUTS, (q, k, v), ndim=4)
    if min(q.shape) < 1:
        raise ValueError(f"moba needs every dimension >= 1, got [B, T, H, N] = {list(q.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an int, got {top_k!r}")
    bk = resolve_backend(get_op("moba"), backend, q.device)
    return bk.fn(q, k, v, chunk_size=chunk_size, top_k=top_k)
