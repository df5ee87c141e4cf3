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
promised to agree between backends). No positional encoding.

State: the keys and values of the P tokens read before, (k_cache, v_cache),
each [B, P, H, N] (P >= 0; None: P = 0). The queries then sit at positions
P .. P + T - 1 and attend keys 0 .. P + T - 1 by the same rule, so a sequence
read in pieces, each from the state the last one returned, gives what reading
it whole gives (chunked BPTT and incremental generation, models/layers/moba.py).
The state out is the keys and values of all P + T tokens; the gradient reaches
the cache as it reaches k and v. The gate's chunk means are recomputed from
the cache at each call.

Document starts (docs/operators.md#document-starts): `starts`, a bool [B, T],
True where a token begins a document. The state before it is the zero state,
the empty cache: a query attends no key before the latest start at or before
it, in the window or in the cache, and the chunk grid (the causal current
chunk, the earlier chunks and their means) is counted from that start, so a
packed row gives each document what it gives run alone from an empty cache.
The cache keeps every key it read (a row cannot be trimmed alone: rows start
documents at different tokens), so a call must be told where the cache's
ongoing document began: `cache_starts`, a bool [B, P], the starts of the
cached tokens as they were given (None: none). The state after a call is
continued by `cache_starts = cat([cache_starts, starts], 1)`, which is what
the layer keeps beside the cache (models/layers/moba.py); the registry's
`starts` stays the one [B, T] of every op, and its states stay (k_cache,
v_cache). The keys before a row's latest start are dead: no later call reads
them, and the backends leave them out of their work. The registry entry
(backends, gradient-check sampler and cases) is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_same_layout, check_starts
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("q", "k", "v")
STATES = ("k_cache", "v_cache")


def moba(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    chunk_size: int,
    top_k: int,
    starts: torch.Tensor | None = None,
    cache_starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """MoBA attention over [B, T, H, N] inputs after the cached keys and values `state`; returns
    y [B, T, H, N] in the input dtype and the state after them (the keys and values of every token).
    `starts` (bool [B, T]) and `cache_starts` (bool [B, P], the cached tokens'): document starts."""
    check_same_layout(INPUTS, (q, k, v), ndim=4)
    if min(q.shape) < 1:
        raise ValueError(f"moba needs every dimension >= 1, got [B, T, H, N] = {list(q.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an int, got {top_k!r}")
    if state is None:
        state = (k[:, :0], v[:, :0])
    check_cache(state, q)
    B, T = q.shape[:2]
    starts = check_starts(starts, B, T, q.device)
    if cache_starts is not None:
        check_cache_starts(cache_starts, B, state[0].shape[1])
    spec = get_op("moba")
    bk = resolve_backend(spec, backend, q.device)
    x, extra = spec.with_starts(bk, dict(zip(INPUTS, (q, k, v), strict=True)), starts)
    if cache_starts is not None:
        extra["cache_starts"] = cache_starts.to(q.device)
    return bk.fn(*x.values(), state, chunk_size=chunk_size, top_k=top_k, **extra)


def check_cache_starts(cache_starts, B: int, P: int) -> None:
    """The cached tokens' document starts: a bool [B, P]."""
    if not isinstance(cache_starts, torch.Tensor):
        raise ValueError(f"cache_starts must be a torch.Tensor, got {type(cache_starts).__name__}")
    if cache_starts.dtype != torch.bool:
        raise ValueError(f"cache_starts must be a bool tensor, got {cache_starts.dtype}")
    if tuple(cache_starts.shape) != (B, P):
        raise ValueError(f"cache_starts must have shape {(B, P)} ([B, P]), got {tuple(cache_starts.shape)}")


def check_cache(state, q: torch.Tensor) -> None:
    """A (k_cache, v_cache) pair of [B, P, H, N] tensors, the batch, heads and device of `q`."""
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise ValueError("the moba state must be a pair (k_cache, v_cache)")
    B, _, H, N = q.shape
    for name, t in zip(STATES, state, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or (t.shape[0], t.shape[2], t.shape[3]) != (B, H, N):
            raise ValueError(f"{name} must have shape [{B}, P, {H}, {N}], got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but the inputs are on {q.device}")
    if state[0].shape != state[1].shape:
        raise ValueError(f"k_cache has shape {tuple(state[0].shape)} but v_cache has {tuple(state[1].shape)}")


def with_cache(k: torch.Tensor, v: torch.Tensor, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of every token: the cache (in the inputs' dtype) followed by k and v."""
    k_cache, v_cache = state
    if k_cache.shape[1] == 0:
        return k, v
    return torch.cat([k_cache.to(k.dtype), k], dim=1), torch.cat([v_cache.to(v.dtype), v], dim=1)


def document_begins(starts, cache_starts, B: int, P: int, T: int, device) -> torch.Tensor | None:
    """[B, P + T] long: the position (among the cache's P tokens and the T new ones) where each
    token's document begins, 0 before any start; None when neither `starts` [B, T] nor
    `cache_starts` [B, P] is given (one document: the op without starts)."""
    if starts is None and cache_starts is None:
        return None
    flags = torch.zeros(B, P + T, dtype=torch.bool, device=device)
    if cache_starts is not None:
        flags[:, :P] = cache_starts.to(device)
    if starts is not None:
        flags[:, P:] = starts.to(device)
    pos = torch.arange(P + T, device=device)
    return torch.where(flags, pos, 0).cummax(dim=1).values
