"""`rwkvx eval --tasks`: a checkpoint on lm-evaluation-harness tasks (docs/eval.md).

lm_eval is an optional dependency (`pip install 'rwkvx[eval]'`), imported only here and only
when tasks are asked for. Task names are checked before the model is loaded. lm-eval indexes
every built-in task YAML to find one (~14,000 of them: seconds), so the tasks of
`--include-path` are looked up first, alone, and the built-in index is built only for names
they do not define.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import check_output, write_json
from rwkvx_cli.runs import open_checkpoint

INSTALL_HINT = "pip install 'rwkvx[eval]'"


def require_lm_eval():
    """The lm_eval module, or a UsageError that says how to install it."""
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401  (a broken install fails here, not mid-run)
    except ImportError as e:
        raise UsageError(f"--tasks needs lm-evaluation-harness ({e}); install it with {INSTALL_HINT}") from None
    return lm_eval


def split_names(tasks: str) -> list[str]:
    names = [n.strip() for n in tasks.split(",") if n.strip()]
    if not names:
        raise UsageError("--tasks: name at least one lm-eval task, e.g. --tasks lambada_openai,hellaswag")
    return list(dict.fromkeys(names))


def task_manager(names: list[str], include_path: Path | None):
    """A TaskManager that knows every name (glob patterns and YAML file paths allowed), or a
    UsageError naming the first unknown one and the nearest known name."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not include_path.is_dir():
            raise UsageError(f"--include-path: {include_path} is not a directory")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if not _unknown(local, names):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    missing = _unknown(manager, names)
    if missing:
        name = missing[0]
        near = difflib.get_close_matches(name, manager.all_tasks, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else " (`lm-eval ls tasks` lists them)"
        where = f" in lm-eval's tasks or {include_path}" if include_path is not None else " in lm-eval's tasks"
        raise UsageError(f"--tasks: no task {name!r}{where}{hint}")
    return manager


def expand_names(manager, names: list[str]) -> list[str]:
    """Glob patterns (mmlu_*) replaced by the names they match, as lm-eval's own CLI does."""
    out: list[str] = []
    for n in names:
        out += [n] if Path(n).is_file() or n in manager.all_tasks else manager.match_tasks([n])
    return list(dict.fromkeys(out))


def _unknown(manager, names: list[str]) -> list[str]:
    return [n for n in names if not Path(n).is_file() and not manager.match_tasks([n])]


@dataclass
class TaskScores:
    """What one run of the harness found: each task's (metric, value, stderr) rows, and the raw
    summary written by --output."""

    checkpoint: str
    step: int
    precision: str
    seconds: float = 0.0  # loading the model and running the tasks
    rows: list[tuple[str, str, float, float | None]] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def run_tasks(
    checkpoint: Path,
    tasks: str,
    *,
    limit: float | None = None,
    batch_size: int = 16,
    num_fewshot: int | None = None,
    include_path: Path | None = None,
    data_dir: Path | None = None,
    bootstrap_iters: int = 100_000,
    seed: int = 0,
    on_skip: Callable[[Path, str], None] | None = None,
    output: Path | None = None,
    force: bool = False,
    on_progress=None,
) -> TaskScores:
    """Evaluate a checkpoint (a checkpoint dir, or a run dir: its newest good one) on lm-eval
    tasks with its run's tokenizer; with `output`, the summary is also written there as JSON (an existing
    file only with `force`). Bad names and a refused output fail before the weights are read.
    `on_progress(what, done, total, unit)`: the requests our model has answered (adapter.RwkvxLM)."""
    start = time.perf_counter()
    require_lm_eval()
    names = split_names(tasks)
    if limit is not None and limit <= 0:
        raise UsageError(f"--limit: {limit:g} must be > 0 (a count of examples, or a fraction below 1)")
    if output is not None:
        check_output(output, force, "--output")
    manager = task_manager(names, include_path)
    names = expand_names(manager, names)

    import torch
    from lm_eval import simple_evaluate

    from rwkvx_cli.evaluation.adapter import RwkvxLM

    # The run's train.precision, as its validation ran (fp32 where this device cannot run it).
    opened = open_checkpoint(checkpoint, data_dir=data_dir, on_skip=on_skip)
    mode = opened.runtime.precision
    max_length = opened.config.train.ctx_len
    lm = RwkvxLM(opened.model, opened.tokenizer, max_length, batch_size, mode, on_progress=on_progress)
    if limit is not None and limit >= 1 and float(limit).is_integer():
        limit = int(limit)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # lm-eval prints progress notes on stdout: keep stdout for our table (or --json) alone.
    with _pool_workers_die_quietly(), contextlib.redirect_stdout(sys.stderr):
        results = simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
            task_manager=manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    scores = TaskScores(str(opened.checkpoint.path), opened.step, mode, time.perf_counter() - start)
    scores.summary = _summary(results, scores, limit, num_fewshot, batch_size)
    for task, metrics in results.get("results", {}).items():
        known = results.get("higher_is_better", {}).get(task)  # the task's metrics (not sample_len)
        for key, value in metrics.items():
            if key == "alias" or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric = key.split(",")[0]
            if known is not None and metric not in known:
                continue
            stderr = metrics.get(key.replace(",", "_stderr,", 1))
            scores.rows.append((task, metric, float(value), _number(stderr)))
    write_json(output, scores.summary, force=force, flag="--output")
    return scores


@contextlib.contextmanager
def _pool_workers_die_quietly():
    """lm-eval bootstraps stderrs in a forked multiprocessing pool and ends it with SIGTERM; forked
    workers inherit our handler (SIGTERM raises Terminated: a traceback per worker). In a child,
    SIGTERM kills it as by default; in this process the handler is unchanged."""
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous):
        yield
        return
    main = os.getpid()

    def handler(signum, frame):
        if os.getpid() != main:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        previous(signum, frame)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave the handlers alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _summary(results: dict, scores: TaskScores, limit, num_fewshot, batch_size) -> dict:
    keep = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
    summary = {
        "checkpoint": scores.checkpoint,
        "step": scores.step,
        "precision": scores.precision,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
        "lm_eval_version": _version(),
    }
    summary.update({k: results[k] for k in keep if k in results})
    return json.loads(json.dumps(summary, default=_jsonable))


def _jsonable(obj):
    try:
        from lm_eval.utils import handle_non_serializable

        return handle_non_serializable(obj)
    except ImportError:  # pragma: no cover - older lm-eval
        return str(obj)


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("lm_eval")
    except Exception:  # pragma: no cover - an unusual install
        return None
