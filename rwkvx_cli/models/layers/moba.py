"""RWKV-X's MoBA sparse attention as a time mix: q (`receptance`), k, v and output
projections around the `moba` op (docs/operators.md#moba); no positional encoding.

Its state is the keys and values of the tokens read so far: a sequence read in pieces, each from
the state the last one left (chunked BPTT, generation one token at a time), attends as it would
read whole. Under autograd (chunked BPTT) the state holds one key and one value tensor per piece,
so that each chunk boundary keeps only its own chunk's keys and values (a concatenation per
boundary would keep the whole prefix again at every boundary); otherwise one tensor each, the
whole prefix. The cache holds the keys and values in the activations' dtype, as the op reads them.
The state grows with the tokens read, so it has no fixed-size zero state (`empty_state` is None)
and truncated BPTT does not carry it across steps (`LM.carried`).

With document starts the state also holds the starts of the tokens read (`starts`, bool [B, P],
kept in pieces as the keys are), which the op needs to find where each row's ongoing document
began in the cache (docs/operators.md#moba): a piece after a start attends as the document read
alone from an empty cache would. Until a window brings starts the state holds none of them."""

from __future__ import annotations

import torch
from torch import nn

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models.layers.common import PLAIN, Graph, orthogonal_
from rwkvx_cli.ops.moba import moba


class MobaAttention(nn.Module):
    letter = "A"  # its letter in the model summary's block string
    grows = True  # its state grows with the tokens read (not carried across TBPTT steps)

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

    def forward(self, x, v_first, state=None, graph: Graph = PLAIN, starts=None):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, self.head_size) for p in (self.receptance, self.key, self.value))
        k_parts, v_parts = (state["k"], state["v"]) if state and "k" in state else ((), ())
        s_parts = state.get("starts", ()) if state else ()
        cache = (_joined(k_parts), _joined(v_parts)) if k_parts else None
        cache_starts = _joined(s_parts) if s_parts else None
        y, (keys, values) = moba(
            q, k, v, cache, chunk_size=self.chunk, top_k=self.top_k, starts=starts, cache_starts=cache_starts
        )
        grad = torch.is_grad_enabled()
        new = {"k": (*k_parts, k), "v": (*v_parts, v)} if grad else {"k": (keys,), "v": (values,)}
        if starts is not None or s_parts:
            if not s_parts and cache is not None:  # the first starts: the cache read so far had none
                s_parts = (torch.zeros(B, cache[0].shape[1], dtype=torch.bool, device=x.device),)
            parts = (*s_parts, torch.zeros(B, T, dtype=torch.bool, device=x.device) if starts is None else starts)
            new["starts"] = parts if grad else (_joined(parts),)
        return self.output(y.reshape(B, T, C)), v_first, new

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        """As RWKV-7's q, k, v and output projections."""
        for p, gain in ((self.receptance, 1.0), (self.key, 0.1), (self.value, 1.0)):
            orthogonal_(p.weight, gain, gen)
        self.output.weight.zero_()


def _joined(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
