"""The rwkv8 registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#rwkv8)."""

from __future__ import annotations

import torch

from rwkvx_cli.ops._backends import standard_backends
from rwkvx_cli.ops.registry import Case, OpSpec, Tensors, register
from rwkvx_cli.ops.rwkv8 import INPUTS, STATES, cpu, fused_triton, rwkv8
from rwkvx_cli.ops.rwkv8.chunked import rwkv8_chunked
from rwkvx_cli.ops.rwkv8.reference import rwkv8_reference

V_SCALE = 0.003  # the sampled v (and rho / rho_norm); with the cotangent scales, see _sample


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """Non-negative q (uniform, or with about half its entries exactly 0 under option
    "sparse", like the ReLU features of BDH; option "q_min": uniform in (q_min, 1)), v uniform in
    ±V_SCALE, d uniform in (0.6, 0.99), and a non-zero state consistent with them: n in (0.5, 2.5),
    ρ = n ⊗ v-sized."""
    B, T, H, L = (case.dims[d] for d in "BTHN")
    E, Hv = int(case.options.get("E", L)), int(case.options.get("Hv", H))

    def rand(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    q = rand(B, T, H, L, lo=float(case.options.get("q_min", 0.0)))
    if case.options.get("sparse"):
        q = torch.relu(2.0 * q - 1.0)
    norm = rand(B, H, L, lo=0.5, hi=2.5)
    rho = norm[..., None] * V_SCALE * rand(B, H, L, E, lo=-1.0, hi=1.0)
    if not case.nonzero_state:
        norm, rho = norm.zero_(), rho.zero_()
    return {
        "q": q,
        "v": V_SCALE * rand(B, T, Hv, E, lo=-1.0, hi=1.0),
        "d": rand(H, L, lo=0.6, hi=0.99),
        "rho": rho,
        "rho_norm": norm,
    }


def _flops(dims: dict[str, int], mode: str) -> float:
    """Per token and head, with E = dims.get("E", N): 5 L E forward (y += z_l ρ_l, then
    ρ_l = d_l ρ_l + q_l v) and 11 L E backward (dρ·v, dρ·ρ, ρ·dy, dv += q_l dρ_l, the dρ
    update); O(L) terms and the backward's recomputation not counted."""
    L = dims["N"]
    E = dims.get("E", L)
    per = 5 if mode == "fwd" else 16
    return float(per * L * E * dims["B"] * dims["T"] * dims["H"])


def _case(name, B, T, H, N, nonzero_state=False, starts=(), **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, nonzero_state, options, starts=starts)


SPEC = register(
    OpSpec(
        name="rwkv8",
        summary='normalized decayed linear attention (the seed\'s "RWKV-8", BDH)',
        fn=rwkv8,
        inputs=INPUTS,
        states=STATES,
        sample=_sample,
        cases=(
            _case("canonical", 1, 16, 1, 16),
            _case("multihead", 1, 16, 4, 16),
            _case("batched", 3, 16, 2, 16),
            _case("init_state", 2, 16, 2, 16, nonzero_state=True),
            _case("ragged_T", 1, 37, 2, 16, nonzero_state=True, E=8),
            _case("shared_value", 1, 16, 3, 16, nonzero_state=True, Hv=1),
            _case("sparse_q", 1, 16, 2, 16, nonzero_state=True, sparse=True),
            # Document starts at the window's first token, inside a 16-step chunk, on chunk edges,
            # back to back and at the last token; the second row keeps its initial state to t = 15,
            # the third to the end (through it the final state's cotangent reaches the initial
            # norm: without it that gradient is below the vacuity floor). Last, so the cases
            # before keep their seeds (case i is sampled with seed 1000·S + i).
            _case("doc_starts", 3, 37, 2, 16, nonzero_state=True, starts=((0, 5, 16, 17, 36), (15, 32), ()), E=8),
        ),
        # Starts at the first token, back to back and at the last token in the first row; the second
        # keeps its state (the initial norm's gradient, as above). Right after a start n is one
        # token's q and y divides by it: q_min keeps finite differences' steps (1e-3 (1 + |q|)) small
        # beside it. Chosen so that gate B passes seeds 0-23 on the reference: longer windows (d's
        # curvature grows with d^T) put a near-zero element of dd within the differences' error.
        fd_case=_case("finite_diff", 2, 13, 2, 4, nonzero_state=True, starts=((0, 5, 6, 12), ()), E=3, q_min=0.2),
        backends=standard_backends(
            cpu=cpu.rwkv8_cpu,
            cpu_summary=(
                "fused C++ kernel (OpenMP over B*H, SIMD over E forward and over L backward), "
                "snapshot every 16 steps, hand-written backward"
            ),
            cpu_unavailable=cpu.unavailable,
            triton=fused_triton.rwkv8_triton,
            triton_summary=(
                "fused recurrent Triton kernels: blocks of latent rows in registers, snapshot every 16 steps, "
                "hand-written backward"
            ),
            triton_unavailable=fused_triton.unavailable,
            chunked=rwkv8_chunked,
            chunked_summary="pure-torch matmul form over 16-step chunks (pairwise decays d^(t-1-s)), autograd",
            reference=rwkv8_reference,
            resets=True,  # d is per (head, latent), not per token: no input rewrite resets the state
        ),
        cotangent_scales=(0.02, 0.02, 0.02),
        flops=_flops,
        bench_shapes=({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 8, "T": 256, "H": 4, "N": 64}),
    )
)
