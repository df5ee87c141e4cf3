"""MoBA `tiled` backend: the selected (query, key chunk) pairs grouped by key chunk.

The `sparse` backend gathers, for every query, the keys of the chunks it
selected: each chunk's keys are copied once per query that picked it. Here the
pairs are sorted by key chunk and packed into tiles of TILE queries that share
one chunk, so each tile is a [TILE, N] x [N, c] matmul against a single copy of
that chunk's keys (the varlen layout of MoonshotAI's MoBA). Per pair we keep the
partial log-sum-exp and output; each query merges its pairs with its own causal
chunk by log-sum-exp. Autograd differentiates it all; what it saves is
O(T * top_k * (c + N)) per head. The selection is `sparse`'s, computed for
blocks of query chunks so its gate scores stay under SELECT_ELEMENTS. With cached
keys and values (the state), only the query chunks holding the new queries are
computed, against the keys of every token. Document starts lay the tokens out on
each document's own chunk grid, as in `sparse` (to_chunks), and restrict the
selection to the query's document.
"""

from __future__ import annotations

import math

import torch

from rwkvx_cli.ops.moba import document_begins, with_cache
from rwkvx_cli.ops.moba.sparse import _select, from_chunks, to_chunks

TILE = 32
SELECT_ELEMENTS = 1 << 22


def _pack(group: torch.Tensor, n_groups: int, tile: int):
    """Tiles for pairs labelled by `group` (any order): returns each pair's
    (tile, column), the group of every tile, and the number of tiles."""
    counts = torch.bincount(group, minlength=n_groups)
    tiles_per = (counts + tile - 1) // tile
    first_tile = torch.cumsum(tiles_per, 0) - tiles_per
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    first_pair = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(group.numel(), device=group.device) - first_pair[sorted_group]
    tile_of = first_tile[group] + rank // tile
    col_of = rank % tile
    tile_group = torch.repeat_interleave(torch.arange(n_groups, device=group.device), tiles_per)
    return tile_of, col_of, tile_group, int(tiles_per.sum())


def moba_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state,
    *,
    chunk_size: int,
    top_k: int,
    starts: torch.Tensor | None = None,
    cache_starts: torch.Tensor | None = None,
):
    B, T, H, N = q.shape
    c = chunk_size
    keys, values = with_cache(k, v, state)
    begins = document_begins(starts, cache_starts, B, keys.shape[1] - T, T, q.device)
    qc, kc, vc, first, slots, doc_first, where = to_chunks(q, keys, values, c, top_k, begins)
    n_chunks, nq = kc.shape[1], qc.shape[1]
    Z, Tq = B * H, nq * c
    scale = 1.0 / math.sqrt(N)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    s_own = (qc @ kc[:, first:].transpose(-1, -2) * scale).masked_fill(causal, -math.inf)
    lse_own = torch.logsumexp(s_own, dim=-1).reshape(-1)  # [Z*Tq]
    o_own = (torch.softmax(s_own, dim=-1) @ vc[:, first:]).reshape(-1, N)
    if slots == 0:
        y = o_own
    else:
        with torch.no_grad():
            # The gate scores ([c, n_chunks] per query chunk) are the one term above linear
            # in T: select for blocks of query chunks so they never exceed SELECT_ELEMENTS.
            nb = max(1, SELECT_ELEMENTS // (Z * c * n_chunks))
            idx = torch.cat(
                [
                    _select(qc[:, f : f + nb].detach(), kc.detach(), first + f, slots, doc_first)
                    for f in range(0, nq, nb)
                ],
                dim=1,
            ).reshape(Z, Tq, slots)
            query = torch.arange(Z * Tq, device=q.device).reshape(Z, Tq, 1).expand(Z, Tq, slots)
            group = torch.arange(Z, device=q.device).reshape(Z, 1, 1) * n_chunks + idx
            keep = idx >= 0
            pair_query, pair_group = query[keep], group[keep]
            tile_of, col_of, tile_group, n_tiles = _pack(pair_group, Z * n_chunks, TILE)
            tile_query = torch.zeros(n_tiles, TILE, dtype=torch.long, device=q.device)
            tile_query[tile_of, col_of] = pair_query  # padding slots read query 0 and are never used
        qt = qc.reshape(-1, N)[tile_query]  # [tiles, TILE, N]
        kt = kc.reshape(-1, c, N)[tile_group]  # [tiles, c, N]: one copy of the chunk per tile
        vt = vc.reshape(-1, c, N)[tile_group]
        st = qt @ kt.transpose(-1, -2) * scale
        lse_t = torch.logsumexp(st, dim=-1)
        ot = torch.softmax(st, dim=-1) @ vt
        pair_lse, pair_out = lse_t[tile_of, col_of], ot[tile_of, col_of]
        # Merge by log-sum-exp; the shift m is a constant for the gradient.
        m = lse_own.detach().scatter_reduce(0, pair_query, pair_lse.detach(), reduce="amax")
        total = torch.exp(lse_own - m).index_add(0, pair_query, torch.exp(pair_lse - m[pair_query]))
        lse = m + torch.log(total)
        y = torch.exp(lse_own - lse)[:, None] * o_own
        y = y.index_add(0, pair_query, torch.exp(pair_lse - lse[pair_query])[:, None] * pair_out)
    return from_chunks(y, q, where), (keys, values)
