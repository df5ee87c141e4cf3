"""The channel_mix registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#channel_mix)."""

from __future__ import annotations

import math

import torch

from rwkvx_cli.ops._backends import block_backends
from rwkvx_cli.ops.channel_mix import INPUTS, STATES, channel_mix, cpu, fused_triton
from rwkvx_cli.ops.channel_mix.reference import channel_mix_reference
from rwkvx_cli.ops.registry import Case, OpSpec, Tensors, register


def _hidden(dims: dict[str, int]) -> int:
    """The hidden width F: option F, else the models' 4C."""
    return int(dims.get("F", 4 * dims["H"] * dims["N"]))


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """x = 0.3 + N(0, 1), LayerNorm weight in (0.5, 1.5) and bias in ±0.2, the lerp in (0, 1), key
    and value N(0, 1/fan-in), and a state at x̂'s scale."""
    B, T, H, N = (case.dims[d] for d in "BTHN")
    C = H * N
    F = _hidden({**case.dims, **case.options})

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rand(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    state = randn(B, C)
    if not case.nonzero_state:
        state.zero_()
    return {
        "x": 0.3 + randn(B, T, C),
        "weight": rand(C, lo=0.5, hi=1.5),
        "bias": rand(C, lo=-0.2, hi=0.2),
        "mix": rand(C),
        "key": randn(F, C) / math.sqrt(C),
        "value": randn(C, F) / math.sqrt(F),
        "state": state,
    }


def _flops(dims: dict[str, int], mode: str) -> float:
    """Per token: the two matmuls, 4 C F forward and 8 C F more backward, and about 24 C + 3 F of
    elementwise work (shift_mix with one lerp, relu², the residual) forward and 3x that for both."""
    C, F = dims["H"] * dims["N"], _hidden(dims)
    per = 4 * C * F + 24 * C + 3 * F
    return float((per if mode == "fwd" else 3 * per) * dims["B"] * dims["T"])


def _case(name, B, T, H, N, nonzero_state=True, starts=(), **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, nonzero_state, options, starts=starts)


SPEC = register(
    OpSpec(
        name="channel_mix",
        family="block",
        summary="RWKV's channel mix with its LayerNorm and residual: x + value(relu(key(shift(ln(x))))²)",
        fn=channel_mix,
        inputs=INPUTS,
        states=STATES,
        sample=_sample,
        cases=(
            _case("canonical", 1, 8, 1, 16, nonzero_state=False),
            _case("multihead", 1, 8, 4, 16),
            _case("batched", 3, 5, 2, 8),
            _case("odd_width", 2, 6, 1, 37, F=50),
            _case("hidden_C", 2, 6, 2, 16, F=32),
            _case("one_token", 3, 1, 2, 8),
            # Document starts at the first token, back to back, at the last token; row 1 keeps its state.
            _case("doc_starts", 2, 9, 2, 8, starts=((0, 3, 4, 8), (5,))),
        ),
        fd_case=_case("finite_diff", 1, 4, 1, 4, starts=((2,),)),
        backends=block_backends(
            "channel_mix",
            channel_mix_reference,
            cpu=(
                cpu.channel_mix_cpu,
                "torch's matmuls around fused C++ kernels (shift_mix's with one lerp, relu²), one pass each, "
                "hand-written backward",
                cpu.unavailable,
            ),
            triton=(
                fused_triton.channel_mix_triton,
                "torch's matmuls around shift_mix's Triton kernels (M = 1) and a relu² Triton pair",
                fused_triton.unavailable,
            ),
            cpu_optional_state=True,
            resets=True,
        ),
        # The weights' gradients are sums over B·T tokens of terms of both signs, so some cancel to
        # near 0, where fp32's rounding of the sum (~1e-7 of its terms' magnitude) would dominate
        # the relative error. Small cotangents put that rounding below the metric's 1e-6 floor.
        cotangent_scales=(1e-3, 1e-3),
        flops=_flops,
        bench_shapes=({"B": 16, "T": 128, "H": 2, "N": 64}, {"B": 2, "T": 1024, "H": 8, "N": 64}),
        compile_dims=({"H": 12, "N": 64}, {"H": 64, "N": 64}, {"H": 6, "N": 128}, {"H": 32, "N": 128}),
    )
)
