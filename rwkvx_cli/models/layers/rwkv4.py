"""RWKV-4 time mix (seed 004, RWKV-LM v4neo) and its init; op `wkv4` (docs/operators.md#wkv4)."""

from __future__ import annotations

import math

import torch
from torch import nn

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models.layers.common import (
    PLAIN,
    Graph,
    State,
    add_linear,
    depth_ratios,
    orthogonal_scaled_,
    shifted,
    upcast,
)
from rwkvx_cli.ops import shift_mix, wkv4


class RWKV4TimeMix(nn.Module):
    """Token-shift mixes mu_r, mu_k, mu_v; r = sigmoid(xr W_r), k = xk W_k, v = xv W_v;
    out = (r * wkv4(k, v)) W_o, with decay w = -exp(time_decay) and bonus u = time_first
    per channel."""

    letter = "4"  # its letter in the model summary's block string

    def __init__(self, C: int, head_size: int):
        super().__init__()
        self.n_head, self.head_size = C // head_size, head_size
        self.time_decay = nn.Parameter(torch.zeros(C))
        self.time_first = nn.Parameter(torch.zeros(C))
        self.time_mix_k = nn.Parameter(torch.zeros(1, 1, C))
        self.time_mix_v = nn.Parameter(torch.zeros(1, 1, C))
        self.time_mix_r = nn.Parameter(torch.zeros(1, 1, C))
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_id: int) -> RWKV4TimeMix:
        return cls(cfg.n_embd, cfg.head_size)

    def op_dims(self) -> tuple[str, dict[str, int]]:
        return "wkv4", {"B": 1, "T": 1, "H": self.n_head, "N": self.head_size}

    def empty_state(self, B: int, device) -> State:
        H, N = self.n_head, self.head_size
        zeros = torch.zeros(B, H, N, device=device)
        return {
            "shift": torch.zeros(B, H * N, device=device),
            "aa": zeros,
            "bb": zeros.clone(),
            "pp": torch.full((B, H, N), -1e38, device=device),
        }

    def forward(self, x: torch.Tensor, v_first, state: State | None = None, graph: Graph = PLAIN, starts=None):
        """`graph`: PLAIN, or LRP's modified graph (explain/graph.py), for which the receptance gate r
        and the key k (the WKV weights) are constants, so relevance reaches x through the value alone
        (docs/explain.md#rwkv-4-time-mix). `starts` (bool [B, T]): document starts, where the token
        shift and the recurrence begin from the fresh state."""
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        xx = shifted(x, state["shift"] if state else None, starts)
        xk, xr = (x * m + xx * (1 - m) for m in (self.time_mix_k, self.time_mix_r))
        xv = graph.sum(x * self.time_mix_v + xx * (1 - self.time_mix_v))
        k = graph.const(self.key(xk).view(B, T, H, N))
        v = graph.sum(self.value(xv)).view(B, T, H, N)
        r = graph.const(torch.sigmoid(self.receptance(xr)))
        wkv_state = (state["aa"], state["bb"], state["pp"]) if state else None
        w = -torch.exp(upcast(self.time_decay)).view(H, N)
        ins = (w, upcast(self.time_first).view(H, N), upcast(k), upcast(v))
        y, (aa, bb, pp) = graph.op(wkv4)(*ins, wkv_state, **({} if starts is None else {"starts": starts}))
        out = graph.sum(self.output(r * y.reshape(B, T, C).to(r.dtype)))
        return out, v_first, {"shift": x[:, -1], "aa": aa, "bb": bb, "pp": pp}

    def fused_forward(self, x: torch.Tensor, ln: nn.LayerNorm, v_first, state: State | None = None, starts=None):
        """x + forward(ln(x)) with ln and the three token-shift mixes as one shift_mix (RWKV-4's
        x·m + x_{t-1}·(1 - m) is shift_mix's lerp with weight 1 - m), which also passes the residual
        stream on (its gradient summed in the kernel), and the output projection summed into the
        residual in one addmm."""
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        mix = 1 - torch.cat([self.time_mix_k, self.time_mix_v, self.time_mix_r], dim=1).view(3, C)
        shift = state["shift"] if state else None
        (xk, xv, xr), shift, x = shift_mix(x, ln.weight, ln.bias, mix, shift, eps=ln.eps, residual=True, starts=starts)
        k, v = self.key(xk).view(B, T, H, N), self.value(xv).view(B, T, H, N)
        r = torch.sigmoid(self.receptance(xr))
        wkv_state = (state["aa"], state["bb"], state["pp"]) if state else None
        w = -torch.exp(upcast(self.time_decay)).view(H, N)
        y, (aa, bb, pp) = wkv4(w, upcast(self.time_first).view(H, N), upcast(k), upcast(v), wkv_state, starts=starts)
        out = add_linear(x, r * y.reshape(B, T, C).to(r.dtype), self.output)
        return out, v_first, {"shift": shift, "aa": aa, "bb": bb, "pp": pp}

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        """RWKV-LM v4neo's init: decay speeds spread over channels, a zigzag bonus."""
        C = self.time_decay.numel()
        r0, r1 = depth_ratios(layer, n_layer)
        h = torch.arange(C, dtype=torch.float64)
        self.time_decay.copy_(-5 + 8 * (h / (C - 1)) ** (0.7 + 1.3 * r0))
        zigzag = ((h + 1) % 3 - 1) * 0.5
        self.time_first.copy_(math.log(0.3) + zigzag)
        x = (h / C).view(1, 1, C)
        self.time_mix_k.copy_(x**r1)
        self.time_mix_v.copy_(x**r1 + 0.3 * r0)
        self.time_mix_r.copy_(x ** (0.5 * r1))
        for p, gain in ((self.key, 0.1), (self.value, 1.0), (self.receptance, 1.0)):
            orthogonal_scaled_(p.weight, gain, gen)  # v4neo's rule
        self.output.weight.zero_()
