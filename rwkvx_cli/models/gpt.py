"""A small nanoGPT-style transformer: the baseline `rwkvx bench --model CFG --vs-gpt` times
against an RWKV config of the same size. A benchmark baseline only (not trainable through
`rwkvx train`).

    token embedding + learned positional embedding
    n_layer pre-LN blocks: x + attn(LN(x)), then x + mlp(LN(x))
        attention: fused qkv projection, n_head heads, causal
                   torch.nn.functional.scaled_dot_product_attention(is_causal=True), output projection
        mlp: C -> 4C, GELU, 4C -> C
    final LayerNorm, head tied to the token embedding (as nanoGPT and GPT-2)

Linears and LayerNorms carry biases (nanoGPT's default, GPT-2's layout); no dropout. Init as
nanoGPT: N(0, 0.02) weights, zero biases, the residual projections at 0.02 / sqrt(2 n_layer).
The forward has the RWKV LM's signature, so the trainer's loss helper (`micro_batch_loss`) runs
both models the same way: full logits, or with `targets` the chunked cross-entropy of the shared
loss code (models/losses.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rwkvx_cli.config import Config
from rwkvx_cli.models.losses import linear_cross_entropy


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    ctx_len: int

    @classmethod
    def matching(cls, cfg: Config) -> GPTConfig:
        """The GPT the same size as an RWKV config: its n_layer, n_embd and vocab_size, one head per
        model.head_size channels, and train.ctx_len positions."""
        m = cfg.model
        return cls(m.vocab_size, m.n_layer, m.n_embd, m.n_embd // m.head_size, cfg.train.ctx_len)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not divisible by n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # [B, T, 3C] -> three [B, H, T, C/H]
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.ctx_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            # LayerNorm weights keep their ones

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final-LayerNorm'd hidden states [B, T, C] that the (tied) head reads."""
        T = idx.shape[1]
        if T > self.cfg.ctx_len:
            raise ValueError(f"{T} tokens but the positional embedding has {self.cfg.ctx_len}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, state=None, targets: torch.Tensor | None = None, l2wrap: bool = False):
        """As the RWKV LM's forward: (logits [B, T, V], None), or with `targets` (the mean cross-entropy,
        None). A transformer has no recurrent state: `state` must be None."""
        if state is not None:
            raise ValueError("the GPT baseline has no recurrent state")
        x = self.hidden(idx)
        if targets is None:
            return F.linear(x, self.wte.weight), None
        return linear_cross_entropy(x, self.wte.weight, targets, l2wrap=l2wrap), None

    def train_flops_per_token(self, ctx_len: int) -> int:
        """Training FLOPs per token, nanoGPT's / PaLM's count: 6 x the matmul weights (every 2-D
        weight but the positional table; the tied token table counts once, as the head) plus
        attention's score and value products at 12 x n_layer x n_embd x ctx_len (the full T x T
        square, fwd + bwd; half of it is masked by causality)."""
        matmul = sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2 and n != "wpe.weight")
        return int(6 * matmul + 12 * self.cfg.n_layer * self.cfg.n_embd * ctx_len)
