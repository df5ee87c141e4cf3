"""Compare finished training runs: validation bits per byte against tokens, grouped by a config setting.

    python -m rwkvx_cli.tools.compare_runs RUN... --by model.ffn_key_gain [--panel model.n_embd] [--png PATH] [--force]

Each RUN is a run directory (its config.yaml and metrics.jsonl). Runs are grouped by the value of `--by`
(each group a colour; its runs, e.g. seeds, one line each) and split into one panel per value of `--panel`.
The table gives, per panel and group, each run's final validation bits per byte and the mean and sample
standard deviation over the group's runs, and the mean of the last 50 steps' training loss; it is what
docs/model.md#the-channel-mix-key-gain reports. Reads only what `rwkvx train` writes; an existing
--png is replaced only with --force.
"""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import yaml

from rwkvx_cli.entry import ArgumentParser, input_text, run_main
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import check_output, write_output

LAST_STEPS = 50


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def setting(config: dict, key: str):
    """The value of a dotted key (`model.ffn_key_gain`) in a run's saved config."""
    value = config
    for part in key.split("."):
        value = value[part]
    return value


def read_run(run: Path) -> dict:
    """A run's config, its validation curve [(tokens, val_bpb)] and its last steps' mean training loss."""
    try:
        config = yaml.safe_load(input_text(run / "config.yaml", "config"))
    except yaml.YAMLError as e:
        raise UsageError(f"{run / 'config.yaml'} is not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{run / 'config.yaml'} is not a run's config (a mapping of sections)")
    metrics = run / "metrics.jsonl"
    try:
        rows = [json.loads(line) for line in input_text(metrics, "metrics").splitlines() if line.strip()]
        val = [(r["tokens"], r["val_bpb"]) for r in rows if r.get("val_bpb") is not None]
        losses = [r["loss"] for r in rows if r.get("loss") is not None]
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise UsageError(f"{metrics} is not what `rwkvx train` writes ({type(e).__name__}: {e})") from None
    if not val:
        raise ValueError(f"{run}: metrics.jsonl holds no validation result")
    return {
        "run": str(run),
        "config": config,
        "val": val,
        "final_val_bpb": val[-1][1],
        "last_loss": statistics.fmean(losses[-LAST_STEPS:]),
    }


def compare(runs: list[Path], by: str, panel: str | None) -> dict:
    """{panel value: {group value: [run, ...]}} of the runs read."""
    out: dict = {}
    for path in runs:
        r = read_run(path)
        p = setting(r["config"], panel) if panel else ""
        out.setdefault(p, {}).setdefault(setting(r["config"], by), []).append(r)
    return out


def summary(groups: dict, by: str, panel: str | None) -> list[str]:
    """The table as Markdown rows."""
    cols = [panel or "runs", by, "runs", "final val bits/byte (each)", "mean ± sd", f"last-{LAST_STEPS} train loss"]
    lines = ["| " + " | ".join(cols) + " |", "|---|---|---|---|---|---|"]
    for p, by_value in sorted(groups.items()):
        for value, rs in sorted(by_value.items()):
            finals = [r["final_val_bpb"] for r in rs]
            sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
            each = ", ".join(f"{x:.4f}" for x in finals)
            loss = statistics.fmean(r["last_loss"] for r in rs)
            mean = statistics.fmean(finals)
            lines.append(f"| {p} | {value} | {len(rs)} | {each} | {mean:.4f} ± {sd:.4f} | {loss:.4f} |")
    return lines


def plot(groups: dict, by: str, panel: str | None, path: Path, title: str, force: bool = False) -> Path:
    """The picture, written to `path` (an existing file only with `force`)."""
    plt = _pyplot()
    panels = sorted(groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, p in zip(axes[0], panels, strict=True):
        for i, (value, rs) in enumerate(sorted(groups[p].items())):
            for j, r in enumerate(rs):
                tokens, bpb = zip(*r["val"], strict=True)
                label = f"{by.split('.')[-1]} = {value}" if j == 0 else None
                colour = colours[i % len(colours)]
                ax.plot([t / 1e6 for t in tokens], bpb, color=colour, lw=1.2, alpha=0.8, label=label)
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("validation bits per byte")
        ax.set_title(f"{panel.split('.')[-1]} = {p}" if panel else title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        low = min(r["final_val_bpb"] for rs in groups[p].values() for r in rs)
        ax.set_ylim(low - 0.1, low + 1.2)  # the late curves, where the groups part
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=100, format="png")
        return write_output(Path(path), buffer.getvalue(), force=force, flag="--png")
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m rwkvx_cli.tools.compare_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories")
    ap.add_argument("--by", required=True, help="the config key whose values make the groups")
    ap.add_argument("--panel", help="a config key whose values make one panel each")
    ap.add_argument("--png", type=Path, help="write the picture here")
    ap.add_argument("--title", default="validation bits per byte by tokens")
    ap.add_argument("--force", action="store_true", help="replace --png if it exists")
    args = ap.parse_args(argv)
    if args.png:
        check_output(args.png, args.force, "--png")
    for run in args.runs:
        if not ((run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()):
            ap.error(f"{run} is not a run directory (no config.yaml and metrics.jsonl)")
    try:
        groups = compare(args.runs, args.by, args.panel)
    except (KeyError, TypeError, ValueError) as e:
        ap.error(f"{e}" if isinstance(e, ValueError) else f"no setting {args.by!r} or {args.panel!r} in a config: {e}")
    print("\n".join(summary(groups, args.by, args.panel)))
    if args.png:
        print(f"wrote {plot(groups, args.by, args.panel, args.png, args.title, args.force)}")
    return 0


if __name__ == "__main__":
    run_main(main)
