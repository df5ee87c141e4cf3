"""RWKV-7 "Goose" as RWKV-LM's `RWKV-v7/train_temp` defines it.

Parameter names and shapes match RWKV-LM's state dict, so weights move between
the two without renaming. Every block can carry a recurrent state
(token-shift vectors and the WKV state) across calls: the same code trains with
truncated BPTT and generates one token at a time in O(1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rwkvx_cli.ops import wkv7


def lora_rank(multiplier: float, C: int) -> int:
    return max(32, int(round(multiplier * math.sqrt(C) / 32) * 32))


# A block's recurrent state: att_shift [B, C] and ffn_shift [B, C] (the previous token's
# ln1 / ln2 outputs) and wkv [B, H, N, N] fp32, by name, like every block kind's state.
BlockState = dict[str, torch.Tensor]


def token_shift(x: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """x_{t-1} - x_t, with x_{-1} = prev (zeros when None)."""
    first = torch.zeros_like(x[:, :1]) if prev is None else prev[:, None].to(x.dtype)
    return torch.cat([first, x[:, :-1]], dim=1) - x


class TimeMix(nn.Module):
    def __init__(self, C: int, head_size: int, layer_id: int):
        super().__init__()
        self.layer_id, self.head_size, self.n_head = layer_id, head_size, C // head_size
        H, N = self.n_head, head_size
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"):
            setattr(self, name, nn.Parameter(torch.zeros(1, 1, C)))
        for name, mult in (("w", 2.5), ("a", 2.5), ("v", 1.7), ("g", 5.0)):
            D = lora_rank(mult, C)
            setattr(self, f"{name}1", nn.Parameter(torch.zeros(C, D)))
            setattr(self, f"{name}2", nn.Parameter(torch.zeros(D, C)))
        self.r_k = nn.Parameter(torch.zeros(H, N))
        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.ln_x = nn.GroupNorm(H, C, eps=64e-5)

    def op_dims(self) -> tuple[str, dict[str, int]]:
        """The recurrence op and its dims for one token (FLOP counts)."""
        return "wkv7", {"B": 1, "T": 1, "H": self.n_head, "N": self.head_size}

    def forward(self, x, v_first, shift=None, wkv_state=None):
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        xx = token_shift(x, shift)
        xr, xw, xk, xv, xa, xg = (x + xx * m for m in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g))
        r = self.receptance(xr)
        # log of the effective decay: -exp(-0.5) * sigmoid(...), so w_eff lies in (0.545, 1)
        w = -math.exp(-0.5) * torch.sigmoid(self.w0 + torch.tanh(xw @ self.w1) @ self.w2)
        k = self.key(xk)
        v = self.value(xv)
        if self.layer_id == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2)
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C)
        k = k * (1 + (a - 1) * self.k_a)

        def heads(t):
            return t.view(B, T, H, N)

        y, wkv_out = wkv7(heads(r), heads(w), heads(k), heads(v), heads(-kk), heads(kk * a), state=wkv_state)
        y = self.ln_x(y.reshape(B * T, C)).view(B, T, C)
        y = y + ((heads(r) * heads(k) * self.r_k).sum(dim=-1, keepdim=True) * heads(v)).view(B, T, C)
        return self.output(y * g), v_first, x[:, -1], wkv_out


class ChannelMix(nn.Module):
    def __init__(self, C: int):
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(1, 1, C))
        self.key = nn.Linear(C, 4 * C, bias=False)
        self.value = nn.Linear(4 * C, C, bias=False)

    def forward(self, x, shift=None):
        k = x + token_shift(x, shift) * self.x_k
        return self.value(torch.relu(self.key(k)) ** 2), x[:, -1]


class Block(nn.Module):
    """One RWKV-7 block; the model's first block also owns `ln0`, applied to the embedding."""

    def __init__(self, C: int, head_size: int, layer_id: int, has_ln0: bool | None = None):
        super().__init__()
        self.layer_id = layer_id
        if layer_id == 0 if has_ln0 is None else has_ln0:
            self.ln0 = nn.LayerNorm(C)
        self.ln1 = nn.LayerNorm(C)
        self.ln2 = nn.LayerNorm(C)
        self.att = TimeMix(C, head_size, layer_id)
        self.ffn = ChannelMix(C)

    def empty_state(self, B: int, device) -> BlockState:
        C, H, N = self.ln1.normalized_shape[0], self.att.n_head, self.att.head_size
        return {
            "att_shift": torch.zeros(B, C, device=device),
            "wkv": torch.zeros(B, H, N, N, device=device),
            "ffn_shift": torch.zeros(B, C, device=device),
        }

    def forward(self, x, v_first, state: BlockState | None = None):
        if hasattr(self, "ln0"):
            x = self.ln0(x)
        s = state or {}
        att, v_first, att_shift, wkv = self.att(self.ln1(x), v_first, s.get("att_shift"), s.get("wkv"))
        x = x + att
        ffn, ffn_shift = self.ffn(self.ln2(x), s.get("ffn_shift"))
        return x + ffn, v_first, {"att_shift": att_shift, "wkv": wkv, "ffn_shift": ffn_shift}
