"""RWKV-X's MoBA sparse attention as a time mix: q (`receptance`), k, v and output
projections around the `moba` op (docs/operators.md#moba); no positional encoding
and no recurrent state, so a model with MoBA blocks re-reads its context."""

from __future__ import annotations

import torch
from torch import nn

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models.layers.common import PLAIN, Graph, orthogonal_
from rwkvx_cli.ops.moba import moba


class MobaAttention(nn.Module):
    letter = "A"  # its letter in the model summary's block string

    def __init__(self, C: int, head_size: int, chunk: int, top_k: int):
        super().__init__()
        self.n_head, self.head_size, self.chunk, self.top_k = C // head_size, head_size, chunk, top_k
        self.receptance = nn.Linear(C, C, bias=False)  # q
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_id: int) -> MobaAttention:
        return cls(cfg.n_embd, cfg.head_size, cfg.moba_chunk, cfg.moba_top_k)

    def empty_state(self, B: int, device) -> None:
        return None

    def forward(self, x, v_first, state=None, graph: Graph = PLAIN):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, self.head_size) for p in (self.receptance, self.key, self.value))
        y = moba(q, k, v, chunk_size=self.chunk, top_k=self.top_k)
        return self.output(y.reshape(B, T, C)), v_first, None

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        """As RWKV-7's q, k, v and output projections."""
        for p, gain in ((self.receptance, 1.0), (self.key, 0.1), (self.value, 1.0)):
            orthogonal_(p.weight, gain, gen)
        self.output.weight.zero_()
