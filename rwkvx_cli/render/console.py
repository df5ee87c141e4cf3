"""What every command's output is drawn with (rich): the stdout and stderr consoles, errors as one line
on stderr with an exit code, warnings, wide tables, progress of long work, and the number formats.

The commands' own output is in the module of each (render/train.py, data.py, eval.py, ...), so that
cli.py reads as parse -> call -> render.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
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


NO_BPB = "not defined (the tokens predicted decode to no bytes)"


def fmt_bpb(bpb: float | None, digits: int, missing: str = NO_BPB) -> str:
    """Bits per byte, or `missing` where the validation figures have none (evaluation/validation.py)."""
    return missing if bpb is None else f"{bpb:.{digits}f}"
