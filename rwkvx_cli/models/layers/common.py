"""What every block kind shares: RWKV's channel mix, the token shift, RWKV-LM's
orthogonal init, and the small modules the delta layers use (short convolution,
gated RMSNorm)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rwkvx_cli.ops import channel_mix

# A layer's recurrent state: tensors by name, batch first.
State = dict[str, torch.Tensor]


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for the recurrences and norms (bf16 activations are upcast; fp64 stays)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def shifted(x: torch.Tensor, prev: torch.Tensor | None, starts: torch.Tensor | None = None) -> torch.Tensor:
    """x_{t-1} for every t, with x_{-1} = prev (zeros when None), and zeros where `starts` (bool
    [B, T]) marks a document's first token."""
    first = torch.zeros_like(x[:, :1]) if prev is None else prev[:, None].to(x.dtype)
    out = torch.cat([first, x[:, :-1]], dim=1)
    return out if starts is None else out.masked_fill(starts[..., None], 0.0)


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


class Graph:
    """The points of a layer's forward where another reading of the same computation differs from
    the plain one: layer-wise relevance propagation's modified graph (explain/graph.py) holds some
    quantities constant, marks the sums its ε-rule splits, and swaps the recurrences and norms for
    their rules. Layers with LRP rules write their forward once, through these hooks; `PLAIN`, the
    one every caller but explain passes, is the plain forward (identities, the fast ops)."""

    def const(self, t: torch.Tensor) -> torch.Tensor:
        """A quantity LRP's rule holds constant (a gate, a key, a normaliser)."""
        return t

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """A sum node, whose relevance LRP's ε-rule splits over its terms."""
        return t

    def layer_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def group_norm(self, norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def relu_square(self, z: torch.Tensor) -> torch.Tensor:
        return relu_square(z)

    def op(self, fn):
        """A recurrence op (ops.wkv7, ops.wkv4), called as the op is."""
        return fn


PLAIN = Graph()


def add_linear(x: torch.Tensor, h: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """x + linear(h), as one addmm; under autocast, whose matmul would round x's sum to its dtype,
    the matmul and then the sum in x's dtype, as `x + linear(h)` computes it."""
    if torch.is_autocast_enabled(x.device.type):
        return x + linear(h)
    return torch.addmm(x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1]), linear.weight.t()).view(x.shape)


def orthogonal_(w: torch.Tensor, gain: float, gen: torch.Generator) -> None:
    """Orthogonal with this gain, whatever the shape: RWKV-LM train_temp's `generate_init_weight` for
    RWKV-7's `.weight` matrices (its singular values are all `gain`)."""
    nn.init.orthogonal_(w, gain=gain, generator=gen)


def orthogonal_scaled_(w: torch.Tensor, gain: float, gen: torch.Generator) -> None:
    """Orthogonal with the gain scaled by sqrt(rows / cols) when rows > cols: RWKV-LM's other rule, that
    of train_temp's `ortho_init` (RWKV-7's low-rank matrices) and of v4neo's `generate_init_weight`
    (every RWKV-4 matrix), and of the head in both (0.5 sqrt(V / C) when V > C)."""
    rows, cols = w.shape
    nn.init.orthogonal_(w, gain=gain * (math.sqrt(rows / cols) if rows > cols else 1.0), generator=gen)


def depth_ratios(layer: int, n_layer: int) -> tuple[float, float]:
    """RWKV-LM's (r0, r1): 0 -> 1 and 1 -> ~0 from the bottom of the stack to the top."""
    return (layer / (n_layer - 1) if n_layer > 1 else 0.0), 1.0 - layer / n_layer


class ChannelMix(nn.Module):
    """RWKV's channel mix, in every block kind: value(relu(key(x + (x_{t-1} - x) x_k))²).
    `key_gain`: key's orthogonal gain at init (model.ffn_key_gain; None: v4neo's rule, sqrt(4) = 2, for
    RWKV-4 blocks)."""

    def __init__(self, C: int, key_gain: float | None = 1.0):
        super().__init__()
        self.key_gain = key_gain
        self.x_k = nn.Parameter(torch.zeros(1, 1, C))
        self.key = nn.Linear(C, 4 * C, bias=False)
        self.value = nn.Linear(4 * C, C, bias=False)

    def forward(
        self, x: torch.Tensor, shift: torch.Tensor | None = None, graph: Graph = PLAIN, starts=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # LRP's rule (docs/explain.md#channel-mix): the token shift is the weighted sum
        # (1 - x_k) x_t + x_k x_{t-1}; key and value are linear; relu² passes its relevance whole to z.
        k = graph.sum(x + (shifted(x, shift, starts) - x) * self.x_k)
        return graph.sum(self.value(graph.relu_square(graph.sum(self.key(k))))), x[:, -1]

    def fused_forward(
        self, x: torch.Tensor, ln: nn.LayerNorm, shift: torch.Tensor | None = None, starts=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x + forward(ln(x)) in one op (ops/channel_mix): x is the residual stream before `ln`;
        returns it with the channel mix added, and the token-shift state."""
        w = (self.x_k, self.key.weight, self.value.weight)
        return channel_mix(x, ln.weight, ln.bias, *w, shift, eps=ln.eps, starts=starts)

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        C = self.x_k.shape[-1]
        _, r1 = depth_ratios(layer, n_layer)
        ddd = (torch.arange(C, dtype=torch.float64) / C).view(1, 1, C)
        self.x_k.copy_(1.0 - ddd.pow(r1**4))
        if self.key_gain is None:
            orthogonal_scaled_(self.key.weight, 1.0, gen)  # RWKV-4 (v4neo): 1 x sqrt(4C / C)
        else:
            orthogonal_(self.key.weight, self.key_gain, gen)  # RWKV-LM train_temp: 1.0
        self.value.weight.zero_()


class ShortConv(nn.Module):
    """Causal depthwise convolution (kernel K) then SiLU, as Gated DeltaNet and KDA
    apply to q, k and v; the state is the last K - 1 inputs."""

    def __init__(self, channels: int, kernel: int = 4):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))

    def forward(
        self, x: torch.Tensor, prev: torch.Tensor | None, starts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With `starts` (bool [B, T]), a token reads no input from before its document's start: the
        window taps that reach across one read zeros, and so does the carried state's."""
        B, T, Cc = x.shape
        K = self.kernel
        if prev is None:
            prev = x.new_zeros(B, K - 1, Cc)
        xs = torch.cat([prev.to(x.dtype), x], dim=1)  # [B, K-1+T, Cc]
        if starts is None:
            y = F.conv1d(xs.transpose(1, 2), self.weight.to(x.dtype), groups=Cc).transpose(1, 2)
            return F.silu(y), xs[:, -(K - 1) :]
        # doc[b, j]: how many starts lie at or before position j of xs (the K-1 carried inputs first):
        # tap i of token t (input t - i) is read when no start lies in (t - i, t], i.e. doc equal
        pad = torch.zeros(B, K - 1, dtype=torch.long, device=x.device)
        doc = torch.cat([pad, starts.long().cumsum(1)], dim=1)  # [B, K-1+T]
        w = self.weight.to(x.dtype)[:, 0]  # [Cc, K]: tap K-1 reads input t, tap K-1-i input t-i
        y = xs[:, K - 1 :] * w[:, K - 1]
        for i in range(1, K):
            same = (doc[:, K - 1 - i : K - 1 - i + T] == doc[:, K - 1 :])[..., None]
            y = y + xs[:, K - 1 - i : K - 1 - i + T] * same * w[:, K - 1 - i]
        tail = (doc[:, -(K - 1) :] == doc[:, -1:])[..., None]  # carried inputs of the last document only
        return F.silu(y), xs[:, -(K - 1) :] * tail

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
