"""Sampling, one token at a time from the state: a recurrent block's is O(1) per token; a MoBA
block's is the keys and values read so far, which each new token attends (no re-reading)."""

from __future__ import annotations

import torch

from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.models.model import LM, document_starts


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    if not bool(torch.isfinite(logits).all()):
        # (damaged or overflowing weights: multinomial would stop with a traceback, argmax pick noise)
        raise RwkvxError("the model's next-token logits hold NaN or infinity: its weights are damaged or overflow")
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        keep[..., 0] = True  # the top token always stays (top_p 0: greedy)
        probs = torch.zeros_like(probs).scatter(-1, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


@torch.no_grad()
def generate(
    model: LM,
    prompt: list[int],
    n_tokens: int,
    temperature=1.0,
    top_p=0.9,
    seed=0,
    vocab_size: int | None = None,
    on_token=None,
    reset_at: int | None = None,
    state: list | None = None,
) -> list[int]:
    """`n_tokens` ids sampled after `prompt`; only ids below `vocab_size` (the tokenizer's, where the
    model's vocabulary is larger: its extra rows are never decodable). `on_token(n)`: n ids so far.
    `reset_at`: an id (the end-of-document one, for a run trained with data.reset_at_eod) that
    starts a document, in the prompt or sampled: the model reads it from a zero state. `state`: the state
    the prompt is read from (one row: a tuned initial state, models/state.py), or None: zeros."""
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)

    def pick(logits: torch.Tensor) -> int:
        return sample_next(logits[:vocab_size].cpu(), temperature, top_p, gen)

    ids = list(prompt) or [0]
    out: list[int] = []
    idx = torch.tensor([ids], device=device)
    logits, state = model(idx, state, starts=document_starts(idx, reset_at))
    for _ in range(n_tokens):
        nxt = pick(logits[0, -1])
        out.append(nxt)
        if on_token is not None:
            on_token(len(out))
        idx = torch.tensor([[nxt]], device=device)
        logits, state = model(idx, state, starts=document_starts(idx, reset_at))
    return out
