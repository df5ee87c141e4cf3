"""Rendering for the command line (rich): tables, live views, progress bars, and errors as one
line on stderr with an exit code.

Kept apart from cli.py so that the commands read as parse -> call -> render.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from typer.core import TyperGroup

try:  # typer 0.25+ carries its own click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import ClickException

from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.train import signals
from rwkvx_cli.train.signals import Terminated

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def one_line_error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def warning(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for the command line: a warning is one line, without its source line."""
    warning(str(message))


def warn_skipped(path: Path, reason: str) -> None:
    """A damaged checkpoint passed over for an older one."""
    warning(f"skipping damaged checkpoint {path.name}: {reason}")


class OneLineErrors(TyperGroup):
    """Typer's own usage errors (a missing option, a value not among the choices) as one line,
    like every other error of the tool, instead of a framed panel."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `rwkvx` or `rwkvx data` alone: the help
                err.print(e.format_message(), markup=False)
                sys.exit(e.exit_code)
            where = f" (see `{e.ctx.command_path} --help`)" if getattr(e, "ctx", None) is not None else ""
            one_line_error(f"{e.format_message().replace('Value error, ', '')}{where}")  # pydantic's prefix
            sys.exit(e.exit_code)
        except typer.Abort:
            err.print("[bold red]aborted[/]")
            sys.exit(1)
        if code == 130:  # a KeyboardInterrupt: in a command (reports_errors), or while typer parsed
            sys.exit(interrupted())
        sys.exit(code if isinstance(code, int) else 0)


def interrupted() -> int:
    """Say that a KeyboardInterrupt ended the program ("terminated" when SIGTERM raised it) and return
    the exit code, 130 or 143; stop signals are ignored from here on, so that none interrupts the exit."""
    signals.ignore_stop_signals()
    terminated = signals.was_terminated()  # SIGTERM unwinds as one too
    err.print("[bold red]terminated[/]" if terminated else "[bold red]interrupted[/]")
    return 143 if terminated else 130


def report_error(e: BaseException) -> int | None:
    """The one way an error leaves the program (the CLI's commands, and the `python -m` tools through
    entry.run_main): said in one line on stderr, and the exit code returned; None for an exception that
    is not a user's to read in one line (a bug: its traceback is wanted). A KeyboardInterrupt returns 130
    unsaid: the caller says it (`interrupted`), as for one met while parsing."""
    if isinstance(e, RwkvxError):
        one_line_error(str(e))
        return e.exit_code
    if isinstance(e, Terminated):  # SIGTERM outside training's graceful stop (start-up)
        signals.ignore_stop_signals()  # a second one must not interrupt the exit
        err.print("[bold red]terminated[/]")
        return 143
    if isinstance(e, KeyboardInterrupt):  # outside training's own handler (data preparation, eval, bench)
        return 130
    if isinstance(e, MemoryError):
        one_line_error("out of memory; make the model, batch or shape smaller")
        return 1
    if isinstance(e, OSError):  # a full disk, a file-size limit, a read-only or vanished path
        where = f"{e.filename}: " if e.filename else ""
        one_line_error(f"{where}{e.strerror or e}")
        return 1
    return None


def reports_errors(fn):
    """Render the project's errors as one line on stderr and exit with their code (report_error)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RwkvxError, KeyboardInterrupt, MemoryError, OSError) as e:
            raise typer.Exit(report_error(e)) from None

    return wrapper


def print_wide(renderable) -> None:
    """Print at the renderable's natural width, even past the terminal's: a table of
    numbers with truncated cells is unreadable, a wrapped line is not."""
    natural = Measurement.get(out, out.options.update_width(10_000), renderable).maximum
    if natural <= out.width:
        out.print(renderable)
        return
    Console(
        width=natural, file=out.file, highlight=False, color_system=out.color_system, force_terminal=out.is_terminal
    ).print(renderable)


def gradcheck_cell(col) -> str:
    from rwkvx_cli.tools.gradcheck import THRESHOLD

    if col is None:
        return "[dim]–[/]"
    if col.vacuous:
        return f"[bold red]vacuous {col.ref_max:.0e}[/]"
    colour = "green" if col.max_rel < THRESHOLD else "bold red"
    return f"[{colour}]{col.max_rel:.1e}[/]"


def render_gradcheck(report) -> None:
    from rwkvx_cli.tools.gradcheck import THRESHOLD, VACUOUS_BELOW

    for backend in dict.fromkeys(r.backend for r in report.results):
        rows = [r for r in report.results if r.backend == backend]
        names = list(dict.fromkeys(c.name for r in rows for c in r.columns))
        table = Table(title=f"gradcheck {report.op} · backend {backend} · seed {report.seed}", title_justify="left")
        for head in ("gate", "case", "B×T×H×N"):
            table.add_column(head, no_wrap=True)
        for name in names:
            table.add_column(name, justify="right", no_wrap=True)
        table.add_column("worst rms", justify="right", no_wrap=True)
        table.add_column("", no_wrap=True)
        for r in rows:
            by_name = {c.name: c for c in r.columns}
            rms = max(c.rms_ratio for c in r.columns)
            table.add_row(
                f"{r.gate} {r.dtype.replace('float', 'fp')}",
                r.case,
                "×".join(str(v) for v in r.dims.values()),
                *(gradcheck_cell(by_name.get(n)) for n in names),
                f"{rms:.1e}",
                "[green]ok[/]" if r.passed else "[bold red]FAIL[/]",
            )
        print_wide(table)
    out.print(
        f"[dim]cells: max |g - ref| / (|ref| + 1e-6), pass < {THRESHOLD:g}; gate A vs the fp64 oracle, "
        f"gate B vs central finite differences; a gradient whose reference max |g| <= {VACUOUS_BELOW:g} "
        "is vacuous and fails[/]"
    )


def _verdict(passed: bool) -> str:
    return "[bold green]PASS[/]" if passed else "[bold red]FAIL[/]"


def warn_skipped_backend(backend: str, reason: str) -> None:
    warning(f"skipping the {backend!r} backend: {reason}")


def gradcheck_run(plan, seed: int, size: int, all_ops: bool) -> dict:
    """Run `rwkvx gradcheck`'s plan (tools/gradcheck.plan_gradcheck) with a status line, rendering each
    op's report as it ends, then (`all_ops`) the overall verdict. Returns the JSON summary."""
    import time

    from rwkvx_cli.tools.gradcheck import run_gradcheck

    results = []
    for spec, backends in plan:
        start = time.perf_counter()
        with status_line("gradcheck") as on_case:
            report = run_gradcheck(spec, backends, seed=seed, size=size, on_case=on_case)
        seconds = time.perf_counter() - start
        render_gradcheck(report)
        names = ", ".join(b.name for b in backends)
        out.print(f"{_verdict(report.passed)} {report.op}: {len(report.results)} cases, {names} in {seconds:.1f}s")
        results.append({**report.to_dict(), "seconds": seconds})
    passed = all(r["passed"] for r in results)
    seconds = sum(r["seconds"] for r in results)
    if all_ops:
        failed = [r["op"] for r in results if not r["passed"]]
        out.print(
            f"{_verdict(passed)} all: {len(results) - len(failed)} of {len(results)} ops passed in {seconds:.1f}s"
            + (f" (failed: {', '.join(failed)})" if failed else "")
        )
    return {"ops": results, "passed": passed, "seconds": seconds}


@contextlib.contextmanager
def status_line(what: str, interval: float = 30.0):
    """What long work of no known size is at (the case being checked, the row being timed), on stderr:
    on a terminal a status line; piped, as `progress` (whose plain lines it shares), a line every
    `interval` seconds. Yields its callback (the label)."""
    if err.is_terminal:
        with err.status(what) as status:
            yield status.update
        return
    with progress(interval) as report:
        yield lambda label: report(what, 0, 0, info=label)


def bench_status(interval: float = 30.0):
    """`rwkvx bench`'s status_line; yields its callback (the row being timed)."""
    return status_line("bench", interval)


def render_eval(ev: dict, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(ev))
        return
    out.print(
        f"step {ev['step']}: val loss {ev['loss']:.4f}, perplexity {ev['ppl']:.2f}, bits/byte {fmt_bpb(ev['bpb'], 4)} "
        f"over {ev['tokens']:,} tokens ({ev['tokens_per_s']:,.0f} tokens/s)"
        + (", documents reset at each end-of-document token" if ev.get("reset_at_eod") else "")
    )
    if "sample" in ev:
        out.print(ev["sample"], markup=False)


def render_evaluation(mode: str, result, as_json: bool, output: Path | None) -> None:
    """What `rwkvx eval` computed (evaluation/command.py), by mode."""
    if mode == "plain":
        render_eval(result, as_json)
    elif mode == "tasks":
        render_tasks(result, as_json, output)
    else:
        render_long_context(result, as_json)


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


def render_export(info: dict) -> None:
    for line in info["warnings"]:
        warning(f"exported anyway (--force): {line}")
    out.print(f"wrote {info['out']} ({info['format']}, {info['tensors']} tensors, step {info['step']})", markup=False)
    if info.get("left_out"):
        out.print(f"not in the format (unused by it): {', '.join(info['left_out'])}", markup=False)
    if info.get("tokenizer"):
        out.print(f"tokenizer: {info['tokenizer']}", markup=False)
    if info.get("rwkv_x_args"):
        out.print("RWKV-X: " + " ".join(f"--{k} {v}" for k, v in info["rwkv_x_args"].items()), markup=False)


def render_prepared(stats) -> None:
    out.print(prepared_line(stats), soft_wrap=True)
    prepare_warnings(stats)
    if stats.skipped_records:
        warning(f"skipped {stats.skipped_records:,} bad records (first: {stats.first_skipped})")


def render_merged(stats) -> None:
    out.print(
        f"merged {stats.directories} prepared directories into {stats.out_dir}: train {stats.train_tokens:,} tokens "
        f"({stats.train_documents:,} documents), val {stats.val_tokens:,} tokens ({stats.val_documents:,} documents)",
        markup=False, soft_wrap=True, highlight=False,
    )


@contextlib.contextmanager
def data_progress():
    """A progress bar (stderr, erased when done) around data preparation; yields its callback (done, total)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
    )
    task = progress.add_task("tokenizing", total=None)
    with progress:
        yield lambda done, total: progress.update(task, completed=done, total=total)


@contextlib.contextmanager
def progress(interval: float = 30.0):
    """Progress of long work (`data prepare`, `eval`), on stderr so that stdout (a table, --json) stays
    clean, as `train` shows its own: on a terminal a live bar (erased when done); otherwise (a pipe, nohup,
    SLURM) a plain line every `interval` seconds and one when a phase ends. Yields the callback
    report(what, done, total, unit="tokens", info=None): `what` names the phase ("tokenizing", "passkey"),
    `info` the text beside it (default: done/total unit, the rate and the ETA since the phase began)."""
    import time

    phases: dict[str, float] = {}  # when each phase was first reported

    def text(what: str, done: int, total: int, unit: str, info: str | None) -> str:
        if info is not None:
            return info
        seconds = time.monotonic() - phases[what]
        rate = done / seconds if seconds > 0 else 0.0
        share = f" ({100 * done / total:.0f}%)" if total else ""
        eta = f" · ETA {fmt_seconds((total - done) / rate)}" if rate > 0 and done < total else ""
        return f"{done:,}/{total:,} {unit}{share} · {rate:,.0f} {unit}/s{eta}"

    if err.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn

        bar = Progress(
            "[progress.description]{task.description}", BarColumn(), TextColumn("{task.fields[info]}"),
            console=err, transient=True,
        )
        task = bar.add_task("", total=None, info="")

        def live(what: str, done: int, total: int, unit: str = "tokens", info: str | None = None) -> None:
            phases.setdefault(what, time.monotonic())
            line = text(what, done, total, unit, info)
            bar.update(task, description=what, completed=done, total=total or None, info=line)

        with bar:
            yield live
        return
    last = [time.monotonic()]

    def plain(what: str, done: int, total: int, unit: str = "tokens", info: str | None = None) -> None:
        now = time.monotonic()
        phases.setdefault(what, now)
        if (total and done >= total) or now - last[0] >= interval:
            last[0] = now
            err.print(f"{what} {text(what, done, total, unit, info)}", markup=False, soft_wrap=True, highlight=False)

    yield plain


@contextlib.contextmanager
def prepare_progress(interval: float = 30.0):
    """`data prepare`'s progress (see `progress`): MB/s, documents, tokens and the ETA from the input sizes.
    Yields the callback for PrepareProgress reports."""
    with progress(interval) as report:
        yield lambda p: report("tokenizing", p.bytes_done, p.bytes_total, "bytes", prepare_status(p))


def prepare_status(p) -> str:
    """'12.3/45.6 MB (27%) · 1,234 docs · 5.60M tokens · 10.2 MB/s · ETA 3m05s' of a PrepareProgress."""
    share = f" ({100 * p.bytes_done / p.bytes_total:.0f}%)" if p.bytes_total else ""
    eta = p.eta_seconds
    tail = f" · ETA {fmt_seconds(eta)}" if eta is not None and p.bytes_done < p.bytes_total else ""
    return (
        f"{p.bytes_done / 1e6:,.1f}/{p.bytes_total / 1e6:,.1f} MB{share} · {p.documents:,} docs · "
        f"{fmt_count(p.tokens)} tokens · {p.mb_per_s:.1f} MB/s{tail}"
    )


def prepare_warnings(stats) -> None:
    """What a prepare's summary line leaves out: that it resumed, and long documents cut with no safe point."""
    if stats.resumed_bytes:
        err.print(
            f"resumed: {stats.resumed_bytes / 1e6:,.1f} of {stats.bytes / 1e6:,.1f} MB were tokenized before",
            markup=False, soft_wrap=True,
        )
    if stats.forced_cuts:
        err.print(
            f"[yellow]warning:[/] {stats.forced_cuts:,} cuts in long runs without a point where the tokenizer may "
            f"be cut (its safe cuts: {stats.cut_rule}); near them the ids may differ from encoding the whole document",
            soft_wrap=True,
        )


def fmt_seconds(s: float) -> str:
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def fmt_count(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


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


def eta_seconds(m, total_steps: int) -> float:
    """Seconds left at this session's rate: the tokens still to train over tokens/s."""
    if not m.tokens:
        return 0.0
    return (total_steps * m.tokens / m.step - m.tokens) / max(m.tokens_per_s, 1e-9)


def fmt_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_mfu(m) -> str:
    mfu = getattr(m, "mfu_pct", None)
    return "–" if mfu is None or mfu != mfu else f"{mfu:.1f}%"


NO_BPB = "not defined (the tokens predicted decode to no bytes)"


def fmt_bpb(bpb: float | None, digits: int, missing: str = NO_BPB) -> str:
    """Bits per byte, or `missing` where the validation figures have none (evaluation/validation.py)."""
    return missing if bpb is None else f"{bpb:.{digits}f}"


def progress_line(m, total_steps: int) -> str:
    """One plain line of training progress (no terminal: log files, pipes, batch jobs)."""
    val = f" · val loss {m.val_loss:.4f} ({fmt_bpb(m.val_bpb, 3, '–')} bpb)" if m.val_loss is not None else ""
    return (
        f"step {m.step}/{total_steps} · loss {m.loss:.4f}{val} · lr {m.lr:.2e} · grad norm {m.grad_norm:.3f} · "
        f"{m.tokens_per_s:,.0f} tokens/s · MFU {fmt_mfu(m)} · ETA {fmt_duration(eta_seconds(m, total_steps))} · "
        f"peak mem {m.peak_mem_mb:,.0f} MiB · epoch {m.epoch}"
    )


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
            out.print(prepared_line(payload))
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
        out.print(
            f"training {fmt_count(summary['parameters'])} parameters ({summary['blocks']}) on {start.device}{ranks}: "
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


def render_bench(report, baseline: str) -> None:
    isa = ""  # which build of the fused CPU kernels ran: their speed depends on it
    if report.device == "cpu":
        isa = f" · {report.cpu_isa} kernels" if report.cpu_isa else " · no cpu kernels"
    table = Table(
        title=f"bench · {report.device}{isa} · {report.threads} threads · "
        f"matmul peak {report.matmul_gflops:,.0f} GFLOP/s",
        title_justify="left",
    )
    for head in ("op", "backend", "shape", "dtype", "mode"):
        table.add_column(head, no_wrap=True)
    for head in ("median ms", "± spread", "tokens/s", "GFLOP/s", "% peak", "matmul", "mem MiB", f"x {baseline}"):
        table.add_column(head, justify="right", no_wrap=True)
    for r in report.rows:
        shape = "×".join(str(r.dims[d]) for d in "BTHN")
        if r.dims.get("starts_every"):  # a document start every K tokens
            shape += f" ·doc {r.dims['starts_every']}"
        if r.error:
            table.add_row(r.op, r.backend, shape, r.dtype, r.mode, f"[dim]{r.error}[/]", *[""] * 7)
            continue
        table.add_row(
            r.op,
            r.backend,
            shape,
            r.dtype,
            r.mode,
            f"{r.median_ms:,.2f}",
            f"{r.spread_pct:.0f}%",
            f"{r.tokens_per_s:,.0f}",
            f"{r.gflops:,.1f}",
            f"{r.pct_of_peak:.1f}",
            f"{r.matmul_gflops:,.0f}" if r.matmul_gflops else "–",
            f"{r.memory_mb:,.1f}",
            f"{r.speedup:,.1f}" if r.speedup is not None else "–",
        )
    print_wide(table)
    out.print(
        "[dim]GFLOP/s counts each op's useful FLOPs (docs/operators.md); % peak divides it by `matmul`, the "
        "matmul rate measured just before and after the row (their mean; the title's: the run's first); mem = "
        "bytes saved for backward plus outputs (CPU) or peak allocated (CUDA)[/]"
    )


def render_model_bench(r: dict) -> None:
    sets = "".join(f" {o}" for o in r.get("overrides", ()))
    chunked = f" · chunk_len {r['chunk_len']}" if r.get("chunk_len") else ""
    title = (
        f"bench --model {r['config']}{sets} · {r['device']} · {r['precision']} · B={r['batch']} T={r['ctx_len']}"
        f" · head {r['head']}{' · grad_cp' if r['grad_cp'] else ''}{chunked}"
    )
    other = next((name for name in ("gpt", "unchunked", "unfused", "packed") if name in r), None)
    gpt = r.get(other) if other else None
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("this config" if gpt else "value", justify="right")
    if gpt:
        table.add_column({"gpt": "GPT"}.get(other, other), justify="right")

    def fmt(val) -> str:
        if val is None:
            return ""
        return f"{val:,.1f}" if isinstance(val, float) else f"{val:,}"

    for key, label in (
        ("tokens_per_s", "tokens/s"),
        ("step_ms", "ms / step"),
        ("parameters", "parameters"),
        ("recurrence_pct", "recurrence ops %"),
        ("matmul_pct", "matmuls %"),
        ("fused_pct", "fused block kernels %"),
        ("other_pct", "other %"),
        ("train_flops_per_token", "train FLOPs / token"),
        ("matmul_gflops", "matmul peak GFLOP/s"),
        ("mfu_pct", "MFU %"),
        ("peak_mb", "peak memory of a step MiB"),
        ("grads_mb", "  of which gradients MiB"),
        ("activation_mb", "  activations + transients MiB"),
        ("ops", "ops per block, fwd + bwd"),
    ):
        row = [label, fmt(_figure(r, key))]
        if gpt:
            row.append(fmt(_figure(gpt, key)))
        table.add_row(*row)
    out.print(table)
    kind = r["ops_per_block"]["kind"]
    out.print(f"[dim]ops per block: {kind} blocks, forward + backward, counted as docs/benchmarks.md#op-count says[/]")
    if "fused_speedup" in r:
        ratio = r["activation_mb"] / gpt["activation_mb"] if gpt["activation_mb"] else float("nan")
        out.print(
            f"[bold]fused / unfused: {r['fused_speedup']:.2f}x the tokens/s, {ratio:.2f}x the activation memory[/]"
            f" · {r['timing']}"
        )
    elif "reset_over_packed" in r:
        out.print(
            f"[bold]data.reset_at_eod / packed step time: {r['reset_over_packed']:.2f}x[/] · "
            f"a document every {r['document_len']} tokens · {r['timing']}"
        )
    elif "chunked_over_unchunked" in r:
        out.print(f"[bold]chunked / unchunked step time: {r['chunked_over_unchunked']:.2f}x[/] · {r['timing']}")
    elif gpt:
        out.print(
            f"[bold]this config / GPT tokens/s: {r['rwkv_over_gpt']:.2f}x[/] · GPT: {gpt['shape']} · {r['timing']}"
        )
        out.print(f"[dim]GPT train FLOPs / token = {gpt['flops_formula']}[/]")
    if r.get("optimizers"):
        shares = " · ".join(
            f"{kind} {o['step_ms']:,.1f} ms ({o['share_pct']:.2g}% of a {o['train_step_ms']:,.0f} ms step)"
            for kind, o in r["optimizers"].items()
        )
        accum = f", {r['grad_accum']} micro-batches a step" if r.get("grad_accum", 1) > 1 else ""
        out.print(f"optimizer step (this run: {r['optimizer']}{accum}): {shares}")
    out.print(f"[dim]{r['mfu_formula']}[/]")


def _figure(r: dict, key: str):
    return r.get("ops_per_block", {}).get("ops") if key == "ops" else r.get(key)


def prepared_line(stats) -> str:
    return (
        f"prepared {stats.documents:,} documents, {stats.bytes / 1e6:.2f} MB -> {stats.train_tokens:,} train + "
        f"{stats.val_tokens:,} val tokens ({stats.tokenizer_kind} tokenizer, vocab {stats.vocab_size:,}) "
        f"at {stats.mb_per_s:.1f} MB/s into {stats.out_dir}"
    )
