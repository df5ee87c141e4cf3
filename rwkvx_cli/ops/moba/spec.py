"""The moba registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#moba)."""

from __future__ import annotations

import math

import torch

from rwkvx_cli.ops._backends import backend_table, reference_backend
from rwkvx_cli.ops.moba import INPUTS, STATES, moba
from rwkvx_cli.ops.moba.reference import moba_reference
from rwkvx_cli.ops.moba.sparse import moba_sparse
from rwkvx_cli.ops.moba.tiled import moba_tiled
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, Tensors, register


def _gate_margin(
    q: torch.Tensor, k: torch.Tensor, chunk_size: int, top_k: int, k_cache: torch.Tensor | None = None
) -> float:
    """Smallest gap between the top_k-th best gate score and the next one, over the
    queries whose selection is a real choice (inf when there is none); the queries follow
    the `k_cache` tokens, whose keys are candidates too."""
    B, T, H, N = q.shape
    keys = k if k_cache is None else torch.cat([k_cache, k], dim=1)
    S = keys.shape[1]
    n_full = S // chunk_size
    if top_k <= 0 or top_k >= n_full:
        return math.inf
    qh = q.transpose(1, 2)
    k_mean = keys[:, : n_full * chunk_size].reshape(B, n_full, chunk_size, H, N).mean(dim=2).transpose(1, 2)
    own = torch.arange(S - T, S) // chunk_size
    gate = (qh @ k_mean.transpose(-1, -2)).masked_fill(torch.arange(n_full) >= own[:, None], -math.inf)
    best = gate.sort(dim=-1, descending=True).values
    gap = (best[..., top_k - 1] - best[..., top_k])[..., own > top_k]
    return gap.min().item() if gap.numel() else math.inf


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """q, k uniform in ±qk, v in ±v: small enough that fp32 rounding stays under the
    gates' 1e-6 floor, large enough that every gradient is non-vacuous. The state is the
    keys and values of `prefix` earlier tokens (option, default 0: an empty cache), drawn
    alike.

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

    for _ in range(100):
        x = {"q": uniform(qk, T), "k": uniform(qk, T), "v": uniform(v_scale, T)}
        x |= {"k_cache": uniform(qk, P), "v_cache": uniform(v_scale, P)}
        margin = _gate_margin(
            x["q"].float(), x["k"].float(), case.options["chunk_size"], case.options["top_k"], x["k_cache"].float()
        )
        if margin > min_gap:
            break
    return x


def _flops(dims: dict[str, int], mode: str) -> float:
    """4 N per attended (query, key) pair forward (q·k and p·v), 8 N more backward;
    the gate scores are not counted. Queries follow `prefix` cached tokens (default 0)."""
    T, c, top_k, P = dims["T"], dims["chunk_size"], dims["top_k"], dims.get("prefix", 0)
    pairs = 0
    for t in range(P, P + T):
        ct = t // c
        earlier = ct if top_k <= 0 else min(top_k, ct)
        pairs += earlier * c + t % c + 1
    per = 4 if mode == "fwd" else 12
    return float(per * dims["N"] * pairs * dims["B"] * dims["H"])


def _case(name, B, T, H, N, chunk_size, top_k, **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, options={"chunk_size": chunk_size, "top_k": top_k, **options})


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
        ),
        # Larger inputs keep fp64 gradients well above the non-vacuity bound; a step
        # h ~ 2e-3 moves a gate score by at most ~4e-3, far below min_gap. Five cached
        # tokens put the cache under finite differences too.
        fd_case=_case("finite_diff", 1, 10, 1, 4, chunk_size=3, top_k=1, qk=1.0, v=0.5, min_gap=0.03, prefix=5),
        backends=backend_table(
            Backend(
                "tiled",
                moba_tiled,
                "selected (query, chunk) pairs grouped by key chunk into tiles: one matmul per tile, "
                "log-sum-exp merge, autograd",
            ),
            Backend(
                "sparse",
                moba_sparse,
                "gathered selected chunks, blockwise over query chunks, recomputing backward",
            ),
            reference_backend(moba_reference, "dense T x T mask and softmax, autograd backward (the fp64 oracle)"),
        ),
        cotangent_scales=(0.08, 0.08, 0.08),
        flops=_flops,
        bench_shapes=({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 1, "T": 4096, "H": 4, "N": 64}),
        bench_options={"chunk_size": 64, "top_k": 2, "min_gap": 0},
        kwargs=lambda case: {"chunk_size": case.options["chunk_size"], "top_k": case.options["top_k"]},
    )
)
