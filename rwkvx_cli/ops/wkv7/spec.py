"""The wkv7 registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#wkv7)."""

from __future__ import annotations

import math

import torch

from rwkvx_cli.ops._backends import backend_table, cpu_backend, reference_backend, triton_backend
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, Tensors, register
from rwkvx_cli.ops.wkv7 import INPUTS, chunked_triton, cpu, forget_at_starts, fused_triton, peer, wkv7
from rwkvx_cli.ops.wkv7.chunked import wkv7_chunked
from rwkvx_cli.ops.wkv7.recurrent import wkv7_recurrent
from rwkvx_cli.ops.wkv7.reference import wkv7_reference


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """Inputs shaped like an RWKV-7 layer's (a = -kk, b = kk * gate, |kk| = 1), with
    r, k, v and the state uniform in the small range of the seed's gradient check."""
    B, T, H, N = (case.dims[d] for d in "BTHN")

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    shape = (B, T, H, N)
    decay = case.options.get("decay", "rwkv7")
    if decay == "rwkv7":  # the model's range: w_eff in (exp(-exp(-0.5)), 1)
        w = -math.exp(-0.5) * torch.sigmoid(2.0 * randn(*shape))
    elif decay == "near0":  # w_eff in (0.0025, 0.05)
        w = -3.0 - 3.0 * rand(*shape)
    elif decay == "near1":  # w_eff in (0.999, 1]
        w = -1e-3 * rand(*shape)
    else:
        raise ValueError(f"unknown decay option {decay!r}")
    kk = torch.nn.functional.normalize(randn(*shape), dim=-1)
    scale = float(case.options.get("scale", 1.0))
    state = 0.1 * scale * (rand(B, H, N, N) - 0.5)
    if not case.nonzero_state:
        state.zero_()
    return {
        "r": 0.2 * (rand(*shape) - 0.5),
        "w": w,
        "k": 0.2 * scale * (rand(*shape) - 0.5),
        "v": 0.2 * scale * (rand(*shape) - 0.5),
        "a": -kk,
        "b": kk * rand(*shape),
        "state": state,
    }


def _dw_eff(inputs: Tensors, grads: Tensors) -> torch.Tensor:
    """The seed's convention: dL/dw_eff = dL/dw_log / w_eff."""
    return grads["w"] / torch.exp(inputs["w"].to(grads["w"].dtype))


def _flops(dims: dict[str, int], mode: str) -> float:
    """Per token and head: 9 N² forward (S a, S diag(w), two rank-1 updates, S r) and
    19 N² backward (the reverse scan's seven products); recomputation not counted."""
    per = 9 if mode == "fwd" else 28
    return float(per * dims["N"] ** 2 * dims["B"] * dims["T"] * dims["H"])


def _case(name, B, T, H, N, nonzero_state=True, starts=(), **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, nonzero_state, options, starts=starts)


SPEC = register(
    OpSpec(
        name="wkv7",
        summary="RWKV-7 generalized delta rule",
        fn=wkv7,
        inputs=INPUTS,
        states=("state",),
        sample=_sample,
        cases=(
            _case("canonical", 1, 16, 1, 16, nonzero_state=False),
            _case("multihead", 1, 16, 4, 16, nonzero_state=False),
            _case("batched", 3, 16, 2, 16, nonzero_state=False),
            _case("init_state", 2, 16, 2, 16),
            _case("ragged_T", 2, 37, 2, 16),
            _case("decay_near_0", 1, 16, 2, 16, decay="near0", scale=4.0),
            _case("decay_near_1", 1, 16, 2, 16, decay="near1"),
            # Document starts at the window's first token, inside a 16-step chunk, on chunk edges,
            # back to back and at the last token; the second row keeps its initial state to t = 15.
            # Last, so the cases before keep their seeds (case i is sampled with seed 1000·S + i).
            _case("doc_starts", 2, 37, 2, 16, starts=((0, 5, 16, 17, 36), (15, 32))),
        ),
        fd_case=_case("finite_diff", 1, 19, 2, 4, starts=((7, 16),)),
        # The standard rows (cpu, triton, chunked, reference) and a chunked Triton form,
        # a torch step loop and a peer between them.
        backends=backend_table(
            cpu_backend(
                cpu.wkv7_cpu,
                "fused C++ kernel (OpenMP over B*H, SIMD over N), snapshot every 16 steps, hand-written backward",
                cpu.unavailable,
                optional_state=True,
            ),
            triton_backend(
                "triton",
                fused_triton.wkv7_triton,
                "fused recurrent Triton kernels: fp32 state rows in registers, snapshot every 16 steps, "
                "hand-written backward",
                fused_triton.unavailable,
            ),
            # Never chosen by "auto" yet: it sits after `triton`, which needs the same things,
            # and its auto_devices keep auto from picking it on CPU under the interpreter.
            triton_backend(
                "triton_chunked",
                chunked_triton.wkv7_triton_chunked,
                "chunked WY-form Triton kernels over 16-step chunks (tl.dot, pairwise log-space decays), "
                "chunk-boundary states saved, hand-written backward",
                chunked_triton.unavailable,
            ),
            Backend(
                "chunked",
                wkv7_chunked,
                "pure-torch matmul form over 16-step chunks (pairwise log-space decays, a triangular solve), "
                "autograd with per-chunk recomputation",
                auto_devices=("cuda",),  # on CPU the fused kernel, or the step loop, is faster
            ),
            Backend(
                "recurrent",
                wkv7_recurrent,
                "torch step loop over B*H, state snapshot every 16 steps, hand-written backward",
            ),
            Backend(
                "fla",
                peer.wkv7_fla,
                "peer: fla's chunk_rwkv7 (chunked DPLR Triton kernels), a comparison row where installed",
                production=False,
                peer=True,
                devices=("cuda",),
                supports_fp64=False,
                unavailable=peer.fla_unavailable,
            ),
            reference_backend(wkv7_reference, resets=True),
        ),
        reset_inputs=forget_at_starts,
        derived={"dw_eff": _dw_eff},
        cotangent_scales=(0.2, 0.2),
        flops=_flops,
        bench_shapes=({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 8, "T": 256, "H": 4, "N": 64}),
    )
)
