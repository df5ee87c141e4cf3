"""The document-boundary ablation's figures: runs trained with and without data.reset_at_eod, each
evaluated both ways (docs/training.md#should-i-reset-at-document-boundaries).

    python -m rwkvx_cli.evaluation.reset_ablation RUN... [--max-len 8192] [--png PATH] [--json PATH] [--force]
    python -m rwkvx_cli.evaluation.reset_ablation --from-json PATH [--png PATH]

Each RUN is a finished run directory (its newest good checkpoint is read). For every run and both
evaluation settings (a fresh state at each end-of-document token, or the state carried across):
- the validation loss over the split's consecutive windows of the run's ctx_len (what `rwkvx eval
  --reset-at-eod` / `--no-reset-at-eod` print);
- that loss by the predicted token's position in its document (0: the document's first token);
- the loss by position in long streams read with the state carried (`rwkvx eval --by-position`),
  where a model that never resets meets more documents in its state than it trained on.
The table gives each figure's mean and sample standard deviation over the runs of one training
setting (the seeds); the picture draws the last two, one line per training x evaluation setting.
`--from-json` redraws both from an earlier `--json`; an existing --png or --json is replaced only with
--force.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from rwkvx_cli.entry import ArgumentParser, at_least, input_text, run_main
from rwkvx_cli.errors import UsageError
from rwkvx_cli.evaluation.long_context import loss_by_position, read, streams_of, token_losses
from rwkvx_cli.fsio import check_output, write_output
from rwkvx_cli.models import document_starts
from rwkvx_cli.runs import open_checkpoint
from rwkvx_cli.runs.data import open_data

# Buckets of the position in the document, [lo, hi): the first token, the first line (a speaker's
# name in the bundled Shakespeare), then octaves.
DOC_BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 256), (256, 1 << 30))


def document_positions(tokens: np.ndarray, eod_id: int) -> np.ndarray:
    """For each token, its offset from the first token of its document: 0 right after an
    end-of-document token (and at the split's first token); the end-of-document token itself ends
    its document, so it gets the document's length."""
    n = len(tokens)
    idx = np.arange(n)
    after_eod = np.zeros(n, dtype=bool)
    after_eod[0] = True
    after_eod[1:] = tokens[:-1] == eod_id
    last_start = np.maximum.accumulate(np.where(after_eod, idx, 0))
    return idx - last_start


@torch.no_grad()
def window_losses(opened, tokens: np.ndarray, reset: bool, batch: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Every next-token loss over the split's consecutive windows of the run's ctx_len, each window
    from a zero state (as validation reads them), and the stream index of each predicted token."""
    ctx = opened.config.train.ctx_len
    n = (len(tokens) - 1) // ctx
    arr = torch.from_numpy(tokens[: n * ctx + 1].astype(np.int64))
    x, y = arr[:-1].view(n, ctx), arr[1:].view(n, ctx)
    eod = opened.tokenizer.eod_id if reset else None
    losses = []
    for lo in range(0, n, batch):
        xb = x[lo : lo + batch].to(opened.runtime.device)
        with opened.runtime.autocast():
            h, _ = opened.model.hidden(xb, None, document_starts(xb, eod))
        losses.append(token_losses(opened.model, h, y[lo : lo + batch], opened.runtime))
    return torch.cat(losses).reshape(-1).double().numpy(), np.arange(1, n * ctx + 1)


@torch.no_grad()
def whole_read_losses(opened, tokens: np.ndarray, reset: bool) -> np.ndarray:
    """Every next-token loss of the split read as one stream with the state carried (in pieces): with
    `reset`, every document is read whole from its own start, as document-aligned windows longer
    than every document would read it."""
    x = torch.from_numpy(tokens.astype(np.int64))
    out = np.empty(len(tokens) - 1)

    def score(lo, h):
        out[lo : lo + h.shape[1]] = token_losses(
            opened.model, h, x[None, lo + 1 : lo + 1 + h.shape[1]], opened.runtime
        )[0]

    read(
        opened.model, x[None, :-1], opened.runtime, on_chunk=score, reset_at=opened.tokenizer.eod_id if reset else None
    )
    return out


def evaluate_run(run: Path, max_len: int | None) -> dict:
    """A run's figures under both evaluation settings (each function below is told which: the
    checkpoint is opened once)."""
    opened = open_checkpoint(run)
    result = {"run": str(run), "trained_reset": opened.config.data.reset_at_eod}
    tokens = np.asarray(open_data(opened.config, opened.checkpoint.run_dir, None, check_train=False).val.tokens)
    pos_all = document_positions(tokens, opened.tokenizer.eod_id)
    ctx = opened.config.train.ctx_len
    streams, length = streams_of(tokens, max_len)
    for reset in (False, True):
        losses, where = window_losses(opened, tokens, reset)
        pos = pos_all[where]
        by_doc = [float(losses[(pos >= lo) & (pos < hi)].mean()) for lo, hi in DOC_BUCKETS]
        cut = where - pos < (where - 1) // ctx * ctx  # the document began before its window's first token
        whole = whole_read_losses(opened, tokens, reset)[where - 1]
        eod = opened.tokenizer.eod_id if reset else None
        stream = loss_by_position(opened.model, streams, opened.runtime, reset_at=eod)
        result["eval_reset" if reset else "eval_carry"] = {
            "loss": float(losses.mean()),
            "by_document_position": by_doc,
            "whole_read_loss": float(whole.mean()),
            "cut_share": float(cut.mean()),
            "cut_loss": float(losses[cut].mean()),
            "cut_whole_read_loss": float(whole[cut].mean()),
            "by_stream_position": stream["buckets"],
            "stream_len": length,
            "step": opened.step,
        }
    return result


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.4f} ± {sd:.4f}"


def table(results: list[dict]) -> str:
    """The markdown table: per training x evaluation setting, the loss overall and by document position."""
    head = ["trained", "evaluated", "runs", "val loss (nats)"]
    head += [
        f"pos {lo}" if hi == lo + 1 else (f"pos {lo}-{hi - 1}" if hi < 1 << 20 else f"pos {lo}+")
        for lo, hi in DOC_BUCKETS
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for trained in (False, True):
        group = [r for r in results if r["trained_reset"] == trained]
        if not group:
            continue
        for key in ("eval_carry", "eval_reset"):
            cells = [
                _label(trained),
                _label(key == "eval_reset"),
                str(len(group)),
                _mean_sd([r[key]["loss"] for r in group]),
            ]
            for i in range(len(DOC_BUCKETS)):
                cells.append(f"{statistics.fmean(r[key]['by_document_position'][i] for r in group):.3f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def alignment_table(results: list[dict]) -> str:
    """What document-aligned windows could gain: per training and evaluation setting, the share of
    predicted tokens whose document began before their window, their loss in the window and read
    with their whole document before them, and the split's loss both ways."""
    head = ["trained", "evaluated", "cut share", "cut: in window", "cut: whole document", "all: in window"]
    head += ["all: whole document"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = ("cut_share", "cut_loss", "cut_whole_read_loss", "loss", "whole_read_loss")
    for trained in (False, True):
        group = [r for r in results if r["trained_reset"] == trained]
        for key in ("eval_carry", "eval_reset") if group else ():
            cells = [_label(trained), _label(key == "eval_reset")]
            cells += [f"{statistics.fmean(r[key][k] for r in group):.4f}" for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bucket(lo: int, hi: int) -> str:
    return f"pos {lo}" if hi == lo + 1 else f"pos {lo}-{hi - 1}" if hi < 1 << 20 else f"pos {lo}+"


def _label(reset: bool) -> str:
    return "reset" if reset else "carried"


COMBOS = ((False, "eval_carry"), (False, "eval_reset"), (True, "eval_carry"), (True, "eval_reset"))
STREAM_FROM = 64  # the long streams' buckets drawn: the earlier ones hold a few tokens per stream


def plot(results: list[dict]) -> bytes:
    """The picture, as PNG bytes. Three panels, one colour per training setting, solid: evaluated carried,
    dashed: reset. The validation loss (bars: the mean, dots: each run); then, by position in the document
    and along long streams, the mean loss minus that of the runs trained and evaluated carried (RWKV-LM's
    way)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, docs, streams) = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [0.8, 1.2, 1.2]})
    colors = {False: "tab:blue", True: "tab:orange"}
    names = [_bucket(lo, hi).removeprefix("pos ") for lo, hi in DOC_BUCKETS]
    base = [r for r in results if not r["trained_reset"]]

    def mean_curve(group, key, field, pick):
        """Per bucket, the mean over runs of pick(run's bucket) minus the same for the baseline's runs."""
        n = len(group[0][key][field])
        return [statistics.fmean(pick(r[key][field][b]) for r in group) for b in range(n)]

    def delta(group, key, field, pick):
        ref = mean_curve(base, "eval_carry", field, pick) if base else None
        own = mean_curve(group, key, field, pick)
        return own if ref is None else [a - b for a, b in zip(own, ref, strict=True)]

    for i, (trained, key) in enumerate(COMBOS):
        group = [r for r in results if r["trained_reset"] == trained]
        if not group:
            continue
        c, style = colors[trained], "--" if key == "eval_reset" else "-"
        label = f"trained {_label(trained)}, evaluated {_label(key == 'eval_reset')}"
        losses = [r[key]["loss"] for r in group]
        bars.bar(i, statistics.fmean(losses), color=c, alpha=0.35 if key == "eval_reset" else 0.8, label=label)
        bars.plot([i] * len(losses), losses, "k.", ms=4)
        docs.plot(
            range(len(names)),
            delta(group, key, "by_document_position", float),
            style,
            color=c,
            marker="o",
            ms=3,
            label=label,
        )
        hi = [b["hi"] for b in group[0][key]["by_stream_position"]]
        keep = [k for k, b in enumerate(group[0][key]["by_stream_position"]) if b["lo"] >= STREAM_FROM]
        curve = delta(group, key, "by_stream_position", lambda b: b["loss"])
        streams.plot([hi[k] for k in keep], [curve[k] for k in keep], style, color=c, marker="o", ms=3, label=label)
    lo = min(r[k]["loss"] for r in results for k in ("eval_carry", "eval_reset"))
    bars.set(ylim=(lo - 0.03, None), xticks=[], ylabel="validation loss (nats)", title="validation windows")
    docs.set(xticks=range(len(names)), xticklabels=names, xlabel="position of the predicted token in its document")
    docs.set(ylabel="loss - trained and evaluated carried (nats)", title="by position in the document")
    streams.set(xscale="log", xlabel="position in a stream read with its state carried")
    streams.set(ylabel="loss - trained and evaluated carried (nats)")
    streams.set(title=f"long streams across documents (--by-position, from {STREAM_FROM})")
    docs.legend(fontsize=8)
    for ax in (docs, streams):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m rwkvx_cli.evaluation.reset_ablation", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--max-len", type=at_least(1), default=8192, help="the long streams' length (--by-position)")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--from-json", type=Path, default=None, help="redraw from an earlier --json instead of evaluating"
    )
    parser.add_argument("--force", action="store_true", help="replace --png and --json if they exist")
    args = parser.parse_args(argv)
    if (args.from_json is None) == (not args.runs):
        parser.error("give the run directories or --from-json PATH (one of them)")
    if args.png is not None and args.json is not None and os.path.abspath(args.png) == os.path.abspath(args.json):
        parser.error("--png and --json name the same file")
    for path, flag in ((args.png, "--png"), (args.json, "--json")):
        if path is not None:
            check_output(path, args.force, flag)  # before minutes of evaluation
    if args.from_json is not None:
        results = read_results(args.from_json)
    else:
        results = []
        for i, run in enumerate(args.runs):  # a few minutes each on two cores: a plain line per run
            print(f"[{i + 1}/{len(args.runs)}] evaluating {run} both ways", file=sys.stderr, flush=True)
            results.append(evaluate_run(run, args.max_len))
    try:
        figures = table(results) + "\n\n" + alignment_table(results)
        picture = None if args.png is None else plot(results)
    except (KeyError, IndexError, TypeError, ValueError, statistics.StatisticsError) as e:
        if args.from_json is None:
            raise
        raise UsageError(f"--from-json {args.from_json}: not what --json writes ({type(e).__name__}: {e})") from None
    print(figures)
    if args.json is not None:
        write_output(args.json, json.dumps(results, indent=1), force=args.force, flag="--json")
    if picture is not None:
        write_output(args.png, picture, force=args.force, flag="--png")
        print(f"wrote {args.png}")


def read_results(path: Path) -> list[dict]:
    """An earlier --json: its per-run figures (a list of objects, each with its training setting)."""
    try:
        results = json.loads(input_text(path, "--from-json"))
    except json.JSONDecodeError as e:
        raise UsageError(f"--from-json {path} is not JSON: {e}") from None
    fields = ("run", "trained_reset", "eval_carry", "eval_reset")
    runs = isinstance(results, list) and bool(results)
    if not runs or not all(isinstance(r, dict) and set(fields) <= r.keys() for r in results):
        raise UsageError(f"--from-json {path} is not what --json writes (runs, each with {', '.join(fields)})")
    return results


if __name__ == "__main__":
    run_main(main)
