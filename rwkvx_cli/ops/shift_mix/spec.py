"""The shift_mix registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#shift_mix)."""

from __future__ import annotations

import torch

from rwkvx_cli.ops._backends import block_backends
from rwkvx_cli.ops.registry import Case, OpSpec, Tensors, register
from rwkvx_cli.ops.shift_mix import INPUTS, STATES, cpu, fused_triton, shift_mix
from rwkvx_cli.ops.shift_mix.reference import shift_mix_reference

MIXES = 6  # RWKV-7's time mix: r, w, k, v, a, g


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """A residual stream x = 0.3 + N(0, 1) [B, T, C] (C = H·N), LayerNorm weight in (0.5, 1.5) and
    bias in ±0.2, M (option, default 6) lerp weights in (0, 1), and a state at x̂'s scale."""
    B, T, H, N = (case.dims[d] for d in "BTHN")
    C, M = H * N, int(case.options.get("M", MIXES))

    def rand(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    state = torch.randn(B, C, generator=gen, dtype=torch.float64)
    if not case.nonzero_state:
        state.zero_()
    return {
        "x": 0.3 + torch.randn(B, T, C, generator=gen, dtype=torch.float64),
        "weight": rand(C, lo=0.5, hi=1.5),
        "bias": rand(C, lo=-0.2, hi=0.2),
        "mix": rand(M, C),
        "state": state,
    }


def _flops(dims: dict[str, int], mode: str) -> float:
    """Per element of x: 8 + 2M forward (the LayerNorm's two sums, centring, scaling and affine,
    the shift's difference, an FMA per lerp) and 12 + 6M backward (the shift's gradient, the lerp
    weights' sums, LayerNorm's backward); recomputing x̂ is not counted."""
    M = int(dims.get("M", MIXES))
    per = 8 + 2 * M if mode == "fwd" else 20 + 8 * M
    return float(per * dims["B"] * dims["T"] * dims["H"] * dims["N"])


def _case(name, B, T, H, N, nonzero_state=True, starts=(), **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, nonzero_state, options, starts=starts)


SPEC = register(
    OpSpec(
        name="shift_mix",
        family="block",
        summary="LayerNorm + token shift + M lerps (RWKV's time-mix and channel-mix inputs)",
        fn=shift_mix,
        inputs=INPUTS,
        states=STATES,
        outputs=None,  # one output per lerp
        sample=_sample,
        cases=(
            _case("canonical", 1, 16, 1, 16, nonzero_state=False),
            _case("multihead", 1, 16, 4, 16, nonzero_state=False),
            _case("batched", 3, 16, 2, 16),
            _case("one_mix", 2, 16, 2, 16, M=1),
            _case("eight_mixes", 2, 9, 1, 16, M=8),
            _case("odd_width", 2, 11, 1, 37, M=3),
            _case("one_token", 3, 1, 2, 16),
            # Document starts at the first token, back to back, at the last token; row 1 keeps its state.
            _case("doc_starts", 2, 13, 2, 16, M=3, starts=((0, 4, 5, 12), (7,))),
        ),
        fd_case=_case("finite_diff", 1, 5, 1, 8, M=3, starts=((2,),)),
        backends=block_backends(
            "shift_mix",
            shift_mix_reference,
            resets=True,
            cpu=(
                cpu.shift_mix_cpu,
                "fused C++ kernel (OpenMP over row ranges, SIMD over C, one pass per tensor), LayerNorm "
                "statistics kept, hand-written backward",
                cpu.unavailable,
            ),
            triton=(
                fused_triton.shift_mix_triton,
                "fused Triton kernels: LayerNorm statistics and the lerps in one pass per tile, C in blocks",
                fused_triton.unavailable,
            ),
            cpu_optional_state=True,
        ),
        flops=_flops,
        bench_shapes=(
            {"B": 16, "T": 128, "H": 2, "N": 64, "M": MIXES},
            {"B": 2, "T": 1024, "H": 12, "N": 64, "M": MIXES},
        ),
        # The model's six lerps at its widths, and the most the kernels take (8); the tiles do not
        # depend on C, but the register use does on M.
        compile_dims=(
            {"H": 12, "N": 64, "M": MIXES},
            {"H": 64, "N": 64, "M": MIXES},
            {"H": 6, "N": 128, "M": MIXES},
            {"H": 32, "N": 128, "M": 8},
        ),
    )
)
