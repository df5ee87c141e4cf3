"""What every block kind shares: RWKV's channel mix, the token shift, RWKV-LM's
orthogonal init, and the small modules the delta layers use (short convolution,
gated RMSNorm)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# A layer's recurrent state: tensors by name, batch first.
State = dict[str, torch.Tensor]


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for the recurrences and norms (bf16 activations are upcast; fp64 stays)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def shifted(x: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """x_{t-1} for every t, with x_{-1} = prev (zeros when None)."""
    first = torch.zeros_like(x[:, :1]) if prev is None else prev[:, None].to(x.dtype)
    return torch.cat([first, x[:, :-1]], dim=1)


class _ReluSquare(torch.autograd.Function):
    """relu(x)², saving relu(x) and computing the gradient 2 relu(x) dy in two passes. Autograd's
    graph of `relu(x) ** 2` takes four in the backward (a copy, two products, the relu mask) over
    the 4C-wide channel-mix hidden state, which by then is read from memory: 5-7% of an eager
    tiny training step (docs/benchmarks.md). The same values and gradients (the factor 2 is
    exact; a masked gradient is 0 times dy, -0 for a negative dy); torch.compile traces it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x)
        ctx.save_for_backward(h)
        return h * h

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return (dy * h).mul_(2.0)


def relu_square(x: torch.Tensor) -> torch.Tensor:
    return _ReluSquare.apply(x)


def orthogonal_(w: torch.Tensor, gain: float, gen: torch.Generator) -> None:
    """RWKV-LM's rule: the gain is scaled by sqrt(rows / cols) when rows > cols."""
    rows, cols = w.shape
    nn.init.orthogonal_(w, gain=gain * (math.sqrt(rows / cols) if rows > cols else 1.0), generator=gen)


def depth_ratios(layer: int, n_layer: int) -> tuple[float, float]:
    """RWKV-LM's (r0, r1): 0 -> 1 and 1 -> ~0 from the bottom of the stack to the top."""
    return (layer / (n_layer - 1) if n_layer > 1 else 0.0), 1.0 - layer / n_layer


def lrp_eps(z: torch.Tensor, eps: float) -> torch.Tensor:
    """LRP's ε-rule at a sum node z = Σ_i c_i, as a gradient scale (docs/explain.md#the-method).

    The value is z; the gradient through it is multiplied by s = z / (z + ε·sign z) (sign 0 = +1).
    With relevance carried as R = x ⊙ ∂f/∂x, the ε-rule's split R(c_i) = c_i R(z) / (z + ε·sign z)
    is then exactly what autograd computes; ε = 0 is the z-rule (the identity here)."""
    if eps == 0:
        return z
    s = (z / (z + eps * torch.where(z >= 0, 1.0, -1.0).to(z.dtype))).detach()
    return z * s + (z * (1 - s)).detach()


def layer_norm_lrp(ln: nn.LayerNorm, x: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """LayerNorm with LRP's usual rule: the normaliser 1/sqrt(var + eps_ln) is a constant, so the
    map is linear in x (the centring) plus the bias, which keeps the relevance it is sent."""
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + ln.eps).detach()
    return lrp_eps((x - x.mean(-1, keepdim=True)) * rstd * ln.weight + ln.bias, eps)


class ChannelMix(nn.Module):
    """RWKV's channel mix, in every block kind: value(relu(key(x + (x_{t-1} - x) x_k))²)."""

    def __init__(self, C: int):
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(1, 1, C))
        self.key = nn.Linear(C, 4 * C, bias=False)
        self.value = nn.Linear(4 * C, C, bias=False)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        k = x + (shifted(x, shift) - x) * self.x_k
        return self.value(relu_square(self.key(k))), x[:, -1]

    def lrp_forward(self, x: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
        """The forward of a fresh sequence as LRP's modified graph (docs/explain.md#channel-mix).

        The token shift is the weighted sum (1 - x_k) x_t + x_k x_{t-1}; key and value are linear
        maps (z-rule); relu passes relevance through (relu(z) = z where it is on); the square
        relu(z)·relu(z) takes one factor as a constant gate, so the relevance of the square goes
        whole to z (the other factor would double-count it). Gradient × input on this graph is
        then the composed ε-rule."""
        k = lrp_eps(x + (shifted(x, None) - x) * self.x_k, eps)
        h = torch.relu(lrp_eps(self.key(k), eps))
        return lrp_eps(self.value(h * h.detach()), eps)

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        C = self.x_k.shape[-1]
        _, r1 = depth_ratios(layer, n_layer)
        ddd = (torch.arange(C, dtype=torch.float64) / C).view(1, 1, C)
        self.x_k.copy_(1.0 - ddd.pow(r1**4))
        orthogonal_(self.key.weight, 1.0, gen)
        self.value.weight.zero_()


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
        o32 = upcast(o)
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (o32 * self.weight).to(o.dtype) * gate
