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


PASSKEY_CMAP = "viridis"  # perceptually uniform: dark violet (0%) to yellow (100%), each end readable
CHANCE_COLOUR = "red"  # chance level's mark on the colour bar: in no cell of viridis


def luminance(rgb) -> float:
    """The relative luminance of an sRGB colour (components 0..1), as WCAG defines it."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a, b) -> float:
    """WCAG contrast ratio of two colours: 1 (the same) .. 21 (black on white)."""
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_colour(background) -> str:
    """Black or white, whichever reads better on `background`."""
    return "black" if contrast(background, (0, 0, 0)) >= contrast(background, (1, 1, 1)) else "white"


def chance_label(chance: float) -> str:
    """'chance 0.0011% (1 in 90,000)': what a guess scores."""
    return f"chance {100 * chance:.2g}% (1 in {round(1 / chance):,})"


def passkey_figure(result: dict):
    """The passkey heatmap: accuracy by prompt length (x) and needle depth (y), each cell annotated
    with its share and count in black or white (whichever contrasts with the cell), chance level (a
    guess of the key: result["chance"]) marked on the colour bar and named beneath it."""
    plt = _pyplot()
    lengths, depths, trials = result["lengths"], result["depths"], result["trials"]
    acc = [[0.0] * len(lengths) for _ in depths]
    correct = [[0] * len(lengths) for _ in depths]
    for cell in result["cells"]:
        i, j = depths.index(cell["depth"]), lengths.index(cell["length"])
        acc[i][j], correct[i][j] = cell["accuracy"], cell["correct"]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.2 * len(lengths) + 3.2), 0.6 * len(depths) + 2.0))  # room: title
    cmap = plt.get_cmap(PASSKEY_CMAP)
    image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap=cmap, aspect="auto")
    for i, row in enumerate(acc):
        for j, value in enumerate(row):
            colour = text_colour(cmap(value))
            ax.text(j, i, f"{value:.0%}\n{correct[i][j]}/{trials}", ha="center", va="center", fontsize=8, color=colour)
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth (0: start, 1: end)")
    step, ctx = result.get("step", "?"), result.get("ctx_len")
    trained = f" (trained at ctx {ctx:,})" if ctx else ""
    per_cell = f"{trials} trial{'s' if trials != 1 else ''} per cell"
    ax.set_title(f"passkey accuracy · step {step}{trained} · {per_cell}", fontsize=10)
    bar = fig.colorbar(image, ax=ax, format=lambda x, _: f"{x:.0%}")
    chance = result["chance"]
    bar.ax.axhline(chance, color=CHANCE_COLOUR, lw=2)  # across the bar, and a pointer beside it
    beside = bar.ax.get_yaxis_transform()  # x in the bar's width, y in accuracy
    bar.ax.plot([-0.35], [chance], ">", color=CHANCE_COLOUR, ms=7, clip_on=False, transform=beside)
    bar.set_label(f"accuracy · red: {chance_label(chance)}", fontsize=8)
    fig.tight_layout()
    return fig


def plot_passkey(result: dict, path: Path) -> Path:
    """passkey_figure, written as a PNG at `path`."""
    plt = _pyplot()
    fig = passkey_figure(result)
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
