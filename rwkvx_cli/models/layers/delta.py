"""Gated DeltaNet (per-head gate) and Kimi Delta Attention (per-channel gate) time
mixes in their published form, with fla's init; ops `gdn` and `kda`
(docs/operators.md#gated-delta-rule-gdn-and-kda)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models.layers.common import PLAIN, GatedRMSNorm, Graph, ShortConv, State, orthogonal_scaled_, upcast
from rwkvx_cli.ops import gdn, kda


class DeltaMix(nn.Module):
    """q, k, v through a short causal conv + SiLU, q and k L2-normalised per head,
    log-gate g = -exp(A_log) softplus(proj(x) + dt_bias), beta = sigmoid(proj(x)),
    output RMSNorm per head times a gate from x. `per_channel`: KDA's gate, else GDN's."""

    def __init__(self, C: int, head_size: int, per_channel: bool):
        super().__init__()
        self.n_head, self.head_size, self.per_channel = C // head_size, head_size, per_channel
        H, N = self.n_head, head_size
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.conv = ShortConv(3 * C)
        self.b_proj = nn.Linear(C, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        if per_channel:  # KDA: low-rank gate and output-gate projections, rank = head size
            self.f_a = nn.Linear(C, N, bias=False)
            self.f_b = nn.Linear(N, C, bias=False)
            self.dt_bias = nn.Parameter(torch.zeros(C))
            self.g_a = nn.Linear(C, N, bias=False)
            self.g_b = nn.Linear(N, C, bias=False)
        else:  # Gated DeltaNet: one gate per head, SiLU output gate
            self.a_proj = nn.Linear(C, H, bias=False)
            self.dt_bias = nn.Parameter(torch.zeros(H))
            self.g_proj = nn.Linear(C, C, bias=False)
        self.o_norm = GatedRMSNorm(N)
        self.o_proj = nn.Linear(C, C, bias=False)

    def op_dims(self) -> tuple[str, dict[str, int]]:
        return "kda" if self.per_channel else "gdn", {"B": 1, "T": 1, "H": self.n_head, "N": self.head_size}

    def empty_state(self, B: int, device) -> State:
        H, N = self.n_head, self.head_size
        return {
            "conv": torch.zeros(B, self.conv.kernel - 1, 3 * H * N, device=device),
            "S": torch.zeros(B, H, N, N, device=device),
        }

    def forward(self, x: torch.Tensor, v_first, state: State | None = None, graph: Graph = PLAIN, starts=None):
        """`starts` (bool [B, T]): document starts, where the short convolution and the recurrence
        begin from zeros."""
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        qkv, conv_state = self.conv(
            torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), state["conv"] if state else None, starts
        )
        q, k, v = (t.reshape(B, T, H, N) for t in qkv.split(C, dim=-1))
        q, k, v = F.normalize(upcast(q), dim=-1), F.normalize(upcast(k), dim=-1), upcast(v)
        beta = torch.sigmoid(upcast(self.b_proj(x)))
        A = -torch.exp(upcast(self.A_log))
        S0 = state["S"] if state else None
        if self.per_channel:
            g = (A.repeat_interleave(N) * F.softplus(upcast(self.f_b(self.f_a(x))) + self.dt_bias)).view(B, T, H, N)
            gate = torch.sigmoid(self.g_b(self.g_a(x)))
            o, S = kda(q, k, v, g, beta, S0, starts=starts)
        else:
            g = A * F.softplus(upcast(self.a_proj(x)) + self.dt_bias)
            gate = F.silu(self.g_proj(x))
            o, S = gdn(q, k, v, g, beta, S0, starts=starts)
        o = self.o_norm(o.to(x.dtype), gate.view(B, T, H, N))
        return self.o_proj(o.reshape(B, T, C)), v_first, {"conv": conv_state, "S": S}

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        """fla's defaults: A ~ U(1, 16); dt log-uniform in [1e-3, 1e-1], stored as
        softplus⁻¹(dt) in dt_bias; projections orthogonal, the output projection 0."""
        H = self.n_head
        self.A_log.copy_(torch.empty(H).uniform_(1, 16, generator=gen).log())
        n_dt = self.dt_bias.numel()
        u = torch.rand(n_dt, generator=gen)
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        for m in self.modules():
            if isinstance(m, nn.Linear) and m is not self.o_proj:
                orthogonal_scaled_(m.weight, 1.0, gen)
        self.conv.reset_parameters(gen)
        self.o_norm.weight.fill_(1.0)
        self.o_proj.weight.zero_()


class GatedDeltaNet(DeltaMix):
    """Kind `gdn`: one log-gate per head, a SiLU output gate."""

    letter = "G"  # its letter in the model summary's block string

    def __init__(self, C: int, head_size: int):
        super().__init__(C, head_size, per_channel=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_id: int) -> GatedDeltaNet:
        return cls(cfg.n_embd, cfg.head_size)


class KimiDeltaAttention(DeltaMix):
    """Kind `kda`: a log-gate per key channel and a sigmoid output gate, both rank-N projections."""

    letter = "K"  # its letter in the model summary's block string

    def __init__(self, C: int, head_size: int):
        super().__init__(C, head_size, per_channel=True)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_id: int) -> KimiDeltaAttention:
        return cls(cfg.n_embd, cfg.head_size)
