"""kda: the gated delta rule with one gate per key channel (Kimi Delta Attention;
docs/operators.md#gated-delta-rule-gdn-and-kda).

    P = diag(exp(g_t)) S_{t-1} ;  u_t = β_t (v_t - Pᵀ k_t) ;  S_t = P + k_t u_tᵀ ;  y_t = c S_tᵀ q_t

The kernels live in rwkvx_cli/ops/delta (shared with gdn, which is this op with
its gate broadcast over the key channels); this package is the API; spec.py
registers it.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops.delta import run


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention over q, k, v [B, T, H, N], log-gate g [B, T, H, N] (<= 0,
    finite; g[..., i] decays key row i of the state) and β [B, T, H]; returns
    (y [B, T, H, N] in the input dtype, state_out [B, H, N, N], row = key channel,
    fp32 or fp64 for fp64 inputs). `scale` multiplies q (default 1/sqrt(N)).
    Differentiable with respect to every input, the initial state, and through
    state_out, so segments can be chained."""
    return run("kda", q, k, v, g, beta, state, scale, backend, per_channel=True, starts=starts)
