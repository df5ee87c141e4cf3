"""The registry entry gdn and kda share (`make_spec`): backends over the op's own
gate shape, the gradient-check sampler and cases (docs/gradcheck.md), the FLOP
count (docs/operators.md#gated-delta-rule-gdn-and-kda)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rwkvx_cli.ops._backends import standard_backends
from rwkvx_cli.ops.delta import INPUTS, cpu, default_scale, forget_at_starts, fused_triton
from rwkvx_cli.ops.delta.chunked import delta_chunked
from rwkvx_cli.ops.delta.reference import delta_reference
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, Tensors


def _backend_fn(kernel: Callable, per_channel: bool) -> Callable:
    """A registry backend over the op's own gate shape: gdn's [B, T, H] gate becomes [B, T, H, 1]."""

    def fn(q, k, v, g, beta, state, scale=None, **starts):
        gate = g if per_channel else g.unsqueeze(-1)
        return kernel(q, k, v, gate, beta, state, default_scale(q.shape[-1]) if scale is None else scale, **starts)

    fn.__name__ = f"{kernel.__name__}_{'kda' if per_channel else 'gdn'}"
    return fn


def backends(per_channel: bool) -> dict[str, Backend]:
    """The op's backends, fastest first (the order `auto` tries them in)."""

    def fn(kernel):
        return _backend_fn(kernel, per_channel)

    return standard_backends(
        cpu=fn(cpu.delta_cpu),
        cpu_summary=(
            "fused C++ kernel (OpenMP over B*H, SIMD over N), snapshot every 64 steps (N <= 64), hand-written backward"
        ),
        cpu_unavailable=cpu.unavailable,
        triton=fn(fused_triton.delta_triton),
        triton_summary=(
            "fused recurrent Triton kernels: fp32 state columns in registers, snapshot every 16 steps, "
            "hand-written backward"
        ),
        triton_unavailable=fused_triton.unavailable,
        chunked=fn(delta_chunked),
        chunked_summary=(
            "pure-torch WY/UT form over 64-step chunks, 8 for kda (pairwise log-space gate sums, "
            "a triangular solve), autograd with the intra-chunk part recomputed"
        ),
        reference=fn(delta_reference),
        reference_resets=True,
    )


def sampler(per_channel: bool) -> Callable[[Case, torch.Generator], Tensors]:
    def sample(case: Case, gen: torch.Generator) -> Tensors:
        """q and k L2-normalized per head (as the models feed them; option `q` scales q),
        v uniform in ±0.05 and the state in ±0.01 (both x option `scale`), β in (0, 1)
        and the log-gate by option `gate`: "default" A = e^g in (0.5, 1), "near0" A in
        (e^-6, e^-3) = (0.0025, 0.05), "near1" A in (0.999, 1]. Small v and state keep
        fp32 rounding of y and the state under the gates' 1e-6 floor."""
        B, T, H, N = (case.dims[d] for d in "BTHN")
        shape = (B, T, H, N)
        gate_shape = shape if per_channel else (B, T, H)

        def randn(*s):
            return torch.randn(*s, generator=gen, dtype=torch.float64)

        def rand(*s):
            return torch.rand(*s, generator=gen, dtype=torch.float64)

        scale = float(case.options.get("scale", 1.0))
        q_scale = float(case.options.get("q", 1.0))
        gate = case.options.get("gate", "default")
        if gate == "default":
            g = torch.log(0.5 + 0.5 * rand(*gate_shape))
        elif gate == "near0":
            g = -3.0 - 3.0 * rand(*gate_shape)
        elif gate == "near1":
            g = -1e-3 * rand(*gate_shape)
        else:
            raise ValueError(f"unknown gate option {gate!r}")
        state = 0.02 * scale * (rand(B, H, N, N) - 0.5)
        if not case.nonzero_state:
            state.zero_()
        return {
            "q": q_scale * torch.nn.functional.normalize(randn(*shape), dim=-1),
            "k": torch.nn.functional.normalize(randn(*shape), dim=-1),
            "v": 0.1 * scale * (rand(*shape) - 0.5),
            "g": g,
            "beta": rand(B, T, H),
            "state": state,
        }

    return sample


def flops(dims: dict[str, int], mode: str) -> float:
    """Per token and head: 7 N² forward (A ⊙ S, Pᵀk, the rank-1 update, Sᵀq) and 15 N²
    backward (dS += c q dyᵀ, dSᵀk, S_t dy, dS u, P dm, dP = dS + k dmᵀ, S_{t-1} ⊙ dP,
    A ⊙ dP); recomputation not counted."""
    per = 7 if mode == "fwd" else 22
    return float(per * dims["N"] ** 2 * dims["B"] * dims["T"] * dims["H"])


def _case(name, B, T, H, N, nonzero_state=True, starts=(), **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, nonzero_state, options, starts=starts)


CASES = (
    _case("canonical", 1, 16, 1, 16, nonzero_state=False),
    _case("multihead", 1, 16, 4, 16, nonzero_state=False),
    _case("batched", 3, 16, 2, 16, nonzero_state=False),
    _case("init_state", 2, 16, 2, 16),
    _case("ragged_T", 2, 37, 2, 16),
    # With A ~ e^-4.5, gradients reaching back one step shrink ~100x: larger q, v and
    # state keep them non-vacuous. Without decay, dS sums over every later step: a
    # smaller q and v keep its fp32 rounding under the 1e-6 floor.
    _case("gate_near_0", 1, 16, 2, 16, gate="near0", q=12.0, scale=10.0),
    _case("gate_near_1", 1, 16, 2, 16, gate="near1", q=2.0, scale=0.35),
    # Document starts at the first token, inside a chunk (8 steps for kda's chunked form, 16 for
    # the Triton kernels' snapshots), on chunk edges, back to back and at the last token. Last, so
    # the cases before keep their seeds (case i is sampled with seed 1000·S + i).
    _case("doc_starts", 2, 37, 2, 16, starts=((0, 5, 16, 17, 36), (15, 32))),
)
FD_CASE = _case("finite_diff", 1, 19, 2, 4, starts=((7, 16),))
BENCH_SHAPES = ({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 8, "T": 256, "H": 4, "N": 64})


def make_spec(name: str, summary: str, fn: Callable, per_channel: bool) -> OpSpec:
    """The OpSpec of gdn (per_channel=False) or kda; the op's spec.py registers it."""
    return OpSpec(
        name=name,
        summary=summary,
        fn=fn,
        inputs=INPUTS,
        states=("state",),
        sample=sampler(per_channel),
        cases=CASES,
        fd_case=FD_CASE,
        backends=backends(per_channel),
        reset_inputs=forget_at_starts,
        cotangent_scales=(0.1, 0.005),
        flops=flops,
        bench_shapes=BENCH_SHAPES,
    )
