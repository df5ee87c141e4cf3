"""The loss curve of a run, as a PNG next to its metrics.jsonl."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rwkvx_cli.fsio import atomic_write_bytes


def plot_losses(metrics_path: Path, out_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines()]
    val = [r for r in rows if r.get("val_loss") is not None]
    rows = [r for r in rows if r.get("loss") is not None]  # skipped non-finite steps log null
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], label="train loss", lw=0.8)
    ax.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(out_path, buffer.getvalue())  # never through a link at out_path
    return out_path
