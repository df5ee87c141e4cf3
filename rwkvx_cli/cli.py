"""The `rwkvx` command line. Commands parse, call the library, and render."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from rwkvx_cli import __version__
from rwkvx_cli.errors import RwkvxError, UsageError

app = typer.Typer(
    name="rwkvx",
    help="Pretraining tool for RWKV-family recurrent language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def reports_errors(fn):
    """Render the project's errors as one line on stderr and exit with their code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RwkvxError as e:
            err.print(f"[bold red]error:[/] {e}", soft_wrap=True)
            raise typer.Exit(e.exit_code) from None

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


def _version(value: bool) -> None:
    if value:
        out.print(f"rwkvx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


def _cell(col) -> str:
    from rwkvx_cli.gradcheck import THRESHOLD

    if col is None:
        return "[dim]–[/]"
    if col.vacuous:
        return f"[bold red]vacuous {col.ref_max:.0e}[/]"
    colour = "green" if col.max_rel < THRESHOLD else "bold red"
    return f"[{colour}]{col.max_rel:.1e}[/]"


def _render_gradcheck(report) -> None:
    from rwkvx_cli.gradcheck import THRESHOLD, VACUOUS_BELOW

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
                *(_cell(by_name.get(n)) for n in names),
                f"{rms:.1e}",
                "[green]ok[/]" if r.passed else "[bold red]FAIL[/]",
            )
        print_wide(table)
    out.print(
        f"[dim]cells: max |g - ref| / (|ref| + 1e-6), pass < {THRESHOLD:g}; gate A vs the fp64 oracle, "
        f"gate B vs central finite differences; a gradient whose reference max |g| <= {VACUOUS_BELOW:g} "
        "is vacuous and fails[/]"
    )


@app.command()
@reports_errors
def gradcheck(
    op: Annotated[str, typer.Option("--op", help="Operator to check (see the op registry).")],
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", help="Backend to check; repeatable. Default: every production backend."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the sampled inputs and cotangents.")] = 0,
    size: Annotated[int, typer.Option(min=1, help="Multiply the sequence length of gate A's cases.")] = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the numbers as JSON here.")] = None,
) -> None:
    """Check an op's backends against the fp64 oracle (gate A) and finite differences (gate B)."""
    import torch

    from rwkvx_cli.gradcheck import run_gradcheck
    from rwkvx_cli.ops import get_op, resolve_backend

    try:
        spec = get_op(op)
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    try:
        backends = (
            [resolve_backend(spec, name, torch.device("cpu")) for name in backend]
            if backend
            else [bk for bk in spec.production_backends() if bk.unavailable() is None]
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    start = time.perf_counter()
    with err.status("gradcheck") as status:
        report = run_gradcheck(spec, backends, seed=seed, size=size, on_case=status.update)
    seconds = time.perf_counter() - start
    _render_gradcheck(report)
    verdict = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
    out.print(
        f"{verdict} {report.op}: {len(report.results)} cases, {', '.join(b.name for b in backends)} in {seconds:.1f}s"
    )
    if json_path is not None:
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps({**report.to_dict(), "seconds": seconds}, indent=2) + "\n")
        except OSError as e:
            raise RwkvxError(f"cannot write {json_path}: {e.strerror}") from None
    if not report.passed:
        raise typer.Exit(1)


def main() -> None:
    app()
