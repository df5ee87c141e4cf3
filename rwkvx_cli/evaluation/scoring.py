"""Token-level scoring for downstream evaluation, with no dependency on lm-eval.

`score_continuations` returns, for each (context ids, continuation ids) pair, the summed
log-probability of the continuation given the context and whether every continuation token is
the model's argmax. One forward per batch over context + continuation: rows are right-padded
(the model is causal, so padding after a row's tokens cannot change that row's logits), and only
the hidden states at the scored positions go through the head, so the [B, T, V] logits never
exist whole. A pure recurrent model runs a long batch in chunks of `max_len` tokens carrying its
state (every token still sees its whole context); a model with attention blocks keeps the last
`max_len + 1` tokens of each sequence, as lm-eval's HuggingFace backend does.
"""

from __future__ import annotations

import torch

from rwkvx_cli.models.model import LM
from rwkvx_cli.runs.runtime import autocast

HEAD_ROWS = 2048  # hidden rows per head matmul: bounds the fp32 [rows, V] log-softmax


def _truncate(ctx: list[int], cont: list[int], max_len: int) -> tuple[list[int], int]:
    """The input ids and how many of them are context, keeping at most max_len + 1 tokens."""
    whole = (list(ctx) + list(cont))[-(max_len + 1) :]
    return whole, max(len(whole) - len(cont), 1)


@torch.no_grad()
def score_continuations(
    model: LM,
    pairs: list[tuple[list[int], list[int]]],
    batch_size: int,
    max_len: int,
    progress=None,
    mode: str = "fp32",
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), all continuation tokens greedy) for each pair, in order.
    Every context must hold at least one token and every continuation at least one. `progress(n)`
    is called after each batch with the number of pairs it scored. The forward runs under the
    resolved precision `mode` (runs/runtime.py); log-softmax is always fp32."""
    model.eval()
    device = next(model.parameters()).device
    recurrent = model.recurrent
    seqs = []
    for ctx, cont in pairs:
        if not ctx or not cont:
            raise ValueError("each request needs at least one context and one continuation token")
        if recurrent:
            seqs.append((list(ctx) + list(cont), len(ctx)))
        else:
            seqs.append(_truncate(ctx, cont, max_len))
    # Longest first: rows of one batch have similar lengths (little padding); the first batch is
    # the largest, so an out-of-memory shows at once.
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    results: list[tuple[float, bool]] = [(0.0, True)] * len(seqs)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        for i, res in zip(
            idx, _score_batch(model, [seqs[i] for i in idx], device, max_len, recurrent, mode), strict=True
        ):
            results[i] = res
        if progress is not None:
            progress(len(idx))
    return results


def _score_batch(model: LM, rows, device, max_len: int, recurrent: bool, mode: str) -> list[tuple[float, bool]]:
    B = len(rows)
    T = max(len(seq) for seq, _ in rows) - 1  # inputs: each sequence but its last token
    inputs = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    scored = torch.zeros(B, T, dtype=torch.bool)
    for b, (seq, n_ctx) in enumerate(rows):
        ids = torch.tensor(seq, dtype=torch.long)
        inputs[b, : len(seq) - 1] = ids[:-1]
        targets[b, : len(seq) - 1] = ids[1:]
        scored[b, n_ctx - 1 : len(seq) - 1] = True  # logits at position p predict token p + 1
    inputs, targets, scored = inputs.to(device), targets.to(device), scored.to(device)
    total = torch.zeros(B, dtype=torch.float64, device=device)
    greedy = torch.ones(B, dtype=torch.bool, device=device)
    step = max_len if recurrent else T
    state = None
    for s in range(0, T, step):
        e = min(s + step, T)
        with autocast(mode, device):
            h, state = model.hidden(inputs[:, s:e], state)
        sel = scored[:, s:e]
        if not sel.any():
            continue
        rows_of = torch.arange(B, device=device)[:, None].expand(B, e - s)[sel]
        h, tgt = h[sel], targets[:, s:e][sel]
        for r in range(0, h.shape[0], HEAD_ROWS):
            with autocast(mode, device):
                logits = model.head(h[r : r + HEAD_ROWS])
            logp = torch.log_softmax(logits.float(), dim=-1)
            t = tgt[r : r + HEAD_ROWS]
            total.index_add_(0, rows_of[r : r + HEAD_ROWS], logp.gather(1, t[:, None])[:, 0].double())
            hit = logp.argmax(-1) == t
            greedy[rows_of[r : r + HEAD_ROWS][~hit]] = False
        if not recurrent:
            break
    return [(float(total[b]), bool(greedy[b])) for b in range(B)]


@torch.no_grad()
def greedy_until(
    model: LM, prompt: list[int], max_new: int, max_len: int, stop, eod_id: int | None = None, mode: str = "fp32"
) -> list[int]:
    """Greedy continuation of `prompt`: at most `max_new` tokens, stopping after `eod_id` (not
    kept) or once `stop(ids)` is true. A pure recurrent model advances its state one token at a
    time; a model with attention re-reads its last `max_len` tokens each step."""
    model.eval()
    device = next(model.parameters()).device
    ids = list(prompt) or [eod_id or 0]
    out: list[int] = []
    state = None
    feed = ids
    for _ in range(max_new):
        with autocast(mode, device):
            if model.recurrent:
                h, state = model.hidden(torch.tensor([feed], device=device), state)
            else:
                h, _ = model.hidden(torch.tensor([(ids + out)[-max_len:]], device=device))
            nxt = int(model.head(h[0, -1]).float().argmax())
        if eod_id is not None and nxt == eod_id:
            break
        out.append(nxt)
        if stop(out):
            break
        feed = [nxt]
    return out
