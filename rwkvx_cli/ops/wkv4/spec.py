"""The wkv4 registry entry: its backends, the gradient-check sampler and cases
(docs/gradcheck.md), the FLOP count (docs/operators.md#wkv4)."""

from __future__ import annotations

import torch

from rwkvx_cli.ops._backends import standard_backends
from rwkvx_cli.ops.registry import Case, OpSpec, Tensors, register
from rwkvx_cli.ops.wkv4 import FRESH_PP, INPUTS, STATES, cpu, fused_triton, wkv4
from rwkvx_cli.ops.wkv4.chunked import wkv4_chunked
from rwkvx_cli.ops.wkv4.reference import wkv4_reference

V_SCALE = 0.05  # the sampled v (and aa / bb); with the cotangent scales, see _sample
OPTION_DEFAULTS = (("k_offset", 0.0), ("k_scale", 1.0), ("v_scale", V_SCALE))


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """Inputs shaped like an RWKV-4 layer's, at the gradient check's small value scale.

    Options: decay "rwkv4" (w = -exp(U(-2, 1)), RWKV-4's range) or "slow" (|w| in
    (1e-3, 2e-2)); k = k_offset + k_scale U(-1, 1); v = v_scale U(-1, 1); state "live"
    (pp in k's range, bb in (1, 3), aa = bb v_scale U(-1, 1)) or "dominant" (pp so far above every k that the
    initial state holds the running maximum over the whole segment). A case
    without `nonzero_state` gets the fresh state (0, 0, -1e38).

    The final pp is a maximum, so the loss has a kink where its two largest candidates
    tie. With option `min_gap` (gate B's case) the draw is repeated until they are
    further apart than finite-difference steps can move them (after 100 draws the last
    is used, and a crossed kink shows up in gate B). With document starts, the candidates
    are the tokens from a row's last start on (and the initial state only in a row without).
    """
    B, T = case.dims["B"], case.dims["T"]
    lag = (T - 1 - torch.arange(T, dtype=torch.float64))[:, None, None]
    starts = case.starts_mask()
    # candidate j (0: the initial state, 1 + i: token i) counts unless a start lies in (i, T)
    after = torch.zeros(B, T + 1, dtype=torch.bool)
    if starts is not None:
        after[:, :T] = starts.flip(1).cumsum(1).flip(1).bool()
    for _ in range(100):
        x = _draw(case, gen)
        cand = torch.cat([(x["pp"] + T * x["w"])[:, None], x["k"] + lag * x["w"]], dim=1)
        cand = cand.masked_fill(after[:, :, None, None], float("-inf"))
        top = cand.topk(2, dim=1).values
        if (top[:, 0] - top[:, 1]).min().item() > float(case.options.get("min_gap", 0.0)):
            break
    return x


def _draw(case: Case, gen: torch.Generator) -> Tensors:
    B, T, H, N = (case.dims[d] for d in "BTHN")
    o = case.options

    def rand(*shape, lo=-1.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    decay = o.get("decay", "rwkv4")
    if decay == "rwkv4":
        w = -torch.exp(rand(H, N, lo=-2.0, hi=1.0))
    elif decay == "slow":
        w = -torch.exp(rand(H, N, lo=-7.0, hi=-4.0))
    else:
        raise ValueError(f"unknown decay option {decay!r}")
    k_offset, k_scale, v_scale = (float(o.get(name, default)) for name, default in OPTION_DEFAULTS)
    k = k_offset + k_scale * rand(B, T, H, N)
    u = rand(H, N)
    bb = rand(B, H, N, lo=1.0, hi=3.0)
    aa = bb * v_scale * rand(B, H, N)
    pp = k_offset + k_scale * rand(B, H, N)
    if o.get("state", "live") == "dominant":
        pp = k_offset + k_scale + 1.0 + T * (-w).amax() + rand(B, H, N, lo=0.0, hi=1.0)
    if o.get("grid"):
        # On a 2^-13 grid every exponent sum (pp + w, u + k, k + j w) is exact in fp32 below
        # 1024: near k = 80 (ulp 7.6e-6) the check then measures the kernels, not fp32's
        # resolution of the exponents. w and u sit on the coarser 2^-6 grid and k_t, pp
        # carry distinct offsets (t + 1) 2^-13 and 0 below it, so (for T < 128) no two
        # candidates of the running maximum (k_i + j w, pp + j w) can tie, which would
        # leave it without a derivative.
        w, u = ((x * 64).round() / 64 for x in (w, u))
        pp = (pp * 64).round() / 64
        k = (k * 64).round() / 64 + torch.arange(1, T + 1, dtype=k.dtype)[:, None, None] / 8192
    if not case.nonzero_state:
        aa, bb, pp = aa.zero_(), bb.zero_(), torch.full_like(pp, FRESH_PP)
    return {"w": w, "u": u, "k": k, "v": v_scale * rand(B, T, H, N), "aa": aa, "bb": bb, "pp": pp}


def _dtime_decay(inputs: Tensors, grads: Tensors) -> torch.Tensor:
    """RWKV-4's parameter: w = -exp(time_decay), so dL/dtime_decay = dL/dw * w."""
    return grads["w"] * inputs["w"].to(grads["w"].dtype)


def _flops(dims: dict[str, int], mode: str) -> float:
    """Per token and channel, an exp counted as one FLOP: 17 forward (the output:
    u + k, a difference, an exp, numerator, denominator, a division; the update:
    pp + w, a difference, an exp, aa and bb) and 27 backward (the update's
    gradients 12, the output's 15); the backward's recomputation not counted."""
    per = 17 if mode == "fwd" else 44
    return float(per * dims["B"] * dims["T"] * dims["H"] * dims["N"])


def _case(name, B, T, H, N, starts=(), **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, True, options, starts=starts)


SPEC = register(
    OpSpec(
        name="wkv4",
        summary="RWKV-4 time mixing (stabilised WKV with bonus u)",
        fn=wkv4,
        inputs=INPUTS,
        states=STATES,
        sample=_sample,
        cases=(
            _case("canonical", 1, 16, 1, 16),
            _case("multihead", 1, 16, 4, 16),
            _case("batched", 3, 16, 2, 16),
            _case("init_state", 2, 16, 2, 16, decay="slow", state="dominant"),
            _case("ragged_T", 2, 37, 2, 16),
            _case("large_k", 1, 16, 2, 16, k_offset=80.0, k_scale=8.0, grid=True),
            _case("slow_decay", 1, 16, 2, 16, decay="slow"),
            # Document starts at the window's first token, inside a 16-step chunk, on the chunk
            # edges 16 and 32 (the cpu kernel's snapshot at 32), back to back and at the last token;
            # the second row keeps its initial state to t = 15, the third for the whole window.
            # Last, so the cases before keep their seeds (case i is sampled with seed 1000·S + i).
            _case("doc_starts", 3, 37, 2, 16, starts=((0, 5, 16, 17, 32, 36), (15, 32), ())),
        ),
        # min_gap: a step h = 1e-3 (1 + |w|) moves the final pp's candidates k_i + (T-1-i) w
        # by up to 18 h, 0.07 at |w| = 2.7. v_scale: fp64 has no rounding to stay under,
        # and a larger v keeps dbb (proportional to y) non-vacuous over seeds. Two starts: the
        # initial state's gradients come from t < 7, the final pp's candidates from t >= 16.
        fd_case=_case("finite_diff", 1, 19, 2, 4, starts=((7, 16),), min_gap=0.1, v_scale=1.0),
        backends=standard_backends(
            cpu=cpu.wkv4_cpu,
            cpu_summary=(
                "fused C++ kernel (OpenMP over batch x 64-channel groups, SIMD over channels, state in "
                "registers), snapshot every 32 steps, hand-written backward"
            ),
            cpu_unavailable=cpu.unavailable,
            triton=fused_triton.wkv4_triton,
            triton_summary=(
                "fused recurrent Triton kernels: a block of channels per program, fp32 state in registers, "
                "snapshot every 16 steps, hand-written backward"
            ),
            triton_unavailable=fused_triton.unavailable,
            chunked=wkv4_chunked,
            chunked_summary="pure torch, per-chunk log-sum-exps over 16-step chunks and a scan over chunks, autograd",
            reference=wkv4_reference,
            resets=True,
        ),
        derived={"dtime_decay": _dtime_decay},
        cotangent_scales=(0.05, 0.05, 0.05, 0.05),
        flops=_flops,
        bench_shapes=({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 8, "T": 256, "H": 4, "N": 64}),
    )
)
