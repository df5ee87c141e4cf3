"""The moba registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#moba)."""

from __future__ import annotations

import math

import torch

from rwkvx_cli.ops._backends import backend_table, reference_backend
from rwkvx_cli.ops.moba import INPUTS, STATES, document_begins, moba
from rwkvx_cli.ops.moba.reference import gate_scores, moba_reference
from rwkvx_cli.ops.moba.sparse import moba_sparse
from rwkvx_cli.ops.moba.tiled import moba_tiled
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, Tensors, register


def _gate_margin(
    q: torch.Tensor,
    k: torch.Tensor,
    chunk_size: int,
    top_k: int,
    k_cache: torch.Tensor | None = None,
    begins: torch.Tensor | None = None,
) -> float:
    """Smallest gap between the top_k-th best gate score and the next one, over the
    queries whose selection is a real choice (inf when there is none); the queries follow
    the `k_cache` tokens, whose keys are candidates too, and the chunks are those of the
    documents `begins` (document_begins; None: one document)."""
    keys = k if k_cache is None else torch.cat([k_cache, k], dim=1)
    if top_k <= 0 or top_k >= keys.shape[1]:
        return math.inf
    best = gate_scores(q, keys, begins, chunk_size)[0].topk(top_k + 1, dim=-1).values
    gap = (best[..., top_k - 1] - best[..., top_k])[best[..., top_k] > -math.inf]
    return gap.min().item() if gap.numel() else math.inf


def _cache_starts(case: Case) -> torch.Tensor | None:
    """The case's cached tokens' document starts (option `cache_starts`, by batch row as
    Case.starts), a bool [B, prefix]; None without the option."""
    rows = case.options.get("cache_starts")
    if rows is None:
        return None
    mask = torch.zeros(case.dims["B"], int(case.options["prefix"]), dtype=torch.bool)
    for i in range(mask.shape[0]):
        mask[i, list(rows[i % len(rows)])] = True
    return mask


def _begins(case: Case) -> torch.Tensor | None:
    """The case's document_begins (None without document starts)."""
    B, T, P = case.dims["B"], case.dims["T"], int(case.options.get("prefix", 0))
    return document_begins(case.starts_mask(), _cache_starts(case), B, P, T, "cpu")


def _kwargs(case: Case) -> dict[str, object]:
    kwargs = {"chunk_size": case.options["chunk_size"], "top_k": case.options["top_k"]}
    cache_starts = _cache_starts(case)
    return kwargs if cache_starts is None else {**kwargs, "cache_starts": cache_starts}


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """q, k uniform in ±qk, v in ±v: small enough that fp32 rounding stays under the
    gates' 1e-6 floor, large enough that every gradient is non-vacuous. The state is the
    keys and values of `prefix` earlier tokens (option, default 0: an empty cache), drawn
    alike; their document starts are the option `cache_starts`.

    The hard top-k is not differentiable where two gate scores tie, so draws are
    repeated until the selection margin exceeds `min_gap`: above fp32 rounding for
    gate A, above what gate B's finite-difference steps can move a score. (After
    100 draws the last is used, and a flipped selection shows up in the gates.)"""
    B, T, H, N = (case.dims[d] for d in "BTHN")
    P = int(case.options.get("prefix", 0))
    qk, v_scale = float(case.options.get("qk", 0.7)), float(case.options.get("v", 0.04))
    min_gap = float(case.options.get("min_gap", 1e-5))

    def uniform(scale, length):
        return scale * (2.0 * torch.rand((B, length, H, N), generator=gen, dtype=torch.float64) - 1.0)

    c, top_k, begins = case.options["chunk_size"], case.options["top_k"], _begins(case)
    for _ in range(100):
        x = {"q": uniform(qk, T), "k": uniform(qk, T), "v": uniform(v_scale, T)}
        x |= {"k_cache": uniform(qk, P), "v_cache": uniform(v_scale, P)}
        if min_gap <= 0:  # no margin asked for (bench): skip the [B, H, T, P + T] gate
            break
        if _gate_margin(x["q"].float(), x["k"].float(), c, top_k, x["k_cache"].float(), begins) > min_gap:
            break
    return x


def _flops(dims: dict[str, int], mode: str) -> float:
    """4 N per attended (query, key) pair forward (q·k and p·v), 8 N more backward;
    the gate scores are not counted. Queries follow `prefix` cached tokens (default 0); with
    `starts_every` (bench --starts-every) a document begins every that many tokens from the
    first query, so the pairs are counted within each document (the cache is not read)."""
    T, c, top_k, P = dims["T"], dims["chunk_size"], dims["top_k"], dims.get("prefix", 0)
    every = dims.get("starts_every", 0)
    pairs = 0
    for t in range(P, P + T):
        if every:
            t = (t - P) % every  # the position in its document
        ct = t // c
        earlier = ct if top_k <= 0 else min(top_k, ct)
        pairs += earlier * c + t % c + 1
    per = 4 if mode == "fwd" else 12
    return float(per * dims["N"] * pairs * dims["B"] * dims["H"])


# The document starts of the last case and of the finite-difference case (see there).
DOC_STARTS = {"starts": ((0, 5, 13, 14, 36), (15, 32), ()), "cache_starts": ((2,), (6,), ())}
FD_STARTS = {"starts": ((6,),), "cache_starts": ((1,),)}


def _case(name, B, T, H, N, chunk_size, top_k, starts=(), **options):
    options = {"chunk_size": chunk_size, "top_k": top_k, **options}
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, options=options, starts=starts)


SPEC = register(
    OpSpec(
        name="moba",
        summary="mixture-of-block sparse causal attention",
        fn=moba,
        inputs=INPUTS,
        states=STATES,
        sample=_sample,
        cases=(
            _case("canonical", 1, 32, 1, 16, chunk_size=8, top_k=2),
            _case("multihead", 1, 32, 4, 16, chunk_size=8, top_k=2),
            _case("batched", 3, 32, 2, 16, chunk_size=8, top_k=2),
            _case("ragged_T", 2, 37, 2, 16, chunk_size=8, top_k=2),
            _case("sparse_top1", 1, 64, 2, 16, chunk_size=4, top_k=1),
            _case("head_64", 1, 16, 1, 64, chunk_size=4, top_k=2),
            _case("all_chunks", 1, 32, 2, 16, chunk_size=8, top_k=0),
            # After cached keys and values: the first query chunk straddles the cache's end ...
            _case("cache", 2, 19, 2, 16, chunk_size=8, top_k=2, prefix=13),
            # ... starts a chunk; every earlier chunk kept; one new token (a generation step).
            _case("cache_aligned", 1, 16, 2, 16, chunk_size=8, top_k=1, prefix=24),
            _case("cache_all_chunks", 1, 12, 2, 16, chunk_size=4, top_k=0, prefix=9),
            _case("cache_one_token", 2, 1, 2, 16, chunk_size=4, top_k=2, prefix=21),
            # Document starts after 13 cached tokens. Row 0: at the first token (the cache, with a
            # start of its own, is dead), inside a chunk, after a document of two whole chunks,
            # back to back, at the last token; a 22-token document chooses among its chunks. Row
            # 1: the cache's document begins at its token 6 and goes on to t = 15, its grid
            # straddling the cache's end. Row 2: no start anywhere. Last, so the cases before
            # keep their seeds (case i is sampled with seed 1000·S + i).
            _case("doc_starts", 3, 37, 2, 16, chunk_size=4, top_k=2, prefix=13, **DOC_STARTS),
        ),
        # Larger inputs keep fp64 gradients well above the non-vacuity bound; a step
        # h ~ 2e-3 moves a gate score by at most ~4e-3, far below min_gap. Five cached
        # tokens put the cache under finite differences too; its document begins at its
        # token 1 (token 0 is dead) and another at t = 6.
        fd_case=_case(
            "finite_diff", 1, 10, 1, 4, chunk_size=3, top_k=1, qk=1.0, v=0.5, min_gap=0.03, prefix=5, **FD_STARTS
        ),
        backends=backend_table(
            Backend(
                "tiled",
                moba_tiled,
                "selected (query, chunk) pairs grouped by key chunk into tiles: one matmul per tile, "
                "log-sum-exp merge, autograd",
                resets=True,
            ),
            Backend(
                "sparse",
                moba_sparse,
                "gathered selected chunks, blockwise over query chunks, recomputing backward",
                resets=True,
            ),
            reference_backend(
                moba_reference, "dense T x T mask and softmax, autograd backward (the fp64 oracle)", resets=True
            ),
        ),
        cotangent_scales=(0.08, 0.08, 0.08),
        flops=_flops,
        bench_shapes=({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 1, "T": 4096, "H": 4, "N": 64}),
        bench_options={"chunk_size": 64, "top_k": 2, "min_gap": 0},
        kwargs=_kwargs,
    )
)
