"""`rwkvx eval`: validation figures, lm-eval's scores, and the long-context tables and pictures."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from rwkvx_cli.render.console import err, fmt_bpb, out, print_wide


def render_evaluation(mode: str, result, as_json: bool, output: Path | None) -> None:
    """What `rwkvx eval` computed (evaluation/command.py), by mode."""
    if mode == "plain":
        render_eval(result, as_json)
    elif mode == "tasks":
        render_tasks(result, as_json, output)
    else:
        render_long_context(result, as_json)


def render_eval(ev: dict, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(ev))
        return
    out.print(
        f"step {ev['step']}: val loss {ev['loss']:.4f}, perplexity {ev['ppl']:.2f}, bits/byte {fmt_bpb(ev['bpb'], 4)} "
        f"over {ev['tokens']:,} tokens"
        + (f" ({ev['loss_tokens']:,} carry loss)" if ev.get("loss_tokens") is not None else "")
        + f" ({ev['tokens_per_s']:,.0f} tokens/s)"
        + (", documents reset at each end-of-document token" if ev.get("reset_at_eod") else "")
        + (f", {ev['documents']:,} documents each read from its start" if ev.get("documents") is not None else "")
        + (", from the tuned state" if ev.get("tuned_state") else "")
    )
    if "sample" in ev:
        out.print(ev["sample"], markup=False)


def render_tasks(scores, as_json: bool, output: Path | None) -> None:
    """`rwkvx eval --tasks`: a row per task and metric (or the summary as JSON)."""
    if as_json:
        out.print_json(json.dumps(scores.summary))
    else:
        out.print(f"step {scores.step} ({scores.checkpoint}), {scores.seconds:.1f} s:", markup=False)
        for task, metric, value, stderr in scores.rows:
            pm = f" ± {stderr:.2g}" if stderr is not None else ""
            out.print(f"  {task:<28} {metric:<16} {value:.4g}{pm}", markup=False)
    if output is not None:
        err.print(f"wrote {output}", markup=False)


def render_long_context(result: dict, as_json: bool) -> None:
    """`rwkvx eval --by-position` / `--passkey`: a table (or the figures as JSON), and the picture."""
    from rwkvx_cli.evaluation import plots

    by_position = result["kind"] == "by_position"
    if as_json:
        out.print_json(json.dumps(result))
    else:
        print_wide(_by_position_table(result) if by_position else _passkey_table(result))
    (plots.plot_by_position if by_position else plots.plot_passkey)(result, Path(result["plot"]))
    err.print(f"wrote {result['plot']}", markup=False)


def _by_position_table(r: dict) -> Table:
    from rwkvx_cli.evaluation.plots import run_label

    table = Table(
        title=f"validation loss by position · {r['streams']} stream(s) of {r['max_len']:,} tokens, state carried",
        title_justify="left",
    )
    table.add_column("positions", no_wrap=True)
    table.add_column("tokens", justify="right")
    for run in r["runs"]:
        table.add_column(run_label(run), justify="right")
    for i, b in enumerate(r["runs"][0]["buckets"]):
        span = f"{b['lo']:,}" if b["hi"] == b["lo"] + 1 else f"{b['lo']:,}-{b['hi'] - 1:,}"
        table.add_row(span, f"{b['tokens']:,}", *(f"{run['buckets'][i]['loss']:.4f}" for run in r["runs"]))
    table.add_row("all", f"{r['tokens']:,}", *(f"{run['loss']:.4f}" for run in r["runs"]), style="bold")
    return table


def _passkey_table(r: dict) -> Table:
    table = Table(
        title=f"passkey accuracy · step {r['step']} (trained at ctx {r['ctx_len']:,}) · {r['trials']} trials per cell",
        title_justify="left",
    )
    table.add_column("depth / length", no_wrap=True)
    for n in r["lengths"]:
        table.add_column(f"{n:,}", justify="right")
    cells = {(c["length"], c["depth"]): c for c in r["cells"]}
    for d in r["depths"]:
        table.add_row(f"{d:g}", *(f"{cells[n, d]['correct']}/{r['trials']}" for n in r["lengths"]))
    per_length = [sum(cells[n, d]["correct"] for d in r["depths"]) for n in r["lengths"]]
    table.add_row("all depths", *(f"{k}/{r['trials'] * len(r['depths'])}" for k in per_length), style="bold")
    return table
