"""RWKV-4 time mix (seed 004, RWKV-LM v4neo) and its init; op `wkv4` (docs/operators.md#wkv4)."""

from __future__ import annotations

import math

import torch
from torch import nn

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models.layers.common import State, depth_ratios, lrp_eps, orthogonal_, shifted, upcast
from rwkvx_cli.ops import wkv4
from rwkvx_cli.ops.wkv4 import FRESH_PP


def wkv4_lrp(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """WKV4 from a fresh state as LRP's modified graph: y [B, T, H, N], linear in v (seed 004's rule).

    With k, w, u constants (their forward values, detached), per channel, in the stabilised form
    the op runs (rwkvx_cli/ops/wkv4/reference.py):

        y_t  = (e1/den) aa_{t-1} + (e2/den) v_t,   den = e1 bb_{t-1} + e2
        aa_t = f1 aa_{t-1} + f2 v_t

    two weighted sums of the carried state and v_t (the weights of y_t sum to 1). The ε-rule
    splits each in proportion to its terms, and the relevance aa_t receives from y_{t+1} and
    aa_{t+1} is carried backward over time to v_t and aa_{t-1}, the way MambaLRP carries h_t.

    The running maximum pp changes no weight. aa = A e^{-pp} stands for the true numerator
    A = Σ_{i<=t} e^{(t-i)w + k_i} v_i (likewise bb for B), and q is a common exponent:
    (e1/den) aa = A_{t-1} / (B_{t-1} + e^{u+k_t}) and (e2/den) v_t = e^{u+k_t} v_t / (B_{t-1} + e^{u+k_t}),
    the unstabilised form's terms exactly, because e^{-q} and e^{-pp} cancel between numerator
    and denominator; and f1 aa_{t-1}, f2 v_t are the unstabilised terms e^w A_{t-1}, e^{k_t} v_t
    times the one positive constant e^{-pp_t}, which leaves every ratio term / sum, and so every
    relevance share, unchanged (only the absolute size ε is compared with differs).

    Relevance is R = x ⊙ ∂f/∂x on this graph: every node is linear in its inputs with the
    constants detached, so the ε-rule's splits are what autograd computes (lrp_eps), and the
    backward pass runs the state-relevance carry. explain/rules.py's `wkv4_relevance` runs the
    same rule explicitly; the tests check that the two agree.
    """
    k, w, u = k.detach(), w.detach().to(k.dtype), u.detach().to(k.dtype)
    B, T, H, N = k.shape
    aa = v.new_zeros(B, H, N)
    bb = k.new_zeros(B, H, N)
    pp = torch.full_like(bb, FRESH_PP)
    ys = []
    for t in range(T):
        k_t, v_t = k[:, t], v[:, t]
        q = torch.maximum(pp, u + k_t)
        e1, e2 = torch.exp(pp - q), torch.exp(u + k_t - q)
        den = e1 * bb + e2
        ys.append(lrp_eps(e1 / den * aa + e2 / den * v_t, eps))
        q = torch.maximum(pp + w, k_t)
        f1, f2 = torch.exp(pp + w - q), torch.exp(k_t - q)
        aa = lrp_eps(f1 * aa + f2 * v_t, eps)
        bb, pp = f1 * bb + f2, q
    return torch.stack(ys, dim=1)


class RWKV4TimeMix(nn.Module):
    """Token-shift mixes mu_r, mu_k, mu_v; r = sigmoid(xr W_r), k = xk W_k, v = xv W_v;
    out = (r * wkv4(k, v)) W_o, with decay w = -exp(time_decay) and bonus u = time_first
    per channel."""

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

    def forward(self, x: torch.Tensor, v_first, state: State | None = None):
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        xx = shifted(x, state["shift"] if state else None)
        xk, xv, xr = (x * m + xx * (1 - m) for m in (self.time_mix_k, self.time_mix_v, self.time_mix_r))
        k = self.key(xk).view(B, T, H, N)
        v = self.value(xv).view(B, T, H, N)
        r = torch.sigmoid(self.receptance(xr))
        wkv_state = (state["aa"], state["bb"], state["pp"]) if state else None
        w = -torch.exp(upcast(self.time_decay)).view(H, N)
        y, (aa, bb, pp) = wkv4(w, upcast(self.time_first).view(H, N), upcast(k), upcast(v), wkv_state)
        out = self.output(r * y.reshape(B, T, C).to(r.dtype))
        return out, v_first, {"shift": x[:, -1], "aa": aa, "bb": bb, "pp": pp}

    def lrp_forward(self, x: torch.Tensor, v_first, eps: float = 0.0):
        """`forward` of a fresh sequence as LRP's modified graph (docs/explain.md#rwkv-4-time-mix):
        returns (out, v_first). The receptance gate r and the key k (the WKV weights) are
        constants, so relevance reaches x only through the value: the token shift's weighted sum
        x_t m_v + x_{t-1} (1 - m_v), the value projection, wkv4_lrp, r ⊙ (a gate) and the output
        projection."""
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        xx = shifted(x, None)
        xk, xr = (x * m + xx * (1 - m) for m in (self.time_mix_k, self.time_mix_r))
        xv = lrp_eps(x * self.time_mix_v + xx * (1 - self.time_mix_v), eps)
        k = self.key(xk).view(B, T, H, N).detach()
        v = lrp_eps(self.value(xv), eps).view(B, T, H, N)
        r = torch.sigmoid(self.receptance(xr)).detach()
        w = -torch.exp(self.time_decay).view(H, N)
        y = wkv4_lrp(w, self.time_first.view(H, N), k, v, eps)
        return lrp_eps(self.output(r * y.reshape(B, T, C)), eps), v_first

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
            orthogonal_(p.weight, gain, gen)
        self.output.weight.zero_()
