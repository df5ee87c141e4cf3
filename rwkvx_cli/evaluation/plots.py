"""Pictures of the long-context evaluations (evaluation/long_context.py): the loss by position, one
curve per checkpoint on a log-position axis, and passkey accuracy as a length x depth heatmap.
Each is written atomically (a temporary name, then renamed) and its path returned."""

from __future__ import annotations

import io
from pathlib import Path

from rwkvx_cli.fsio import atomic_write_bytes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """The figure as a PNG at exactly `path`, written atomically (a link there is replaced, not followed)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=100, format="png")
    atomic_write_bytes(Path(path), buffer.getvalue())
    return Path(path)


def run_label(run: dict) -> str:
    chunked = f", chunk {run['chunk_len']:,}" if run.get("chunk_len") else ""
    return f"{Path(run['checkpoint']).parent.parent.name} (ctx {run['ctx_len']:,}{chunked}, step {run['step']})"


def plot_by_position(result: dict, path: Path) -> Path:
    """Mean loss of each position bucket against the bucket's middle position, log x; a dotted
    line at each run's training ctx_len."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in result["runs"]:
        mids = [(b["lo"] * (b["hi"] - 1)) ** 0.5 for b in run["buckets"]]
        (line,) = ax.plot(mids, [b["loss"] for b in run["buckets"]], "o-", ms=3, label=run_label(run))
        ax.axvline(run["ctx_len"], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the stream (tokens of context)")
    ax.set_ylabel("validation loss (nats / token)")
    ax.set_title(f"loss by position: {result['streams']} stream(s) of {result['max_len']:,} tokens", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_passkey(result: dict, path: Path) -> Path:
    """Accuracy by prompt length (x) and needle depth (y), each cell annotated."""
    plt = _pyplot()
    lengths, depths = result["lengths"], result["depths"]
    acc = [[0.0] * len(lengths) for _ in depths]
    for cell in result["cells"]:
        acc[depths.index(cell["depth"])][lengths.index(cell["length"])] = cell["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8))
    image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(acc):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"passkey accuracy, {result['trials']} trials per cell, step {result.get('step', '?')}", fontsize=10)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
