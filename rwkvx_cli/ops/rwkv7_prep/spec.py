"""The rwkv7_prep registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#rwkv7_prep)."""

from __future__ import annotations

import torch

from rwkvx_cli.ops._backends import block_backends
from rwkvx_cli.ops.registry import Case, OpSpec, Tensors, register
from rwkvx_cli.ops.rwkv7_prep import INPUTS, OUTPUTS, cpu, fused_triton, rwkv7_prep
from rwkvx_cli.ops.rwkv7_prep.reference import rwkv7_prep_reference

FIRST_LAYER = ("v_first", "v_lora", "v0")  # what the first layer, without a value residual, leaves out


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """The sequence inputs N(0, 0.5²) (a layer's projections and low-rank outputs), the parameters
    around RWKV-LM's init (w0 in (-3, 1), a0 in ±0.5, v0 in (0.3, 1.1), k_k in (0.6, 0.8),
    k_a in (0.9, 1.1)) and r_k in ±0.5, wide enough that its gradient is not vacuous."""
    B, T, H, N = (case.dims[d] for d in "BTHN")
    C = H * N

    def rand(*shape, lo, hi):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    seq = {n: 0.5 * torch.randn(B, T, H, N, generator=gen, dtype=torch.float64) for n in INPUTS[:7]}
    return {
        **seq,
        "w0": rand(C, lo=-3.0, hi=1.0),
        "a0": rand(C, lo=-0.5, hi=0.5),
        "v0": rand(C, lo=0.3, hi=1.1),
        "k_k": rand(C, lo=0.6, hi=0.8),
        "k_a": rand(C, lo=0.9, hi=1.1),
        "r_k": rand(H, N, lo=-0.5, hi=0.5),
    }


def _flops(dims: dict[str, int], mode: str) -> float:
    """Per element, about 22 forward (the three gates' adds, logistics and scales, the value
    residual, kk's square, sum and scale, the key update, a, b, the bonus's product and sum) and
    44 backward."""
    per = 22 if mode == "fwd" else 66
    return float(per * dims["B"] * dims["T"] * dims["H"] * dims["N"])


def _case(name, B, T, H, N, absent=()):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, absent=absent)


SPEC = register(
    OpSpec(
        name="rwkv7_prep",
        family="block",
        summary="RWKV-7's decay, gates, value residual, kk, key update and bonus (between its matmuls and wkv7)",
        fn=rwkv7_prep,
        inputs=INPUTS,
        states=(),
        outputs=OUTPUTS,
        sample=_sample,
        cases=(
            _case("canonical", 1, 8, 1, 16),
            _case("multihead", 1, 8, 4, 16),
            _case("batched", 3, 5, 2, 16),
            _case("first_layer", 2, 6, 2, 16, absent=FIRST_LAYER),
            _case("head_24", 2, 5, 3, 24),
            _case("one_token", 3, 1, 2, 16),
        ),
        fd_case=_case("finite_diff", 1, 3, 2, 4),
        backends=block_backends(
            "rwkv7_prep",
            rwkv7_prep_reference,
            cpu=(
                cpu.rwkv7_prep_cpu,
                "fused C++ kernel (OpenMP over rows, SIMD over a head), one pass per tensor; hand-written "
                "backward from the inputs alone",
                cpu.unavailable,
            ),
            triton=(
                fused_triton.rwkv7_prep_triton,
                "one fused Triton kernel each way: [tokens, head] tiles, the elementwise work recomputed",
                fused_triton.unavailable,
            ),
        ),
        flops=_flops,
        bench_shapes=({"B": 16, "T": 128, "H": 2, "N": 64}, {"B": 2, "T": 1024, "H": 12, "N": 64}),
        compile_dims=({"H": 12, "N": 64}, {"H": 64, "N": 64}, {"H": 6, "N": 128}, {"H": 32, "N": 128}),
    )
)
