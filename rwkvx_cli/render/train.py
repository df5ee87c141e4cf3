"""`rwkvx init` and `rwkvx train`: the model's summary, the live view (or plain lines) of a run, and its
outcome."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from rwkvx_cli.render.console import err, fmt_bpb, fmt_count, fmt_seconds, out, print_wide, warning
from rwkvx_cli.render.data import print_prepared


def print_summary(summary: dict, run_dir: Path) -> None:
    table = Table(title=f"model · blocks {summary['blocks']}", title_justify="left")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    for name, n in summary["by_component"].items():
        table.add_row(name, fmt_count(n))
    table.add_row("[bold]total", f"[bold]{fmt_count(summary['parameters'])}")
    out.print(table)
    out.print(
        f"forward FLOPs/token {fmt_count(summary['forward_flops_per_token'])} · "
        f"train FLOPs/token {fmt_count(summary['train_flops_per_token'])} · "
        f"recurrent state {summary['state_bytes_per_sequence_fp32'] / 1024:.1f} KiB/sequence (fp32)"
    )
    if summary.get("initial"):
        print_initial(summary["initial"])
    out.print(f"run directory: {run_dir}")


def print_initial(report: dict) -> None:
    """What train.init_from gave the model: its sizes, and an upcycle's plan per block."""
    out.print(f"weights from {report['source']} ({report['layout']}): {report['sizes']}", markup=False)
    for note in report.get("notes", ()):
        out.print(f"  note: {note}", markup=False)
    if report["plan"] is None:
        return
    table = Table(title="upcycle: what each block starts from", title_justify="left")
    for head in ("target", "action", "source", "tensors"):
        table.add_column(head, justify="right" if head == "tensors" else "left")
    for target, action, source, n in report["plan"]:
        table.add_row(target, action, source, str(n))
    print_wide(table)


class TrainConsole:
    """Renders `rwkvx train`: the events of train/runner.py's run_training while it runs (on rank 0,
    a live view of the steps on a terminal; else a plain line every train.log_interval steps and the
    last), then its result. A context manager: the live view ends on exit."""

    def __init__(self, cfg, dist):
        self.cfg, self.dist = cfg, dist
        self.view = TrainView(cfg.total_steps)
        self.live = None

    def __enter__(self) -> TrainConsole:
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def on_event(self, kind: str, payload) -> None:
        if kind == "prepared":
            print_prepared(payload)
        elif kind == "resumed":
            line = f"resumed from step {payload}" if payload else "no checkpoint to resume from: starting at step 0"
            if self.dist.is_main:
                err.print(line)
        elif kind == "initial":
            print_initial(payload)
        elif kind == "branched":
            b = payload
            out.print(
                f"decaying from {b['from']} (step {b['step']}, {fmt_count(b['tokens'])} tokens) over "
                f"{fmt_count(b['decay_tokens'])} tokens ({b['shape']})",
                markup=False,
            )
        elif kind == "changed":
            changed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in payload.items())
            warning(f"continuing with changed settings (--allow-change): {changed}; not an exact resume")
        elif kind == "init_only":
            given = ", ".join(f"{k} {new!r} (kept: {old!r})" for k, (old, new) in payload.items())
            warning(
                f"{given}: settings of a run's start, which a resumed run does not use; config.yaml and the "
                "checkpoints keep what the run was initialised with"
            )
        elif kind == "start":
            self._start(payload)
        elif kind == "profile":
            out.print(f"profile trace written: {payload}", markup=False, soft_wrap=True)
        elif kind == "skipped":
            m = payload
            err.print(
                f"[yellow]warning:[/] step {m.step}: non-finite loss or gradient (loss {m.loss}, "
                f"gradient norm {m.grad_norm}); step skipped ({m.skipped_steps} so far)"
            )
        else:  # "step", "checkpoint"
            self.view.update(kind, payload)
            if self.live is not None:
                self.live.update(self.view.render())
            elif kind == "step" and self.dist.is_main and not out.is_terminal:
                m, total = payload, self.view.total
                if m.step % self.cfg.train.log_interval == 0 or m.step == total:
                    out.print(progress_line(m, total), markup=False, soft_wrap=True)  # one line per entry

    def _start(self, start) -> None:
        cfg, dist, summary = self.cfg, self.dist, start.summary
        self.view.total = start.last_step
        ranks = f" x {dist.world_size} ranks ({cfg.train.distributed})" if dist.launched else ""
        what = f"{fmt_count(summary['parameters'])} parameters"
        if "trainable" in summary:  # state tuning
            what = f"the initial state ({fmt_count(summary['trainable'])} parameters) of {what}, frozen,"
        out.print(
            f"training {what} ({summary['blocks']}) on {start.device}{ranks}: "
            f"{start.last_step} steps x {cfg.tokens_per_step} tokens, run dir {Path(cfg.run_dir)}"
        )
        if dist.is_main and out.is_terminal:  # piped: rich would show only the last frame
            from rich.live import Live

            self.live = Live(self.view.render(), console=out, refresh_per_second=4, transient=False)
            self.live.start(refresh=True)

    def finish(self, result) -> None:
        """The outcome lines, after the live view has ended."""
        if result.last is None:
            out.print("nothing to do: the run is already complete")
            return
        if result.stopped:
            out.print(f"interrupted: checkpoint saved at step {result.step}; continue with --resume")
            return
        ev = result.val
        skipped = f", {result.skipped_steps} non-finite steps skipped" if result.skipped_steps else ""
        out.print(
            f"[bold]done[/]: step {result.step}, val loss {ev['loss']:.4f}, val bits/byte {fmt_bpb(ev['bpb'], 4)}, "
            f"{result.last.tokens_per_s:,.0f} tokens/s{skipped}"
        )
        out.print("[dim]sample:[/]")
        out.print(result.sample, markup=False)


class TrainView:
    def __init__(self, total_steps: int):
        self.total, self.m, self.ema, self.val, self.ckpt = total_steps, None, None, None, None

    def update(self, kind, m) -> None:
        if kind == "checkpoint":  # the step of a checkpoint now on disk
            self.ckpt = m
            return
        self.m = m
        self.ema = m.loss if self.ema is None else 0.95 * self.ema + 0.05 * m.loss
        if m.val_loss is not None:
            self.val = (m.val_loss, m.val_bpb)

    def render(self):
        from rich.progress_bar import ProgressBar

        table = Table.grid(padding=(0, 2))
        if self.m is None:
            table.add_row("starting...")
            return table
        m = self.m
        rate = m.tokens_per_s
        eta = eta_seconds(m, self.total)
        val = f"{self.val[0]:.4f} ({fmt_bpb(self.val[1], 3, '–')} bpb)" if self.val else "–"
        bar = ProgressBar(total=self.total, completed=m.step, width=40)
        table.add_row(bar, f"step {m.step}/{self.total}", "epoch", f"{m.epoch}")
        table.add_row("loss (ema)", f"{self.ema:.4f}", "val loss", val)
        table.add_row("lr", f"{m.lr:.2e}", "grad norm", f"{m.grad_norm:.3f}")
        table.add_row("tokens/s", f"{rate:,.0f}", "ETA", f"{eta:,.0f}s")
        table.add_row("MFU", fmt_mfu(m), "", "")
        table.add_row("peak mem", f"{m.peak_mem_mb:,.0f} MiB", "checkpoint", f"step {self.ckpt}" if self.ckpt else "–")
        return table


def progress_line(m, total_steps: int) -> str:
    """One plain line of training progress (no terminal: log files, pipes, batch jobs)."""
    val = f" · val loss {m.val_loss:.4f} ({fmt_bpb(m.val_bpb, 3, '–')} bpb)" if m.val_loss is not None else ""
    return (
        f"step {m.step}/{total_steps} · loss {m.loss:.4f}{val} · lr {m.lr:.2e} · grad norm {m.grad_norm:.3f} · "
        f"{m.tokens_per_s:,.0f} tokens/s · MFU {fmt_mfu(m)} · ETA {fmt_seconds(eta_seconds(m, total_steps))} · "
        f"peak mem {m.peak_mem_mb:,.0f} MiB · epoch {m.epoch}"
    )


def eta_seconds(m, total_steps: int) -> float:
    """Seconds left at this session's rate: the tokens still to train over tokens/s."""
    if not m.tokens:
        return 0.0
    return (total_steps * m.tokens / m.step - m.tokens) / max(m.tokens_per_s, 1e-9)


def fmt_mfu(m) -> str:
    mfu = getattr(m, "mfu_pct", None)
    return "–" if mfu is None or mfu != mfu else f"{mfu:.1f}%"
