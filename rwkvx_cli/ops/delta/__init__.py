"""The gated delta rule, written once for the `gdn` and `kda` ops (see ../shared/docs/ops.md).

Per (batch, head), state S is [N_k, N_v] (row = key channel), A_t = exp(g_t):

    P   = A_t ⊙ S_{t-1}      # gdn: one g_t per head; kda: g_t[i] per key row
    u_t = β_t (v_t - Pᵀ k_t)
    S_t = P + k_t u_tᵀ
    y_t = c S_tᵀ q_t          # c = 1/sqrt(N) unless given; on q only

gdn is kda with its gate broadcast over the key rows, so every kernel here takes
the gate as g [B, T, H, G] with G = 1 (gdn) or G = N (kda) and the ops differ
only in the gate's shape at their API. This package holds the kernels
(reference.py, chunked.py, cpu.py + csrc/, fused_triton.py), the argument checks,
the gradient-check sampler and the spec both ops register (`make_spec`).
The ops take q and k as given; the models L2-normalize them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rwkvx_cli.ops._checks import check_same_layout, check_state
from rwkvx_cli.ops.delta import cpu, fused_triton
from rwkvx_cli.ops.delta.chunked import delta_chunked
from rwkvx_cli.ops.delta.reference import delta_reference
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, Tensors, resolve_backend

INPUTS = ("q", "k", "v", "g", "beta")


def _check_tensor(name: str, t, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"{name} must have shape {shape} ([B, T, H{', N' if len(shape) == 4 else ''}]), got {tuple(t.shape)}"
        )
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dtype != like.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but q has {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but q is on {like.device}")


def default_scale(N: int) -> float:
    return 1.0 / math.sqrt(N)


def run(
    spec: OpSpec, q, k, v, g, beta, state, scale, backend: str, per_channel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a public call of gdn (per_channel=False) or kda and run the chosen backend."""
    check_same_layout(("q", "k", "v"), (q, k, v), ndim=4)
    B, T, H, N = q.shape
    if min(B, T, H, N) < 1:
        raise ValueError(f"{spec.name} needs every dimension >= 1, got [B, T, H, N] = {list(q.shape)}")
    _check_tensor("g", g, (B, T, H, N) if per_channel else (B, T, H), q)
    _check_tensor("beta", beta, (B, T, H), q)
    if state is None:
        state = torch.zeros(
            B, H, N, N, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device
        )
    else:
        check_state("state", state, (B, H, N, N), q.device)
    if scale is None:
        scale = default_scale(N)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number (default 1/sqrt(N)), got {scale!r}")
    bk = resolve_backend(spec, backend, q.device)
    if q.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of {spec.name} does not support float64 inputs")
    return bk.fn(q, k, v, g, beta, state, scale=float(scale))


def _backend_fn(kernel: Callable, per_channel: bool) -> Callable:
    """A registry backend over the op's own gate shape: gdn's [B, T, H] gate becomes [B, T, H, 1]."""

    def fn(q, k, v, g, beta, state, scale=None):
        gate = g if per_channel else g.unsqueeze(-1)
        return kernel(q, k, v, gate, beta, state, default_scale(q.shape[-1]) if scale is None else scale)

    fn.__name__ = f"{kernel.__name__}_{'kda' if per_channel else 'gdn'}"
    return fn


def backends(per_channel: bool) -> dict[str, Backend]:
    """The op's backends, fastest first (the order `auto` tries them in)."""

    def bk(name, kernel, summary, **kw):
        return Backend(name, _backend_fn(kernel, per_channel), summary, **kw)

    return {
        "cpu": bk(
            "cpu",
            cpu.delta_cpu,
            "fused C++ kernel (OpenMP over B*H, SIMD over N), snapshot every 64 steps (N <= 64), hand-written backward",
            devices=("cpu",),
            unavailable=cpu.unavailable,
        ),
        "triton": bk(
            "triton",
            fused_triton.delta_triton,
            "fused recurrent Triton kernels: fp32 state columns in registers, snapshot every 16 steps, "
            "hand-written backward",
            auto_devices=("cuda",),
            unavailable=fused_triton.unavailable,
        ),
        "chunked": bk(
            "chunked",
            delta_chunked,
            "pure-torch WY/UT form over 64-step chunks, 8 for kda (pairwise log-space gate sums, "
            "a triangular solve), autograd with the intra-chunk part recomputed",
        ),
        "reference": bk(
            "reference",
            delta_reference,
            "plain sequential torch, autograd backward (the fp64 oracle)",
            production=False,
        ),
    }


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


def _case(name, B, T, H, N, nonzero_state=True, **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, nonzero_state, options)


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
)
FD_CASE = _case("finite_diff", 1, 19, 2, 4)
BENCH_SHAPES = ({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 8, "T": 256, "H": 4, "N": 64})


def make_spec(name: str, summary: str, fn: Callable, per_channel: bool) -> OpSpec:
    """The OpSpec of gdn (per_channel=False) or kda; the op's package registers it."""
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
        cotangent_scales=(0.1, 0.005),
        flops=flops,
        bench_shapes=BENCH_SHAPES,
    )
