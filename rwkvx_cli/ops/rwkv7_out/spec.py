"""The rwkv7_out registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#rwkv7_out)."""

from __future__ import annotations

import torch

from rwkvx_cli.ops._backends import block_backends
from rwkvx_cli.ops.registry import Case, OpSpec, Tensors, register
from rwkvx_cli.ops.rwkv7_out import INPUTS, LN_X_EPS, cpu, fused_triton, rwkv7_out
from rwkvx_cli.ops.rwkv7_out.reference import rwkv7_out_reference


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """y = 0.2 + N(0, 1) (wkv7's output), bonus N(0, 0.3²), gate g N(0, 0.5²), the norm's weight in
    (0.5, 1.5) and bias in ±0.2."""
    B, T, H, N = (case.dims[d] for d in "BTHN")
    C = H * N

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rand(*shape, lo, hi):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    return {
        "y": 0.2 + randn(B, T, H, N),
        "bonus": 0.3 * randn(B, T, H, N),
        "g": 0.5 * randn(B, T, H, N),
        "weight": rand(C, lo=0.5, hi=1.5),
        "bias": rand(C, lo=-0.2, hi=0.2),
    }


def _flops(dims: dict[str, int], mode: str) -> float:
    """Per element: 9 forward (each head's two sums, centring, scaling, affine, the bonus and the
    gate) and 16 backward (the gate's and the bonus's gradients, the norm's backward)."""
    per = 9 if mode == "fwd" else 25
    return float(per * dims["B"] * dims["T"] * dims["H"] * dims["N"])


def _case(name, B, T, H, N, **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, options=options)


SPEC = register(
    OpSpec(
        name="rwkv7_out",
        family="block",
        summary="RWKV-7's ln_x group norm + bonus + output gate (before the output projection)",
        fn=rwkv7_out,
        inputs=INPUTS,
        states=(),
        sample=_sample,
        cases=(
            _case("canonical", 1, 8, 1, 16),
            _case("multihead", 1, 8, 4, 16),
            _case("batched", 3, 5, 2, 16),
            _case("head_24", 2, 5, 3, 24),
            _case("fla_eps", 2, 4, 2, 32, eps=32 * 1e-5),
            _case("one_token", 3, 1, 2, 16),
        ),
        fd_case=_case("finite_diff", 1, 3, 2, 4),
        backends=block_backends(
            "rwkv7_out",
            rwkv7_out_reference,
            cpu=(
                cpu.rwkv7_out_cpu,
                "fused C++ kernel (OpenMP over rows, SIMD over a head), one pass per tensor; hand-written "
                "backward from the inputs and the saved mean and rstd",
                cpu.unavailable,
            ),
            triton=(
                fused_triton.rwkv7_out_triton,
                "one fused Triton kernel each way: [tokens, head] tiles, the norm recomputed",
                fused_triton.unavailable,
            ),
        ),
        kwargs=lambda case: {"eps": float(case.options.get("eps", LN_X_EPS))},
        flops=_flops,
        bench_shapes=({"B": 16, "T": 128, "H": 2, "N": 64}, {"B": 2, "T": 1024, "H": 12, "N": 64}),
        compile_dims=({"H": 12, "N": 64}, {"H": 64, "N": 64}, {"H": 6, "N": 128}, {"H": 32, "N": 128}),
    )
)
