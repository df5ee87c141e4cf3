"""Time-mixing layers of RWKV-7's relatives, each a drop-in block for the layer
pattern (`model.layers`): RWKV-4 (seed 004), Gated DeltaNet, Kimi Delta
Attention and the normalized "rwkv8" recurrence (seed 002, BDH).

Every layer maps [B, T, C] -> [B, T, C] and carries its recurrent state as a
dict of tensors (batch first), so truncated BPTT and token-by-token generation
work the same way for every kind. `reset_parameters(gen, layer, n_layer)` is
the layer's own seeded initialisation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rwkvx_cli.ops import gdn, kda, rwkv8, wkv4

State = dict[str, torch.Tensor]


def _f32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for the recurrences and norms (bf16 activations are upcast; fp64 stays)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def shifted(x: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """x_{t-1} for every t, with x_{-1} = prev (zeros when None)."""
    first = torch.zeros_like(x[:, :1]) if prev is None else prev[:, None].to(x.dtype)
    return torch.cat([first, x[:, :-1]], dim=1)


def _orthogonal_(w: torch.Tensor, gain: float, gen: torch.Generator) -> None:
    rows, cols = w.shape
    nn.init.orthogonal_(w, gain=gain * (math.sqrt(rows / cols) if rows > cols else 1.0), generator=gen)


class ShortConv(nn.Module):
    """Causal depthwise convolution (kernel K) then SiLU, as Gated DeltaNet and KDA
    apply to q, k and v; the state is the last K - 1 inputs."""

    def __init__(self, channels: int, kernel: int = 4):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, Cc = x.shape
        if prev is None:
            prev = x.new_zeros(B, self.kernel - 1, Cc)
        xs = torch.cat([prev.to(x.dtype), x], dim=1)  # [B, K-1+T, Cc]
        y = F.conv1d(xs.transpose(1, 2), self.weight.to(x.dtype), groups=Cc).transpose(1, 2)
        return F.silu(y), xs[:, -(self.kernel - 1) :]

    def reset_parameters(self, gen: torch.Generator) -> None:
        bound = 1 / math.sqrt(self.kernel)  # torch's Conv1d default for a depthwise kernel
        self.weight.uniform_(-bound, bound, generator=gen)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's channels, times a gate (fla's FusedRMSNormGated)."""

    def __init__(self, head_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_size))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        o32 = _f32(o)
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (o32 * self.weight).to(o.dtype) * gate


class RWKV4TimeMix(nn.Module):
    """RWKV-4 (seed 004, RWKV-LM v4neo): token-shift mixes mu_r, mu_k, mu_v;
    r = sigmoid(xr W_r), k = xk W_k, v = xv W_v; out = (r * wkv4(k, v)) W_o, with
    decay w = -exp(time_decay) and bonus u = time_first per channel."""

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

    def forward(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        xx = shifted(x, state["shift"] if state else None)
        xk, xv, xr = (x * m + xx * (1 - m) for m in (self.time_mix_k, self.time_mix_v, self.time_mix_r))
        k = self.key(xk).view(B, T, H, N)
        v = self.value(xv).view(B, T, H, N)
        r = torch.sigmoid(self.receptance(xr))
        wkv_state = (state["aa"], state["bb"], state["pp"]) if state else None
        w = -torch.exp(_f32(self.time_decay)).view(H, N)
        y, (aa, bb, pp) = wkv4(w, _f32(self.time_first).view(H, N), _f32(k), _f32(v), wkv_state)
        out = self.output(r * y.reshape(B, T, C).to(r.dtype))
        return out, {"shift": x[:, -1], "aa": aa, "bb": bb, "pp": pp}

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        """RWKV-LM v4neo's init: decay speeds spread over channels, a zigzag bonus."""
        C = self.time_decay.numel()
        r0 = layer / (n_layer - 1) if n_layer > 1 else 0.0
        r1 = 1.0 - layer / n_layer
        h = torch.arange(C, dtype=torch.float64)
        self.time_decay.copy_(-5 + 8 * (h / (C - 1)) ** (0.7 + 1.3 * r0))
        zigzag = ((h + 1) % 3 - 1) * 0.5
        self.time_first.copy_(math.log(0.3) + zigzag)
        x = (h / C).view(1, 1, C)
        self.time_mix_k.copy_(x**r1)
        self.time_mix_v.copy_(x**r1 + 0.3 * r0)
        self.time_mix_r.copy_(x ** (0.5 * r1))
        for p, gain in ((self.key, 0.1), (self.value, 1.0), (self.receptance, 1.0)):
            _orthogonal_(p.weight, gain, gen)
        self.output.weight.zero_()


class DeltaMix(nn.Module):
    """Gated DeltaNet (per-head gate) or Kimi Delta Attention (per-channel gate),
    in their published form: q, k, v through a short causal conv + SiLU, q and k
    L2-normalised per head, log-gate g = -exp(A_log) softplus(proj(x) + dt_bias),
    beta = sigmoid(proj(x)), output RMSNorm per head times a gate from x."""

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

    def forward(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        B, T, C = x.shape
        H, N = self.n_head, self.head_size
        qkv, conv_state = self.conv(
            torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), state["conv"] if state else None
        )
        q, k, v = (t.reshape(B, T, H, N) for t in qkv.split(C, dim=-1))
        q, k, v = F.normalize(_f32(q), dim=-1), F.normalize(_f32(k), dim=-1), _f32(v)
        beta = torch.sigmoid(_f32(self.b_proj(x)))
        A = -torch.exp(_f32(self.A_log))
        S0 = state["S"] if state else None
        if self.per_channel:
            g = (A.repeat_interleave(N) * F.softplus(_f32(self.f_b(self.f_a(x))) + self.dt_bias)).view(B, T, H, N)
            gate = torch.sigmoid(self.g_b(self.g_a(x)))
            o, S = kda(q, k, v, g, beta, S0)
        else:
            g = A * F.softplus(_f32(self.a_proj(x)) + self.dt_bias)
            gate = F.silu(self.g_proj(x))
            o, S = gdn(q, k, v, g, beta, S0)
        o = self.o_norm(o.to(x.dtype), gate.view(B, T, H, N))
        return self.o_proj(o.reshape(B, T, C)), {"conv": conv_state, "S": S}

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
                _orthogonal_(m.weight, 1.0, gen)
        self.conv.reset_parameters(gen)
        self.o_norm.weight.fill_(1.0)
        self.o_proj.weight.zero_()


class RWKV8Mix(nn.Module):
    """The normalized decayed recurrence (seed 002; BDH's attention): non-negative
    query features q = relu(x W_q) per head (latent size = head size), values
    either the layer input itself shared by every head (Hv = 1) or one value
    head per query head, a learned decay d = sigmoid(decay_logit) in (0, 1) per
    head and latent channel; heads are group-normed and projected back to C."""

    def __init__(self, C: int, head_size: int, shared_value: bool):
        super().__init__()
        self.n_head, self.head_size, self.shared_value = C // head_size, head_size, shared_value
        H, L = self.n_head, head_size
        self.query = nn.Linear(C, H * L, bias=False)
        if not shared_value:
            self.value = nn.Linear(C, C, bias=False)
        self.E = C if shared_value else head_size
        self.decay_logit = nn.Parameter(torch.zeros(H, L))
        self.ln_x = nn.GroupNorm(H, H * self.E, eps=64e-5)
        self.output = nn.Linear(H * self.E, C, bias=False)

    def op_dims(self) -> tuple[str, dict[str, int]]:
        return "rwkv8", {"B": 1, "T": 1, "H": self.n_head, "N": self.head_size, "E": self.E}

    def empty_state(self, B: int, device) -> State:
        H, L = self.n_head, self.head_size
        return {"rho": torch.zeros(B, H, L, self.E, device=device), "rho_norm": torch.zeros(B, H, L, device=device)}

    def forward(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        B, T, C = x.shape
        H, L = self.n_head, self.head_size
        q = _f32(torch.relu(self.query(x)).view(B, T, H, L))
        v = x[:, :, None] if self.shared_value else self.value(x).view(B, T, H, self.head_size)
        d = torch.sigmoid(_f32(self.decay_logit))
        y, rho, rho_norm = rwkv8(q, _f32(v), d, state["rho"] if state else None, state["rho_norm"] if state else None)
        y = self.ln_x(y.reshape(B * T, H * self.E).to(x.dtype)).view(B, T, H * self.E)
        return self.output(y), {"rho": rho, "rho_norm": rho_norm}

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        """Decays at time scales log-spaced from 4 to 1024 tokens over the latent
        channels (d = 1 - 1/tau); projections orthogonal, the output projection 0."""
        H, L = self.decay_logit.shape
        tau = torch.logspace(math.log10(4), math.log10(1024), L, dtype=torch.float64).repeat(H, 1)
        d = 1 - 1 / tau
        self.decay_logit.copy_(torch.log(d / (1 - d)))
        _orthogonal_(self.query.weight, 1.0, gen)
        if not self.shared_value:
            _orthogonal_(self.value.weight, 1.0, gen)
        self.ln_x.weight.fill_(1.0)
        self.ln_x.bias.zero_()
        self.output.weight.zero_()
