"""train.profile_steps: [a, b] records steps a..b (1-based, inclusive) with torch.profiler and writes
a Chrome trace (chrome://tracing, https://ui.perfetto.dev) to <run>/profile/trace-stepA-B.json
(-rankR before .json under torchrun, one per rank). Off when profile_steps is empty."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from rwkvx_cli.fsio import create_temp
from rwkvx_cli.runs.runtime import profiler_quiet


def trace_path(run_dir: Path, first: int, last: int, rank: int = 0, world_size: int = 1) -> Path:
    suffix = f"-rank{rank}" if world_size > 1 else ""
    return Path(run_dir) / "profile" / f"trace-step{first}-{last}{suffix}.json"


class StepProfiler:
    """Wrap each step in `profiler.step(n)` (n: the 1-based step about to run). The profile starts at the
    first step of the range this session runs (a resumed run may start inside it) and is written after
    step b, or when the block it is entered around ends first; an error stops it without writing."""

    def __init__(self, run_dir: Path, steps: list[int], device: torch.device, rank: int = 0, world_size: int = 1):
        self.range = (steps[0], steps[1]) if steps else None
        self.path = trace_path(run_dir, *self.range, rank, world_size) if self.range else None
        self.device = device
        self.prof = None
        self.done = False
        self._unreported: Path | None = None

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)

    @contextlib.contextmanager
    def step(self, n: int):
        if self.range is None or not self.range[0] <= n <= self.range[1] or self.done:
            yield
            return
        if self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            with profiler_quiet():
                self.prof.__enter__()
        with torch.profiler.record_function(f"train step {n}"):
            yield
        if n == self.range[1]:
            self.close()

    def take_written(self) -> Path | None:
        """The trace's path once, after it is written (for the "profile" event)."""
        path, self._unreported = self._unreported, None
        return path

    def close(self) -> None:
        """Stop and write the trace if a profile is running."""
        if self.prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self.prof = self.prof, None
        with profiler_quiet():
            prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp, f = create_temp(self.path)  # a new file, renamed into place: never written through a link
        f.close()
        try:
            prof.export_chrome_trace(str(tmp))
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.done = True
        self._unreported = self.path
