"""RWKV-7 "Goose" time mix as RWKV-LM's `RWKV-v7/train_temp` defines it, and its
"better rwkv7 init" (docs/model.md#the-rwkv-7-time-mix).

Parameter names and shapes match RWKV-LM's state dict, so weights move between
the two without renaming.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rwkvx_cli.config import LN_X_EPS, ModelConfig
from rwkvx_cli.models.layers.common import (
    PLAIN,
    Graph,
    State,
    add_linear,
    depth_ratios,
    orthogonal_,
    orthogonal_scaled_,
    shifted,
)
from rwkvx_cli.ops import rwkv7_out, rwkv7_prep, shift_mix, wkv7

MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")  # the token-shift lerps, in shift_mix's output order


def lora_rank(multiplier: float, C: int) -> int:
    return max(32, int(round(multiplier * math.sqrt(C) / 32) * 32))


class RWKV7TimeMix(nn.Module):
    """State: att_shift [B, C] (the previous token's input) and wkv [B, H, N, N] fp32.
    The first RWKV-7 layer (layer_id 0) sets `v_first`; later ones mix it into their values
    (the first keeps frozen, unused v0, v1, v2)."""

    letter = "R"  # its letter in the model summary's block string

    def __init__(
        self,
        C: int,
        head_size: int,
        layer_id: int,
        ranks: tuple[int, int, int, int] = (0, 0, 0, 0),
        ln_x_eps: float = LN_X_EPS,
    ):
        """`ranks`: the low-rank sizes of w, a, v and g (0: RWKV-LM's rule from C, `lora_rank`);
        `ln_x_eps`: the eps of the heads' group norm (model.ln_x_eps)."""
        super().__init__()
        self.layer_id, self.head_size, self.n_head = layer_id, head_size, C // head_size
        H, N = self.n_head, head_size
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"):
            setattr(self, name, nn.Parameter(torch.zeros(1, 1, C)))
        for (name, mult), given in zip((("w", 2.5), ("a", 2.5), ("v", 1.7), ("g", 5.0)), ranks, strict=True):
            D = given or lora_rank(mult, C)
            setattr(self, f"{name}1", nn.Parameter(torch.zeros(C, D)))
            setattr(self, f"{name}2", nn.Parameter(torch.zeros(D, C)))
        self.r_k = nn.Parameter(torch.zeros(H, N))
        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.ln_x = nn.GroupNorm(H, C, eps=ln_x_eps)
        if layer_id == 0:
            # The first layer sets v_first instead of mixing it in: its value-residual weights stay in
            # the state dict (RWKV-LM's layout, for export and import) but are never used, so they are
            # frozen: every parameter that requires a gradient gets one (DDP without
            # find_unused_parameters). They stay in the optimizer's groups, without state, as before.
            for p in (self.v0, self.v1, self.v2):
                p.requires_grad_(False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_id: int) -> RWKV7TimeMix:
        ranks = (cfg.lora_w, cfg.lora_a, cfg.lora_v, cfg.lora_g)
        return cls(cfg.n_embd, cfg.head_size, layer_id, ranks, ln_x_eps=cfg.ln_x_eps)

    def op_dims(self) -> tuple[str, dict[str, int]]:
        """The recurrence op and its dims for one token (FLOP counts)."""
        return "wkv7", {"B": 1, "T": 1, "H": self.n_head, "N": self.head_size}

    def empty_state(self, B: int, device) -> State:
        C, H, N = self.x_r.shape[-1], self.n_head, self.head_size
        return {"att_shift": torch.zeros(B, C, device=device), "wkv": torch.zeros(B, H, N, N, device=device)}

    def forward(self, x, v_first, state: State | None = None, graph: Graph = PLAIN, starts=None):
        """`graph`: PLAIN, or LRP's modified graph (explain/graph.py), for which r, w, k, a, the
        in-context learning rate's kk, the value-residual gate, the output gate g, and ln_x's
        normaliser are constants, so relevance reaches x through the value alone
        (docs/explain.md#rwkv-7-time-mix). `starts` (bool [B, T]): document starts, where the token
        shift and the recurrence begin from zeros."""
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        s = state or {}
        xx = shifted(x, s.get("att_shift"), starts) - x
        xr, xw, xk, xa, xg = (x + xx * m for m in (self.x_r, self.x_w, self.x_k, self.x_a, self.x_g))
        xv = graph.sum(x + xx * self.x_v)
        r = graph.const(self.receptance(xr))
        # log of the effective decay: -exp(-0.5) * sigmoid(...), so w_eff lies in (0.545, 1)
        w = graph.const(-math.exp(-0.5) * torch.sigmoid(self.w0 + torch.tanh(xw @ self.w1) @ self.w2))
        k = graph.const(self.key(xk))
        v = graph.sum(self.value(xv))
        if self.layer_id == 0:
            v_first = v
        else:
            v = graph.sum(v + (v_first - v) * graph.const(torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)))
        a = graph.const(torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2))
        g = graph.const(torch.sigmoid(xg @ self.g1) @ self.g2)
        kk = graph.const(F.normalize((k * self.k_k).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C))
        k = graph.const(k * (1 + (a - 1) * self.k_a))

        def heads(t):
            return t.view(B, T, H, N)

        # Under bf16 autocast r and k come out of matmuls in bf16 while w, v, a and kk mix fp32
        # parameters in: the op takes one dtype, the activations' (RWKV-LM casts all six to bf16);
        # its state and accumulation stay fp32. A no-op in fp32.
        ins = (heads(t).to(r.dtype) for t in (r, w, k, v, -kk, kk * a))
        y, wkv = graph.op(wkv7)(*ins, state=s.get("wkv"), **({} if starts is None else {"starts": starts}))
        y = graph.group_norm(self.ln_x, y.reshape(B * T, C)).view(B, T, C)
        bonus = graph.const((heads(r) * heads(k) * self.r_k).sum(dim=-1, keepdim=True))
        y = graph.sum(y + (bonus * heads(v)).view(B, T, C))
        return graph.sum(self.output(y * g)), v_first, {"att_shift": x[:, -1], "wkv": wkv}

    def fused_forward(self, x: torch.Tensor, ln: nn.LayerNorm, v_first, state: State | None = None, starts=None):
        """x + forward(ln(x)), the same math through the fused block ops (docs/model.md#fused-blocks):
        shift_mix (ln and the six lerps; it passes the residual stream on, so that its gradient is
        summed in the kernel), the matmuls, rwkv7_prep, wkv7, rwkv7_out, the output projection with
        the residual sum. x is the residual stream before `ln`."""
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        s = state or {}
        mix = [getattr(self, name) for name in MIXES]  # as they are: the kernels take six pointers
        (xr, xw, xk, xv, xa, xg), att_shift, x = shift_mix(
            x, ln.weight, ln.bias, mix, s.get("att_shift"), eps=ln.eps, residual=True, starts=starts
        )
        r, k, v = self.receptance(xr), self.key(xk), self.value(xv)
        w_lora = torch.tanh(xw @ self.w1) @ self.w2
        a_lora = (xa @ self.a1) @ self.a2
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        first = self.layer_id == 0
        v_lora = None if first else (xv @ self.v1) @ self.v2

        def heads(t):
            return None if t is None else t.view(B, T, H, N)

        w, k, v_mixed, a, b, bonus, r = rwkv7_prep(
            *map(heads, (r, k, v, w_lora, a_lora, None if first else v_first, v_lora)),
            self.w0, self.a0, self.v0, self.k_k, self.k_a, self.r_k, pass_r=True,
        )  # fmt: skip
        if first:
            v_first = v
        y, wkv = wkv7(r, w, k, v_mixed, a, b, state=s.get("wkv"), starts=starts)
        out = rwkv7_out(y, bonus, heads(g), self.ln_x.weight, self.ln_x.bias, eps=self.ln_x.eps)
        return add_linear(x, out.view(B, T, C), self.output), v_first, {"att_shift": att_shift, "wkv": wkv}

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        """RWKV-LM train_temp's "better rwkv7 init" (docs/model.md#initialisation)."""
        C, N = self.x_r.shape[-1], self.head_size
        r0, r1 = depth_ratios(layer, n_layer)
        n = torch.arange(C, dtype=torch.float64)
        ddd = (n / C).view(1, 1, C)
        linear = n / (C - 1) - 0.5
        z = ((n % N) - (N - 1) / 2) / ((N - 1) / 2)
        zigzag = z * z.abs()
        for name, power in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9), ("x_g", 0.2)):
            getattr(self, name).copy_(1.0 - ddd.pow(power * r1))
        www = -6 + 6 * (n / (C - 1)).pow(1 + r0**0.3)
        self.w0.copy_((www + 0.5 + 2.5 * zigzag).view(1, 1, C))
        self.a0.copy_((-0.19 + 0.3 * zigzag + 0.4 * linear).view(1, 1, C))
        self.v0.copy_((0.73 - 0.4 * linear).view(1, 1, C))
        self.k_k.copy_((0.71 - 0.1 * linear).view(1, 1, C))
        self.k_a.fill_(1.02)
        self.r_k.fill_(-0.04)
        for name in ("w", "a", "v", "g"):
            getattr(self, f"{name}1").zero_()
            orthogonal_scaled_(getattr(self, f"{name}2"), 0.1, gen)  # train_temp's ortho_init
        for p, gain in ((self.receptance, 1.0), (self.key, 0.1), (self.value, 1.0)):
            orthogonal_(p.weight, gain, gen)
        self.output.weight.zero_()
        self.ln_x.weight.fill_(((1 + layer) / n_layer) ** 0.7)
        self.ln_x.bias.zero_()
