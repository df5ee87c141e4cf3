"""The `python -m rwkvx_cli....` tools' way in and out, the command line's own (render.console.report_error):
an argument error is one line and exit 2; a RwkvxError, OSError, MemoryError or interrupt is one line
and its exit code, never a traceback. Inputs a tool reads are checked here (input_text) and its output
files go through fsio's guard (check_output, write_output: `--force`, links replaced, never followed).

At the package root so that both `tools` and `evaluation` may use it (tests/test_layering.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from rwkvx_cli.errors import UsageError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`error: ... (see `PROG --help`)`) and exit 2, as the
    CLI's; pass `prog` (the `python -m` line), as argparse would otherwise name the module's file."""

    def error(self, message: str) -> NoReturn:
        from rwkvx_cli.render.console import one_line_error

        one_line_error(f"{message} (see `{self.prog} --help`)")
        sys.exit(2)


def at_least(low: int | float, kind: type = int) -> Callable[[str], int | float]:
    """An argparse `type`: a number of `kind` (int or float) no smaller than `low`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not value >= low:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {text}")
        return value

    return parse


def above_zero(text: str) -> float:
    """An argparse `type`: a number greater than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be greater than 0, not {text}")
    return value


def input_text(path: Path | str, what: str = "input") -> str:
    """The UTF-8 text of a file a tool was given; a missing, empty, unreadable or non-UTF-8 file or a
    directory is a one-line UsageError naming it."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory; give a file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise UsageError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    if not data.strip():
        raise UsageError(f"{what} {path} is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path} is not UTF-8 text (invalid byte at offset {e.start})") from None


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> NoReturn:
    """Run a tool's `main(argv)` as its `python -m` entry point (`if __name__ == "__main__": run_main(main)`)
    and exit with its return value; an error ends it the way it ends a CLI command (render.console.report_error:
    one line, its exit code), an interrupt with `interrupted` (130) or `terminated` (143). SIGTERM unwinds
    like Ctrl-C, so that a tool's own clean-up runs."""
    from rwkvx_cli.render.console import interrupted, report_error
    from rwkvx_cli.train import signals

    signals.install_process_handlers()
    signals.restore_interrupt()  # the package's start-up handler (rwkvx_cli/__init__.py) hands over
    try:
        code = main(argv)
    except BaseException as e:  # noqa: BLE001 - sorted by report_error; anything else is re-raised
        code = report_error(e)
        if code is None:
            raise
        if code == 130:
            code = interrupted()
    finally:
        signals.ignore_stop_signals()  # the tool is over: a late SIGTERM must not interrupt the exit
    sys.exit(code or 0)
