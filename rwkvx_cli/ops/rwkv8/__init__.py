"""rwkv8: the normalized decayed recurrence the seed calls "RWKV-8" (BDH's attention;
see ../shared/docs/ops.md). Per (batch, head), with eps = 1e-6:

    q̃_t   = q_t / (Σ_l q_t[l] + eps)
    y_t[e] = Σ_l q̃_t[l] ρ_{t-1}[l, e] / (n_{t-1}[l] + eps)     (reads the state BEFORE step t)
    ρ_t    = d ⊙ ρ_{t-1} + q_t ⊗ v_t ,   n_t = d ⊙ n_{t-1} + q_t

Layout, the project's [B, T, H, ·] (the seed's is [B, H, T, ·]):
    q [B, T, H, L]    <- seed q [B, H, T, L]     (non-negative features, L = latent size)
    v [B, T, Hv, E]   <- seed v [B, Hv, T, E]    (Hv = 1: one value head shared by every head)
    d [H, L]          <- seed decay [1, H, L]    (in (0, 1], constant over time and batch)
    rho [B, H, L, E], rho_norm [B, H, L]: the state, fp32 (fp64 for fp64 inputs), zero by default
    y [B, T, H, E]    <- seed output [B, H, T, E]
i.e. `seed_q = q.transpose(1, 2)`, `y = seed_y.transpose(1, 2)`.

In the registry (gradcheck, bench) the dims are B, T, H, N with N = L; the value
size E (default N) and the value heads Hv (default H) are case options.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_state
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, Tensors, register, resolve_backend
from rwkvx_cli.ops.rwkv8 import cpu, fused_triton
from rwkvx_cli.ops.rwkv8.chunked import rwkv8_chunked
from rwkvx_cli.ops.rwkv8.reference import rwkv8_reference

INPUTS = ("q", "v", "d")
STATES = ("rho", "rho_norm")
V_SCALE = 0.003  # the sampled v (and rho / rho_norm); with the cotangent scales, see _sample


def rwkv8(
    q: torch.Tensor,
    v: torch.Tensor,
    d: torch.Tensor,
    rho: torch.Tensor | None = None,
    rho_norm: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the recurrence; returns (y [B,T,H,E], rho_out [B,H,L,E], rho_norm_out [B,H,L]).

    Differentiable with respect to q, v, d, the initial rho and rho_norm (either
    may be None: zeros), and through the final state, so segments can be chained.
    `d` may have another floating dtype than q and v (an fp32 parameter with bf16
    activations); its gradient comes back in its own dtype.
    """
    for name, x in (("q", q), ("v", v), ("d", d)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must have 4 dimensions [B, T, H, L], got shape {tuple(q.shape)}")
    B, T, H, L = q.shape
    if min(B, T, H, L) < 1:
        raise ValueError(f"rwkv8 needs every dimension >= 1, got q [B, T, H, L] = {list(q.shape)}")
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T) or v.shape[2] not in (1, H) or v.shape[3] < 1:
        raise ValueError(f"v must have shape ({B}, {T}, 1 or {H}, E >= 1), got {tuple(v.shape)}")
    if v.dtype != q.dtype:
        raise ValueError(f"v has dtype {v.dtype} but q has {q.dtype}")
    for name, x in (("v", v), ("d", d)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if tuple(d.shape) != (H, L):
        raise ValueError(f"d must have shape ({H}, {L}), got {tuple(d.shape)}")
    E = v.shape[3]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if rho is None:
        rho = torch.zeros(B, H, L, E, dtype=state_dtype, device=q.device)
    else:
        check_state("rho", rho, (B, H, L, E), q.device)
    if rho_norm is None:
        rho_norm = torch.zeros(B, H, L, dtype=state_dtype, device=q.device)
    else:
        check_state("rho_norm", rho_norm, (B, H, L), q.device)
    bk = resolve_backend(SPEC, backend, q.device)
    if q.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of rwkv8 does not support float64 inputs")
    y, (rho_out, norm_out) = bk.fn(q, v, d, (rho, rho_norm))
    return y, rho_out, norm_out


def _sample(case: Case, gen: torch.Generator) -> Tensors:
    """Non-negative q (uniform, or with about half its entries exactly 0 under option
    "sparse", like the ReLU features of BDH), v uniform in ±V_SCALE, d uniform in
    (0.6, 0.99), and a non-zero state consistent with them: n in (0.5, 2.5), ρ = n ⊗ v-sized."""
    B, T, H, L = (case.dims[d] for d in "BTHN")
    E, Hv = int(case.options.get("E", L)), int(case.options.get("Hv", H))

    def rand(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    q = rand(B, T, H, L)
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


def _reference_backend(q, v, d, state):
    return rwkv8_reference(q, v, d, state)


def _flops(dims: dict[str, int], mode: str) -> float:
    """Per token and head, with E = dims.get("E", N): 5 L E forward (y += z_l ρ_l, then
    ρ_l = d_l ρ_l + q_l v) and 11 L E backward (dρ·v, dρ·ρ, ρ·dy, dv += q_l dρ_l, the dρ
    update); O(L) terms and the backward's recomputation not counted."""
    L = dims["N"]
    E = dims.get("E", L)
    per = 5 if mode == "fwd" else 16
    return float(per * L * E * dims["B"] * dims["T"] * dims["H"])


def _case(name, B, T, H, N, nonzero_state=False, **options):
    return Case(name, {"B": B, "T": T, "H": H, "N": N}, nonzero_state, options)


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
        ),
        fd_case=_case("finite_diff", 1, 19, 2, 4, nonzero_state=True, E=3),
        backends={
            "cpu": Backend(
                "cpu",
                cpu.rwkv8_cpu,
                "fused C++ kernel (OpenMP over B*H, SIMD over E forward and over L backward), "
                "snapshot every 16 steps, hand-written backward",
                devices=("cpu",),
                unavailable=cpu.unavailable,
            ),
            "triton": Backend(
                "triton",
                fused_triton.rwkv8_triton,
                "fused recurrent Triton kernels: blocks of latent rows in registers, snapshot every 16 steps, "
                "hand-written backward",
                auto_devices=("cuda",),
                unavailable=fused_triton.unavailable,
            ),
            "chunked": Backend(
                "chunked",
                rwkv8_chunked,
                "pure-torch matmul form over 16-step chunks (pairwise decays d^(t-1-s)), autograd",
            ),
            "reference": Backend(
                "reference",
                _reference_backend,
                "plain sequential torch, autograd backward (the fp64 oracle)",
                production=False,
            ),
        },
        cotangent_scales=(0.02, 0.02, 0.02),
        flops=_flops,
        bench_shapes=({"B": 1, "T": 1024, "H": 4, "N": 64}, {"B": 8, "T": 256, "H": 4, "N": 64}),
    )
)
