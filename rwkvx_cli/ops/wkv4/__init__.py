"""wkv4: RWKV-4 time mixing, in RWKV-LM v4neo's stabilised form (see ../shared/docs/ops.md).

Per channel c, with decay w_c < 0 (log space) and bonus u_c:

    y_t = (Σ_{i<t} e^{(t-1-i)w + k_i} v_i + e^{u + k_t} v_t) / (Σ_{i<t} e^{(t-1-i)w + k_i} + e^{u + k_t})

k and v are [B, T, H, N]; `w` and `u` are per channel, [H, N] (or [C] with
C = H*N). `w` is the log of the per-step decay, like wkv7's `w`: RWKV-4's
`time_decay` parameter enters as `w = -torch.exp(time_decay)`, and `u` is
`time_first` itself. The state is (aa, bb, pp), each [B, H, N], fp32 (fp64 for
fp64 inputs): the running sums A = aa e^pp, B = bb e^pp with pp their running
maximum log-weight, so every exponent the op takes is <= 0 and no T or k
overflows. A fresh state is (0, 0, -1e38).

Gradient of pp: not zero. A state is defined up to the shift (aa e^c, bb e^c, pp - c),
which leaves every output unchanged, so dL/dpp = aa dL/daa + bb dL/dbb + D, where D
is non-zero only when a loss on the final pp reaches back through an initial pp that
stays the running maximum for the whole segment (gradcheck's "init_state" case). For
a fresh state all three are exactly 0 (pp = -1e38 carries no weight), so the fresh
state cannot pass the non-vacuity rule: every gradient-check case starts from a live
state (a previous segment's (aa, bb, pp)), and all three state gradients are checked.

Numerics (fp32): exponents are formed as differences first, (pp - k) + w, exact for
close large values; where pp' = pp + w is rounded, the rounding error (TwoSum) is
folded into aa and bb, so a long run of small decays on a large pp does not drift
(T = 1e5, |w| = 1e-4, pp = 90: 4e-6 instead of 1e-3 relative error in y).
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_same_layout, check_state
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, Tensors, register, resolve_backend
from rwkvx_cli.ops.wkv4 import cpu, fused_triton
from rwkvx_cli.ops.wkv4.chunked import wkv4_chunked
from rwkvx_cli.ops.wkv4.reference import wkv4_reference

INPUTS = ("w", "u", "k", "v")
STATES = ("aa", "bb", "pp")
FRESH_PP = -1e38
V_SCALE = 0.05  # the sampled v (and aa / bb); with the cotangent scales, see _sample
OPTION_DEFAULTS = (("k_offset", 0.0), ("k_scale", 1.0), ("v_scale", V_SCALE))

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def wkv4(
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: State | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, State]:
    """Run the WKV4 recurrence; returns (y [B,T,H,N], (aa, bb, pp) each [B,H,N]).

    Differentiable with respect to w, u, k, v and the initial state, and through
    the final state, so consecutive segments can be chained. w and u may have
    another floating dtype than k and v (e.g. fp32 parameters with bf16
    activations); their gradients come back in their own dtype.
    """
    check_same_layout(("k", "v"), (k, v), ndim=4)
    B, T, H, N = k.shape
    if min(B, T, H, N) < 1:
        raise ValueError(f"wkv4 needs every dimension >= 1, got [B, T, H, N] = {list(k.shape)}")
    w = _per_channel("w", w, H, N, k.device)
    u = _per_channel("u", u, H, N, k.device)
    state_dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    if state is None:
        zeros = torch.zeros(B, H, N, dtype=state_dtype, device=k.device)
        state = (zeros, zeros.clone(), torch.full_like(zeros, FRESH_PP))
    else:
        if not isinstance(state, (tuple, list)) or len(state) != 3:
            raise ValueError(f"state must be a tuple (aa, bb, pp) of 3 tensors, got {type(state).__name__}")
        for name, s in zip(STATES, state, strict=True):
            check_state(f"state {name}", s, (B, H, N), k.device)
        state = tuple(state)
    bk = resolve_backend(SPEC, backend, k.device)
    if k.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of wkv4 does not support float64 inputs")
    return bk.fn(w, u, k, v, state)


def _per_channel(name: str, x: torch.Tensor, H: int, N: int, device: torch.device) -> torch.Tensor:
    """A per-channel parameter as [H, N]; [C] = [H*N] is accepted too."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if tuple(x.shape) not in ((H, N), (H * N,)):
        raise ValueError(f"{name} must have shape ({H}, {N}) or ({H * N},), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but k is on {device}")
    return x.reshape(H, N)


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
    is used, and a crossed kink shows up in gate B).
    """
    T = case.dims["T"]
    lag = (T - 1 - torch.arange(T, dtype=torch.float64))[:, None, None]
    for _ in range(100):
        x = _draw(case, gen)
        cand = torch.cat([(x["pp"] + T * x["w"])[:, None], x["k"] + lag * x["w"]], dim=1)
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


def _reference_backend(w, u, k, v, state):
    return wkv4_reference(w, u, k, v, state)


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


def _case(name, B, T, H, N, **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, True, options)


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
        ),
        # min_gap: a step h = 1e-3 (1 + |w|) moves the final pp's candidates k_i + (T-1-i) w
        # by up to 18 h, 0.07 at |w| = 2.7. v_scale: fp64 has no rounding to stay under,
        # and a larger v keeps dbb (proportional to y) non-vacuous over seeds.
        fd_case=_case("finite_diff", 1, 19, 2, 4, min_gap=0.1, v_scale=1.0),
        backends={
            "cpu": Backend(
                "cpu",
                cpu.wkv4_cpu,
                "fused C++ kernel (OpenMP over batch x 64-channel groups, SIMD over channels, state in "
                "registers), snapshot every 32 steps, hand-written backward",
                devices=("cpu",),
                unavailable=cpu.unavailable,
            ),
            "triton": Backend(
                "triton",
                fused_triton.wkv4_triton,
                "fused recurrent Triton kernels: a block of channels per program, fp32 state in registers, "
                "snapshot every 16 steps, hand-written backward",
                auto_devices=("cuda",),
                unavailable=fused_triton.unavailable,
            ),
            "chunked": Backend(
                "chunked",
                wkv4_chunked,
                "pure torch, per-chunk log-sum-exps over 16-step chunks and a scan over chunks, autograd",
            ),
            "reference": Backend(
                "reference",
                _reference_backend,
                "plain sequential torch, autograd backward (the fp64 oracle)",
                production=False,
            ),
        },
        derived={"dtime_decay": _dtime_decay},
        cotangent_scales=(0.05, 0.05, 0.05, 0.05),
        flops=_flops,
        bench_shapes=({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 8, "T": 256, "H": 4, "N": 64}),
    )
)
