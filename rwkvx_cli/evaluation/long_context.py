"""What a model does with a long context, for any checkpoint (`rwkvx eval --by-position`,
`rwkvx eval --passkey`; docs/eval.md#long-context).

- **Loss by position.** The validation split cut into streams of `max_len + 1` tokens, each read
  whole in pieces of READ_CHUNK tokens with the state carried (MoBA blocks keep the keys and
  values read), and every token's next-token loss averaged by its position: bucket [lo, hi) holds
  the tokens predicted from lo .. hi - 1 tokens of context, log-spaced (1, 2-3, 4-7, ...). A model
  that uses its context has lower loss at later positions; one that cannot go past its training
  window rises there. `against`: a second checkpoint read on the same streams.
- **Passkey retrieval** (as RWKV-X and landmark attention evaluate it): a random five-digit number
  (one of KEYS: a guess is right with chance CHANCE, 1 in 90,000) in a sentence, "The pass key is
  12345. Remember it. 12345 is the pass key.", hidden at a depth (0: the start, 1: the end) of
  filler text cut from the validation tokens, with the question "What is the pass key? The pass
  key is" at the end, the whole prompt `length` tokens; the answer is read greedily, as many
  tokens as the key has, and counts when it starts with the key.

Library code: it returns numbers (and writes no files); the CLI renders them (render/eval.py) and
plots them (evaluation/plots.py). `on_progress(what, done, total)` hears the tokens read so far
(render.console.progress shows them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import check_output
from rwkvx_cli.models import document_starts
from rwkvx_cli.models.losses import chunk_rows
from rwkvx_cli.runs import open_checkpoint
from rwkvx_cli.runs.data import open_data
from rwkvx_cli.runs.layout import tokenizer_path
from rwkvx_cli.runs.opening import run_dir_named

MAX_LEN = 65_536  # --by-position's default longest position, where the split holds that much
READ_CHUNK = 4096  # tokens per forward when reading a long sequence (the state carried between)
MAX_STREAMS = 16  # streams read at once, at most
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
KEYS = range(10_000, 100_000)  # the keys a prompt hides: every five-digit number, drawn uniformly
CHANCE = 1 / len(KEYS)  # the accuracy of a guess (no reading of the prompt)


def position_buckets(max_len: int) -> list[tuple[int, int]]:
    """Log-spaced [lo, hi) ranges of positions 1 .. max_len: [1, 2), [2, 4), [4, 8), ..., the last
    one from the largest power of two below max_len to max_len (inclusive). Position p is the token
    predicted from p tokens of context."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    edges = [1]
    while edges[-1] * 2 < max_len:
        edges.append(edges[-1] * 2)
    edges.append(max_len + 1)
    return list(zip(edges[:-1], edges[1:], strict=True))


@torch.no_grad()
def read(
    model,
    x: torch.Tensor,
    runtime,
    state=None,
    on_chunk: Callable | None = None,
    chunk: int | None = None,
    reset_at: int | None = None,
):
    """Read the token ids `x` [B, T] in pieces of `chunk` tokens (default READ_CHUNK), each from the
    state the last one left; `on_chunk(lo, h)` gets each piece's hidden states [B, hi - lo, C].
    `reset_at`: the end-of-document id of a run trained with data.reset_at_eod, where a document
    starts (None: none). Returns the state after `x` and the last position's hidden state [B, C]."""
    chunk = chunk or READ_CHUNK
    h = None
    for lo in range(0, x.shape[1], chunk):
        piece = x[:, lo : lo + chunk].to(runtime.device)
        with runtime.autocast():
            h, state = model.hidden(piece, state, document_starts(piece, reset_at))
        if on_chunk is not None:
            on_chunk(lo, h)
    return state, h[:, -1]


def token_losses(model, h: torch.Tensor, targets: torch.Tensor, runtime) -> torch.Tensor:
    """Next-token loss (nats, fp32) of every position of h [B, T, C] against targets [B, T], the
    logits formed a block of rows at a time (no [B, T, V] tensor for a large vocabulary)."""
    rows, flat_h, flat_y = chunk_rows(model.head.out_features), h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    out = torch.empty(flat_y.shape, dtype=torch.float32)
    for lo in range(0, flat_y.numel(), rows):
        with runtime.autocast():
            logits = model.head(flat_h[lo : lo + rows])
        logp = torch.log_softmax(logits.float(), dim=-1)
        out[lo : lo + rows] = -logp.gather(1, flat_y[lo : lo + rows, None].to(logp.device))[:, 0].cpu()
    return out.view(targets.shape)


def streams_of(tokens, max_len: int | None) -> tuple[torch.Tensor, int]:
    """The validation split as consecutive streams of max_len + 1 tokens (at most MAX_STREAMS), and
    max_len (None: the longest the split holds, up to MAX_LEN)."""
    n = len(tokens)
    longest = n - 1
    if max_len is None:
        max_len = min(MAX_LEN, longest)
    if max_len < 1 or max_len > longest:
        raise UsageError(f"--max-len {max_len}: the validation split has {n:,} tokens, room for 1 .. {longest:,}")
    count = min(MAX_STREAMS, longest // max_len)
    arr = np.asarray(tokens[: count * max_len + 1]).astype(np.int64)
    rows = [arr[i * max_len : (i + 1) * max_len + 1] for i in range(count)]
    return torch.from_numpy(np.stack(rows)), max_len


def loss_by_position(
    model, streams: torch.Tensor, runtime, on_read: Callable[[int], None] | None = None, reset_at: int | None = None
) -> dict:
    """Mean next-token loss per position bucket over `streams` [S, L + 1], each read whole with the
    state carried (see the module docstring); `on_read(n)` after each piece: n tokens read so far;
    `reset_at`: see `read` (position p still counts the stream's tokens, across documents)."""
    S, L = streams.shape[0], streams.shape[1] - 1
    losses = torch.empty(S, L, dtype=torch.float32)

    def score(lo, h):
        losses[:, lo : lo + h.shape[1]] = token_losses(model, h, streams[:, lo + 1 : lo + 1 + h.shape[1]], runtime)
        if on_read is not None:
            on_read(S * (lo + h.shape[1]))

    model.eval()
    read(model, streams[:, :-1], runtime, on_chunk=score, reset_at=reset_at)
    buckets = []
    for lo, hi in position_buckets(L):
        part = losses[:, lo - 1 : hi - 1].double()  # position p is the target at index p
        buckets.append({"lo": lo, "hi": hi, "tokens": part.numel(), "loss": part.mean().item()})
    return {"loss": losses.double().mean().item(), "buckets": buckets}


def eval_by_position(
    checkpoint: Path,
    data_dir: Path | None = None,
    *,
    max_len: int | None = None,
    against: Path | None = None,
    reset_at_eod: bool | None = None,
    on_skip=None,
    on_progress=None,
) -> dict:
    """`rwkvx eval --by-position`: loss_by_position of a checkpoint on its run's validation split (or
    `data_dir`'s), and of the `against` checkpoint on the same streams; `on_progress("by position",
    done, total)`: the tokens read of both. `reset_at_eod`: see open_checkpoint (both checkpoints)."""
    opened = open_checkpoint(checkpoint, data_dir=data_dir, on_skip=on_skip, reset_at_eod=reset_at_eod)
    val = open_data(opened.config, opened.checkpoint.run_dir, data_dir, check_train=False).val
    streams, max_len = streams_of(val.tokens, max_len)
    other = None
    if against is not None:
        other = open_checkpoint(against, data_dir=data_dir, on_skip=on_skip, reset_at_eod=reset_at_eod)
        _check_same_tokens(opened, other)
    tokens = streams.shape[0] * max_len
    total = tokens * (2 if other is not None else 1)

    def reads(before: int):
        return None if on_progress is None else lambda n: on_progress("by position", before + n, total)

    if on_progress is not None:
        on_progress("by position", 0, total)  # the clock of its rate starts

    result = {"max_len": max_len, "streams": streams.shape[0], "tokens": tokens}
    result["runs"] = [_by_position_of(opened, streams, reads(0))]
    if other is not None:
        result["runs"].append(_by_position_of(other, streams, reads(tokens)))
    return result


def _by_position_of(opened, streams, on_read=None) -> dict:
    t, reset = opened.config.train, opened.config.data.reset_at_eod
    return {
        "checkpoint": str(opened.checkpoint.path),
        "step": opened.step,
        "ctx_len": t.ctx_len,
        "chunk_len": t.chunk_len,
        "tbptt": t.tbptt,
        "reset_at_eod": reset,
        **loss_by_position(opened.model, streams, opened.runtime, on_read, _reset_at(opened)),
    }


def _reset_at(opened) -> int | None:
    """The id that starts a document for this checkpoint's model (data.reset_at_eod), or None."""
    return opened.tokenizer.eod_id if opened.config.data.reset_at_eod else None


def _check_same_tokens(a, b) -> None:
    files = [tokenizer_path(x.checkpoint.run_dir) for x in (a, b)]
    same = (
        files[0].read_bytes() == files[1].read_bytes()
        if all(f.is_file() for f in files)
        else a.tokenizer.vocab_size == b.tokenizer.vocab_size
    )
    if not same:
        raise UsageError(
            f"--against {b.checkpoint.run_dir}: trained with another tokenizer than {a.checkpoint.run_dir}, "
            "so the two cannot read the same validation tokens"
        )


def parse_lengths(text: str) -> list[int]:
    """--passkey's lengths: comma-separated token counts (1,024 or 1k or 16K are accepted)."""
    lengths = []
    for part in text.split(","):
        word = part.strip().replace("_", "").lower()
        scale = 1024 if word.endswith("k") else 1
        digits = word[:-1] if scale > 1 else word
        if not digits.isdigit() or int(digits) < 1:
            raise UsageError(f"--passkey: {part.strip()!r} is not a length in tokens (e.g. 1024,4096,16k)")
        lengths.append(int(digits) * scale)
    return sorted(set(lengths))


def passkey_prompt(tokenizer, filler: np.ndarray, key: str, length: int, depth: float) -> list[int]:
    """`length` token ids: filler, the needle at `depth` of the filler, more filler, the question."""
    needle, question = tokenizer.encode(NEEDLE.format(key=key)), tokenizer.encode(QUESTION)
    n_fill = length - len(needle) - len(question)
    if n_fill < 0:
        raise UsageError(
            f"--passkey: {length} tokens do not hold the needle and the question ({len(needle) + len(question)} tokens)"
        )
    if len(filler) < n_fill:
        raise UsageError(
            f"--passkey {length}: the validation split has {len(filler):,} tokens, too few for the filler ({n_fill:,})"
        )
    before = round(depth * n_fill)
    fill = [int(t) for t in filler[:n_fill]]
    return fill[:before] + needle + fill[before:] + question


@torch.no_grad()
def passkey(
    model,
    tokenizer,
    val_tokens,
    runtime,
    lengths,
    depths=DEPTHS,
    trials: int = 4,
    seed: int = 0,
    on_progress=None,
    reset_at: int | None = None,
) -> dict:
    """Passkey retrieval accuracy by prompt length and needle depth (see the module docstring). Each
    (length, depth) runs `trials` prompts, with a key (of KEYS) and a filler offset drawn from (seed,
    length, depth, trial), read as one batch. `on_progress("passkey", done, total)`: prompt tokens read.
    `reset_at`: see `read`; the filler then leaves that id out, so that a prompt is one document."""
    tokens = np.asarray(val_tokens)
    if reset_at is not None:
        tokens = tokens[tokens != reset_at]
    model.eval()
    cells = []
    total, before = sum(lengths) * len(depths) * trials, 0
    if on_progress is not None:
        on_progress("passkey", 0, total)  # the clock of its rate starts
    for length in lengths:
        for d, depth in enumerate(depths):
            keys, prompts = [], []
            for trial in range(trials):
                rng = np.random.default_rng([seed, length, d, trial])
                key = str(int(rng.integers(KEYS.start, KEYS.stop)))
                start = int(rng.integers(0, max(1, len(tokens) - length)))
                keys.append(key)
                prompts.append(passkey_prompt(tokenizer, tokens[start:], key, length, depth))
            on_chunk = None
            if on_progress is not None:
                on_chunk = functools.partial(_read_so_far, on_progress, before, total, trials)
            n = max(len(tokenizer.encode(" " + k)) for k in keys)
            answers = _greedy(model, torch.tensor(prompts), n, runtime, on_chunk=on_chunk, reset_at=reset_at)
            before += trials * length
            got = [tokenizer.decode(a).strip() for a in answers]
            correct = sum(g.startswith(k) for g, k in zip(got, keys, strict=True))
            cells.append(
                {
                    "length": length,
                    "depth": depth,
                    "trials": trials,
                    "correct": correct,
                    "accuracy": correct / trials,
                    "answers": [{"key": k, "got": g} for k, g in zip(keys, got, strict=True)],
                }
            )
    figures = {"lengths": list(lengths), "depths": list(depths), "trials": trials, "seed": seed, "chance": CHANCE}
    return {**figures, "cells": cells}


def _read_so_far(on_progress, before: int, total: int, rows: int, lo: int, h) -> None:
    """read()'s on_chunk for passkey's progress: the tokens of the cells before, and of this one so far."""
    on_progress("passkey", before + rows * (lo + h.shape[1]), total)


def _greedy(
    model, prompts: torch.Tensor, n: int, runtime, on_chunk: Callable | None = None, reset_at: int | None = None
) -> list[list[int]]:
    """`n` greedy tokens after each row of `prompts` [B, T] (read with the state carried; on_chunk and
    reset_at: see read)."""
    state, h = read(model, prompts, runtime, on_chunk=on_chunk, reset_at=reset_at)
    out = []
    for _ in range(n):
        with runtime.autocast():
            nxt = model.head(h).float().argmax(-1)
        out.append(nxt.cpu())
        state, h = read(model, nxt[:, None], runtime, state, reset_at=reset_at)
    return torch.stack(out, 1).tolist()


def eval_passkey(
    checkpoint: Path,
    lengths: str,
    data_dir: Path | None = None,
    *,
    depths: list[float] | None = None,
    trials: int = 4,
    seed: int = 0,
    reset_at_eod: bool | None = None,
    on_skip=None,
    on_progress=None,
) -> dict:
    """`rwkvx eval --passkey LENGTHS`: `passkey` on a checkpoint, filler from its validation split.
    `reset_at_eod`: see open_checkpoint."""
    lengths_, depths_ = parse_lengths(lengths), list(depths or DEPTHS)
    opened = open_checkpoint(checkpoint, data_dir=data_dir, on_skip=on_skip, reset_at_eod=reset_at_eod)
    val = open_data(opened.config, opened.checkpoint.run_dir, data_dir, check_train=False).val
    model, tokenizer, runtime = opened.model, opened.tokenizer, opened.runtime
    reset = _reset_at(opened)
    result = passkey(model, tokenizer, val.tokens, runtime, lengths_, depths_, trials, seed, on_progress, reset)
    t = opened.config.train
    return {
        "checkpoint": str(opened.checkpoint.path),
        "step": opened.step,
        "ctx_len": t.ctx_len,
        "reset_at_eod": reset is not None,
        **result,
    }


def run_long_context(
    checkpoint: Path,
    data_dir: Path | None,
    seed: int,
    others: dict[str, object],
    on_skip=None,
    on_progress=None,
    *,
    by_position: bool = False,
    max_len: int | None = None,
    against: Path | None = None,
    passkey: str | None = None,
    trials: int | None = None,
    plot: Path | None = None,
    force: bool = False,
    reset_at_eod: bool | None = None,
) -> dict:
    """`rwkvx eval --by-position` or `--passkey`, its options checked (`others`: the eval options
    that do not go with them, by flag, None when not given). Returns the figures, with "kind"
    ("by_position" or "passkey") and "plot", where the picture goes: `plot`, by default
    by-position.png / passkey.png in the checkpoint's run directory (a checkpoint outside one needs
    `plot`); either checked as every output file is (fsio.check_output: an existing file only with
    `force`), before the model is read. `on_progress`: see eval_by_position and eval_passkey."""
    if by_position and passkey is not None:
        raise UsageError("--by-position and --passkey do not go together; run them separately")
    kind = "by_position" if by_position else "passkey" if passkey is not None else None
    wanted = {"--max-len": (max_len, "by_position"), "--against": (against, "by_position")}
    wanted |= {"--trials": (trials, "passkey"), "--plot": (plot, kind)}
    for flag, (value, needs) in wanted.items():
        if value is not None and (kind is None or needs != kind):
            goes = "--by-position or --passkey" if flag == "--plot" else "--" + needs.replace("_", "-")
            raise UsageError(f"{flag} goes with {goes}")
    for flag, value in others.items():
        if value is not None:
            raise UsageError(f"{flag} and --{kind.replace('_', '-')} do not go together; run them separately")
    if passkey is not None:
        parse_lengths(passkey)  # the options' own errors first
    flag = "--plot"
    if plot is None and Path(checkpoint).exists():  # (nothing there: the loader below says so)
        run_dir = run_dir_named(checkpoint)
        if run_dir is None:
            raise UsageError(
                f"--checkpoint {checkpoint} is not in a run directory: name the picture's file with --plot"
            )
        plot, flag = run_dir / ("by-position.png" if kind == "by_position" else "passkey.png"), "the default --plot"
    if plot is not None:
        check_output(plot, force, flag)  # before the model is read (fsio: the guard of every output file)
    if kind == "by_position":
        result = eval_by_position(
            checkpoint,
            data_dir,
            max_len=max_len,
            against=against,
            reset_at_eod=reset_at_eod,
            on_skip=on_skip,
            on_progress=on_progress,
        )
    else:
        options = dict(
            trials=trials or 4, seed=seed, reset_at_eod=reset_at_eod, on_skip=on_skip, on_progress=on_progress
        )
        result = eval_passkey(checkpoint, passkey, data_dir, **options)
    return {"kind": kind, **result, "plot": str(plot)}
