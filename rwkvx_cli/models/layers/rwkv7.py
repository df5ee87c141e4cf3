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

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models.layers.common import State, depth_ratios, lrp_eps, orthogonal_, shifted
from rwkvx_cli.ops import wkv7


def lora_rank(multiplier: float, C: int) -> int:
    return max(32, int(round(multiplier * math.sqrt(C) / 32) * 32))


def wkv7_lrp(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    eps: float = 0.0,
) -> torch.Tensor:
    """WKV7 from a zero state as LRP's modified graph: y [B, T, H, N], linear in v.

    `w` is the log decay, as the op takes it. With r, w, k, a, b constants (their forward values,
    detached), per (batch, head), with S the [N_v, N_k] state:

        S_t[i,j] = Σ_m S_{t-1}[i,m] M_t[m,j] + v_t[i] k_t[j],   M_t = diag(e^{w_t}) + a_t b_tᵀ
        y_t[i]   = Σ_j S_t[i,j] r_t[j]

    Both are sums of terms each linear in one S_{t-1}[i,m] or v_t[i]. The ε-rule (z ± ε: z + ε·sign z)
    splits each node's relevance over its terms:

        R(S_t[i,j])     = S_t[i,j] r_t[j] R(y_t[i]) / (y_t[i] ± ε)                     from the output
                        + Σ_l S_t[i,j] M_{t+1}[j,l] R(S_{t+1}[i,l]) / (S_{t+1}[i,l] ± ε)   the carry
        R(v_t[i])       = Σ_j v_t[i] k_t[j] R(S_t[i,j]) / (S_t[i,j] ± ε)

    run from t = T down to 1 (no carry into S_T; S_0 = 0 keeps none). The state-relevance carry
    R(S_t) plays MambaLRP's R(h_t); rows i (value channels) never mix, so relevance stays in its
    value channel until it reaches v. At ε = 0 every split hands on exactly what it receives, so
    Σ_t Σ_i R(v_t[i]) = Σ_t Σ_i R(y_t[i]).

    Relevance is R = x ⊙ ∂f/∂x on this graph: with the constants detached each node is linear in
    its inputs, and lrp_eps scales the gradient through each sum by z / (z ± ε), so the backward
    pass computes the splits above, the carry included. explain/rules.py's `wkv7_relevance` runs
    them explicitly; the tests check that the two agree.
    """
    r, k, a, b = (t.detach() for t in (r, k, a, b))
    decay = torch.exp(w.detach())
    B, T, H, N = r.shape
    S = v.new_zeros(B, H, N, N)
    ys = []
    for t in range(T):
        S = S * decay[:, t, :, None, :] + torch.einsum("bhij,bhj->bhi", S, a[:, t])[..., None] * b[:, t, :, None, :]
        S = lrp_eps(S + v[:, t, :, :, None] * k[:, t, :, None, :], eps)
        ys.append(lrp_eps(torch.einsum("bhij,bhj->bhi", S, r[:, t]), eps))
    return torch.stack(ys, dim=1)


def group_norm_lrp(gn: nn.GroupNorm, x: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """GroupNorm over [.., C] with LayerNorm's LRP rule per group: the normaliser is a constant."""
    shape = x.shape
    xg = x.reshape(*shape[:-1], gn.num_groups, -1)
    rstd = torch.rsqrt(xg.var(-1, unbiased=False, keepdim=True) + gn.eps).detach()
    y = ((xg - xg.mean(-1, keepdim=True)) * rstd).reshape(shape)
    return lrp_eps(y * gn.weight + gn.bias, eps)


class RWKV7TimeMix(nn.Module):
    """State: att_shift [B, C] (the previous token's input) and wkv [B, H, N, N] fp32.
    The first RWKV-7 layer (layer_id 0) sets `v_first`; later ones mix it into their values
    (the first keeps frozen, unused v0, v1, v2)."""

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
        if layer_id == 0:
            # The first layer sets v_first instead of mixing it in: its value-residual weights stay in
            # the state dict (RWKV-LM's layout, for export and import) but are never used, so they are
            # frozen: every parameter that requires a gradient gets one (DDP without
            # find_unused_parameters). They stay in the optimizer's groups, without state, as before.
            for p in (self.v0, self.v1, self.v2):
                p.requires_grad_(False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_id: int) -> RWKV7TimeMix:
        return cls(cfg.n_embd, cfg.head_size, layer_id)

    def op_dims(self) -> tuple[str, dict[str, int]]:
        """The recurrence op and its dims for one token (FLOP counts)."""
        return "wkv7", {"B": 1, "T": 1, "H": self.n_head, "N": self.head_size}

    def empty_state(self, B: int, device) -> State:
        C, H, N = self.x_r.shape[-1], self.n_head, self.head_size
        return {"att_shift": torch.zeros(B, C, device=device), "wkv": torch.zeros(B, H, N, N, device=device)}

    def forward(self, x, v_first, state: State | None = None):
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        s = state or {}
        xx = shifted(x, s.get("att_shift")) - x
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

        # Under bf16 autocast r and k come out of matmuls in bf16 while w, v, a and kk mix fp32
        # parameters in: the op takes one dtype, the activations' (RWKV-LM casts all six to bf16);
        # its state and accumulation stay fp32. A no-op in fp32.
        ins = (heads(t).to(r.dtype) for t in (r, w, k, v, -kk, kk * a))
        y, wkv = wkv7(*ins, state=s.get("wkv"))
        y = self.ln_x(y.reshape(B * T, C)).view(B, T, C)
        y = y + ((heads(r) * heads(k) * self.r_k).sum(dim=-1, keepdim=True) * heads(v)).view(B, T, C)
        return self.output(y * g), v_first, {"att_shift": x[:, -1], "wkv": wkv}

    def lrp_forward(self, x: torch.Tensor, v_first, eps: float = 0.0):
        """`forward` of a fresh sequence as LRP's modified graph (docs/explain.md#rwkv-7-time-mix):
        returns (out, v_first).

        Constants (detached): r, w, k, a, the in-context learning rate's kk, the value-residual
        gate, the output gate g and ln_x's normaliser. What is left is linear in x through the
        value alone: the token shift's weighted sum (1 - x_v) x_t + x_v x_{t-1}; value; the
        value-residual mix v (1 - γ) + v_first γ (γ the gate), which also hands relevance back to
        the first RWKV-7 layer's value; the state recurrence (wkv7_lrp, where the carry over
        time is derived); ln_x (normaliser constant, its bias keeps its share); the bonus
        (Σ_j r_j k_j r_k_j) v_t, a constant times v_t, summed with ln_x's output; y ⊙ g; output.
        """
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        xx = shifted(x, None) - x
        xr, xw, xk, xa, xg = (x + xx * m for m in (self.x_r, self.x_w, self.x_k, self.x_a, self.x_g))
        xv = lrp_eps(x + xx * self.x_v, eps)
        r = self.receptance(xr).detach()
        w = (-math.exp(-0.5) * torch.sigmoid(self.w0 + torch.tanh(xw @ self.w1) @ self.w2)).detach()
        k = self.key(xk).detach()
        v = lrp_eps(self.value(xv), eps)
        if self.layer_id == 0:
            v_first = v
        else:
            gate = torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2).detach()
            v = lrp_eps(v * (1 - gate) + v_first * gate, eps)
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2).detach()
        g = (torch.sigmoid(xg @ self.g1) @ self.g2).detach()
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C).detach()
        k = (k * (1 + (a - 1) * self.k_a)).detach()

        def heads(t):
            return t.view(B, T, H, N)

        y = wkv7_lrp(heads(r), heads(w), heads(k), heads(v), heads(-kk), heads(kk * a), eps)
        y = group_norm_lrp(self.ln_x, y.reshape(B, T, C), eps)
        bonus = (heads(r) * heads(k) * self.r_k).sum(dim=-1, keepdim=True).detach()
        y = lrp_eps(y + (bonus * heads(v)).view(B, T, C), eps)
        return lrp_eps(self.output(y * g), eps), v_first

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
            orthogonal_(getattr(self, f"{name}2"), 0.1, gen)
        for p, gain in ((self.receptance, 1.0), (self.key, 0.1), (self.value, 1.0)):
            orthogonal_(p.weight, gain, gen)
        self.output.weight.zero_()
        self.ln_x.weight.fill_(((1 + layer) / n_layer) ** 0.7)
        self.ln_x.bias.zero_()
