"""The normalized decayed recurrence "rwkv8" (seed 002; BDH's attention) as a time
mix, and its init; op `rwkv8` (docs/operators.md#rwkv8)."""

from __future__ import annotations

import math

import torch
from torch import nn

from rwkvx_cli.config import LN_X_EPS, ModelConfig
from rwkvx_cli.models.layers.common import PLAIN, Graph, State, orthogonal_scaled_, upcast
from rwkvx_cli.ops import rwkv8


class RWKV8Mix(nn.Module):
    """Non-negative query features q = relu(x W_q) per head (latent size = head size),
    values either the layer input itself shared by every head (Hv = 1) or one value
    head per query head, a learned decay d = sigmoid(decay_logit) in (0, 1) per head
    and latent channel; heads are group-normed and projected back to C."""

    letter = "8"  # its letter in the model summary's block string

    def __init__(self, C: int, head_size: int, shared_value: bool, ln_x_eps: float = LN_X_EPS):
        super().__init__()
        self.n_head, self.head_size, self.shared_value = C // head_size, head_size, shared_value
        H, L = self.n_head, head_size
        self.query = nn.Linear(C, H * L, bias=False)
        if not shared_value:
            self.value = nn.Linear(C, C, bias=False)
        self.E = C if shared_value else head_size
        self.decay_logit = nn.Parameter(torch.zeros(H, L))
        self.ln_x = nn.GroupNorm(H, H * self.E, eps=ln_x_eps)
        self.output = nn.Linear(H * self.E, C, bias=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_id: int) -> RWKV8Mix:
        return cls(cfg.n_embd, cfg.head_size, shared_value=cfg.rwkv8_shared_value, ln_x_eps=cfg.ln_x_eps)

    def op_dims(self) -> tuple[str, dict[str, int]]:
        return "rwkv8", {"B": 1, "T": 1, "H": self.n_head, "N": self.head_size, "E": self.E}

    def empty_state(self, B: int, device) -> State:
        H, L = self.n_head, self.head_size
        return {"rho": torch.zeros(B, H, L, self.E, device=device), "rho_norm": torch.zeros(B, H, L, device=device)}

    def forward(self, x: torch.Tensor, v_first, state: State | None = None, graph: Graph = PLAIN, starts=None):
        """`starts` (bool [B, T]): document starts, where the recurrence restarts from the zero
        state (docs/operators.md#document-starts); the mix has no token shift to reset."""
        B, T, C = x.shape
        H, L = self.n_head, self.head_size
        q = upcast(torch.relu(self.query(x)).view(B, T, H, L))
        v = x[:, :, None] if self.shared_value else self.value(x).view(B, T, H, self.head_size)
        d = torch.sigmoid(upcast(self.decay_logit))
        rho0, norm0 = (state["rho"], state["rho_norm"]) if state else (None, None)
        y, rho, rho_norm = rwkv8(q, upcast(v), d, rho0, norm0, starts=starts)
        y = self.ln_x(y.reshape(B * T, H * self.E).to(x.dtype)).view(B, T, H * self.E)
        return self.output(y), v_first, {"rho": rho, "rho_norm": rho_norm}

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        """Decays at time scales log-spaced from 4 to 1024 tokens over the latent
        channels (d = 1 - 1/tau); projections orthogonal, the output projection 0."""
        H, L = self.decay_logit.shape
        tau = torch.logspace(math.log10(4), math.log10(1024), L, dtype=torch.float64).repeat(H, 1)
        d = 1 - 1 / tau
        self.decay_logit.copy_(torch.log(d / (1 - d)))
        orthogonal_scaled_(self.query.weight, 1.0, gen)
        if not self.shared_value:
            orthogonal_scaled_(self.value.weight, 1.0, gen)
        self.ln_x.weight.fill_(1.0)
        self.ln_x.bias.zero_()
        self.output.weight.zero_()
