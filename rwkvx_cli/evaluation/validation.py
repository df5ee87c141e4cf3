"""Validation loss, perplexity and bits per byte: training's periodic validation, and `rwkvx eval`
of a checkpoint (with an optional sample of generated text)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.sampler import document_windows, documents, sequential_windows
from rwkvx_cli.errors import RwkvxError, UsageError
from rwkvx_cli.models import LM, document_starts
from rwkvx_cli.models.generate import generate
from rwkvx_cli.runs import open_checkpoint
from rwkvx_cli.runs.data import open_data
from rwkvx_cli.runs.runtime import Runtime

Progress = Callable[..., None]  # on_progress(what, done, total): the CLI's progress (render.console.progress)


@torch.no_grad()
def evaluate(
    model: LM,
    tokens,
    ctx_len: int,
    batch: int,
    max_tokens: int,
    tokenizer,
    runtime: Runtime,
    on_progress: Progress | None = None,
    reset_at_eod: bool = False,
    masks=None,
) -> dict:
    """Mean next-token loss over consecutive windows of the split (up to max_tokens), and
    bits per byte over exactly the UTF-8 bytes of the tokens it predicted (None where they decode to
    no bytes: end-of-document tokens alone, a rate over nothing); the forward runs
    on `runtime`'s device under its precision, as training does. `on_progress("validation", done,
    total)` after each batch: the tokens predicted of those it will predict. `reset_at_eod`: each
    document starts from a zero state (data.reset_at_eod), as the run trained. With the split's loss
    `masks` (a byte per token), the loss and bits per byte are over the predicted tokens that carry
    loss (`loss_tokens` of them; the loss is None when there are none), the others only read."""
    model.eval()
    total, count = 0.0, 0
    loss_total, loss_count = 0.0, 0
    planned = max(0, min(max_tokens, len(tokens) - 1))  # about: the last batch may go past max_tokens
    if on_progress is not None:
        on_progress("validation", 0, planned)  # the clock of its rate starts
    xs, ys, ms = [], [], []

    def flush():
        nonlocal total, count, loss_total, loss_count
        x, y = torch.stack(xs).to(runtime.device), torch.stack(ys).to(runtime.device)
        starts = document_starts(x, tokenizer.eod_id if reset_at_eod else None)
        with runtime.autocast():
            if masks is None:
                loss, _ = model.loss(x, y, starts=starts)
            else:
                logits, _ = model(x, starts=starts)
                each = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
                m = torch.stack(ms).to(runtime.device).flatten()
                loss_total += float(each[m].double().sum())
                loss_count += int(m.sum())
                loss = each.mean()
        value = _finite(loss.item(), f"validation window {count // ctx_len + 1}")
        total += value * y.numel()
        count += y.numel()
        xs.clear()
        ys.clear()
        ms.clear()
        if on_progress is not None:
            on_progress("validation", min(count, planned), planned)

    for window in sequential_windows(tokens, ctx_len, masks):
        x, y = window[:2]
        if xs and x.shape[1] != xs[0].shape[0]:
            flush()  # the last window is shorter: its own batch
        xs.append(x[0])
        ys.append(y[0])
        if masks is not None:
            ms.append(window[2][0])
        if len(xs) == batch:
            flush()
        if count + len(xs) * ctx_len >= max_tokens:
            break
    if xs:
        flush()
    if on_progress is not None and 0 < count < planned:
        on_progress("validation", count, count)  # done: the windows ended before the estimate
    model.train()
    predicted = np.asarray(tokens[1 : count + 1])
    if masks is not None:
        predicted = predicted[np.asarray(masks[1 : count + 1]) != 0]
        total = loss_total
    counted = max(count, 1) if masks is None else loss_count  # (as ever: an empty split reads 0, not None)
    out = {**_figures(total, counted, predicted.tolist(), tokenizer), "tokens": count}
    if masks is not None:
        out["loss_tokens"] = loss_count
    return out


@torch.no_grad()
def evaluate_documents(
    model: LM,
    tokens,
    ctx_len: int,
    batch: int,
    max_tokens: int,
    tokenizer,
    runtime: Runtime,
    on_progress: Progress | None = None,
    masks=None,
    initial=None,
) -> dict:
    """`evaluate` for a run of train.sampler=documents: every document that starts among the first
    `max_tokens` tokens of the split, read alone from its start (its first `ctx_len` targets), from the
    tuned initial state `initial` (models/state.py's InitialState: train.tune=state) or the zero state,
    as training reads its rows. The loss and bits per byte are over the targets inside the documents
    (their end-of-document id included) that carry loss by `masks` (all, without); `tokens` counts the
    targets inside the documents, `documents` the documents. `on_progress("validation", done, total,
    "documents")` after each batch."""
    model.eval()
    starts, _ = documents(tokens, tokenizer.eod_id)
    planned = int((starts < max_tokens).sum())
    if on_progress is not None:
        on_progress("validation", 0, planned, "documents")
    total, count, inside, done = 0.0, 0, 0, 0
    predicted: list[int] = []
    rows: list[tuple] = []

    def flush():
        nonlocal total, count, inside, done
        x, y, m = (torch.cat([r[i] for r in rows]).to(runtime.device) for i in range(3))
        state = initial.expand(x.shape[0]) if initial is not None else None
        with runtime.autocast():
            logits, _ = model(x, state)
        each = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        carries = m.flatten()
        total += _finite(float(each[carries].double().sum()), f"validation documents {done + 1}-{done + len(rows)}")
        count += int(carries.sum())
        predicted.extend(y.flatten()[carries].tolist())
        inside += sum(int(r[3]) for r in rows)
        done += len(rows)
        rows.clear()
        if on_progress is not None:
            on_progress("validation", done, planned, "documents")

    for x, y, m, n_inside in document_windows(tokens, tokenizer.eod_id, ctx_len, max_tokens, masks):
        rows.append((x, y, m, n_inside))
        if len(rows) == batch:
            flush()
    if rows:
        flush()
    model.train()
    if not done:
        raise DataError(f"the split holds no document with a token to predict among its first {max_tokens:,} tokens")
    out = {**_figures(total, count, predicted, tokenizer), "tokens": inside, "documents": done}
    if masks is not None:
        out["loss_tokens"] = count
    return out


def _finite(value: float, where: str) -> float:
    """A batch's loss, refused in one line when not finite (before its progress: not a NaN loss)."""
    if not math.isfinite(value):
        raise RwkvxError(f"the loss on {where} is {value}: the model's weights or settings are damaged, or overflow")
    return value


def _figures(total: float, count: int, predicted: list[int], tokenizer) -> dict:
    """Loss, perplexity and bits per byte of `count` predicted targets whose losses sum to `total` (None
    over no target; bits per byte None where `predicted`'s tokens decode to no bytes)."""
    if not count:
        return {"loss": None, "ppl": None, "bpb": None}
    n_bytes = len(tokenizer.decode(predicted).encode("utf-8"))
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bpb": total / math.log(2) / n_bytes if n_bytes else None}


def eval_checkpoint(
    checkpoint: Path,
    data_dir: Path | None = None,
    *,
    prompt: str | None = None,
    n_tokens: int = 200,
    temperature: float = 1.0,
    top_p: float = 0.85,
    seed: int = 0,
    reset_at_eod: bool | None = None,
    documents: bool | None = None,
    state: Path | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
    on_progress: Progress | None = None,
) -> dict:
    """`rwkvx eval`: the validation figures of a checkpoint (a checkpoint dir, or a run dir: its
    newest good one) on its run's validation split (or `data_dir`'s), under the run's train.precision
    (fp32 where this device cannot run it) and data.reset_at_eod (`reset_at_eod`: True or False
    instead, see open_checkpoint); with `prompt`, also a sampled continuation. `documents`: every
    validation document read alone from its start (`evaluate_documents`) or consecutive windows
    (None: as the run trained, train.sampler). A state-tuned run's checkpoint, or `state` (rwkvx's
    state file, for this checkpoint's weights), starts every document and the sample from its tuned
    state: documents alone. `on_progress`: see `evaluate`; then ("generating", done, n_tokens), in
    "tokens" as all of them."""
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("--generate: the prompt is not valid UTF-8 text") from None
    opened = open_checkpoint(
        checkpoint, data_dir=data_dir, on_skip=on_skip, reset_at_eod=reset_at_eod, state=state, tuned=True
    )
    cfg, t = opened.config, opened.config.train
    initial = opened.initial
    if initial is not None and documents is False:
        raise UsageError("--no-documents: a tuned state starts each document; it reads no window from the middle")
    if initial is not None and cfg.data.reset_at_eod:
        raise UsageError("--reset-at-eod: a tuned state starts each document, where a reset would start from zeros")
    by_document = documents if documents is not None else (t.sampler == "documents" or initial is not None)
    val = open_data(cfg, opened.checkpoint.run_dir, data_dir, check_train=False).val
    start = time.perf_counter()
    figures = (t.ctx_len, t.micro_batch, t.eval_tokens, opened.tokenizer, opened.runtime)
    masks = getattr(val, "mask", None)
    if by_document:
        ev = evaluate_documents(
            opened.model, val.tokens, *figures, on_progress=on_progress, masks=masks, initial=initial
        )
    else:
        ev = evaluate(
            opened.model, val.tokens, *figures, on_progress=on_progress, reset_at_eod=cfg.data.reset_at_eod, masks=masks
        )
    if ev.get("loss_tokens") == 0:
        raise DataError(
            f"no target among the first {ev['tokens']:,} validation tokens carries loss (the split's loss masks); "
            "evaluate more of them (train.eval_tokens)"
        )
    ev["tokens_per_s"] = ev["tokens"] / (time.perf_counter() - start)
    ev["step"] = opened.step
    ev["reset_at_eod"] = cfg.data.reset_at_eod
    ev["by_document"] = by_document
    ev["tuned_state"] = str(state) if state is not None else (str(opened.checkpoint.path) if initial else None)
    ev["checkpoint"] = str(opened.checkpoint.path)
    if prompt is not None:
        tok = opened.tokenizer
        on_token = None
        if on_progress is not None:

            def on_token(done: int) -> None:
                on_progress("generating", done, n_tokens)

            on_token(0)
        reset = tok.eod_id if cfg.data.reset_at_eod else None
        ids = generate(
            opened.model, tok.encode(prompt), n_tokens, temperature, top_p, seed, tok.vocab_size, on_token, reset,
            state=None if initial is None else initial.expand(1),
        )
        ev["sample"] = prompt + opened.tokenizer.decode(ids)
    return ev
