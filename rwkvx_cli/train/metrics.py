"""The metrics log, <run>/metrics.jsonl: one JSON line per optimizer step.

Lines are appended and flushed as steps finish, fsynced before each checkpoint (so
the lines up to a checkpoint survive a power loss with it), and cut back to the
checkpoint on resume, so that a resumed run's log reads as if it had never stopped.
Only rank 0 writes: on the other ranks every method is a no-op.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rwkvx_cli.fsio import atomic_write_text, fsync_file, open_append


@dataclass
class StepMetrics:
    step: int
    tokens: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    elapsed_s: float
    peak_mem_mb: float
    val_loss: float | None = None
    val_bpb: float | None = None
    skipped: bool = False  # this step's loss or gradient was not finite and it was not applied
    skipped_steps: int = 0  # such steps so far in the run
    epoch: int = 0  # the pass over the training data this step's batch began in (0 = the first)
    # Model FLOPs utilisation: tokens/s x train FLOPs per token / the matmul peak measured at the start
    # (null when it could not be measured; absent from the logs of older versions).
    mfu_pct: float | None = None


def json_line(m: StepMetrics) -> str:
    """One line of the log; a non-finite number is written as null (JSON has no NaN)."""
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(m).items()}
    return json.dumps(row) + "\n"


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._file = None

    def __enter__(self) -> MetricsLog:
        if self.enabled:
            self._file = open_append(self.path)
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def append(self, m: StepMetrics) -> None:
        if self._file is not None:
            self._file.write(json_line(m))
            self._file.flush()

    def note(self, row: dict) -> None:
        """A line that is not a step's metrics (it has no loss): e.g. the settings a resume changed."""
        if not self.enabled:
            return
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            return
        with open_append(self.path) as f:
            f.write(json.dumps(row) + "\n")
            fsync_file(f)

    def sync(self) -> None:
        """fsync what was appended (called before each checkpoint)."""
        if self._file is not None:
            fsync_file(self._file)

    def set_aside(self) -> Path | None:
        """A fresh run starts with an empty log: a non-empty one is renamed metrics.jsonl.old-N (never
        deleted); returns that new path, or None when there was nothing to keep."""
        if not self.enabled or not self.path.is_file():
            return None
        if self.path.stat().st_size == 0:
            self.path.unlink()
            return None
        n = 1
        while (kept := self.path.with_name(f"{self.path.name}.old-{n}")).exists():
            n += 1
        self.path.rename(kept)
        return kept

    def truncate(self, step: int) -> None:
        """Drop the lines logged after `step` (the checkpoint resumed from), and a line torn by a crash."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a line cut short by a crash: its step is after the checkpoint
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                keep.append(line + "\n")
        atomic_write_text(self.path, "".join(keep))
