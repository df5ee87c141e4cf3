"""Signals. During training, a graceful stop: SIGINT or SIGTERM ends the run after its current
step, with a checkpoint and exit status 0, instead of killing it mid-step. Outside it, SIGTERM
unwinds like Ctrl-C (`Terminated`), so that a command cleans up and says so; and a write past a
file-size limit fails with an error instead of killing the process (SIGXFSZ ignored)."""

from __future__ import annotations

import contextlib
import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that a command unwinds and says so (exit 143)."""


_terminated = False  # a SIGTERM was raised as Terminated in this process


def _raise_terminated(signum, frame) -> None:
    global _terminated
    _terminated = True
    raise Terminated


def was_terminated() -> bool:
    """Whether SIGTERM unwound this process (typer turns any KeyboardInterrupt it meets while
    parsing into exit 130; the command line reports such a one as terminated, 143)."""
    return _terminated


def restore_interrupt() -> None:
    """Ctrl-C raises KeyboardInterrupt again (the commands render it), after the package's start-up
    handler (rwkvx_cli/__init__.py), which exits 130 in one line while the command line is imported."""
    from rwkvx_cli import _interrupted_while_starting

    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def install_process_handlers() -> None:
    """For the whole process: SIGTERM raises Terminated; SIGXFSZ is ignored (EFBIG instead)."""
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def terminate_raises():
    """SIGTERM raises Terminated inside the block (start-up, before GracefulStop takes over);
    SIGINT and SIGTERM get their previous handlers back after it."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_stop_signals() -> None:
    """After a graceful stop's checkpoint: nothing is left to save, so further signals are ignored."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class GracefulStop:
    """While active, SIGINT and SIGTERM only set `requested` (the loop polls it between steps);
    the previous handlers come back on exit. Outside it, Ctrl-C raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        self.requested = True  # finish the step, checkpoint, exit 0

    def __enter__(self) -> GracefulStop:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
