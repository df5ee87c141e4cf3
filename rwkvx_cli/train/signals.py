"""A graceful stop: SIGINT or SIGTERM ends a training run after its current step, with a
checkpoint and exit status 0, instead of killing it mid-step."""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
