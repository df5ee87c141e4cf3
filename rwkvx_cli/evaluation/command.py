"""What `rwkvx eval` computes for its options: one of its modes, the others' options refused.

    plain        validation loss, perplexity, bits per byte (evaluation/validation.py), with
                 --generate a sampled continuation
    tasks        --tasks: lm-evaluation-harness (evaluation/harness.py)
    by_position  --by-position: loss by token position (evaluation/long_context.py)
    passkey      --passkey LENGTHS: passkey retrieval (evaluation/long_context.py)
"""

from __future__ import annotations

from pathlib import Path

from rwkvx_cli.errors import UsageError

LONG = ("by_position", "max_len", "against", "passkey", "trials", "plot")
TASK_ONLY = ("limit", "num_fewshot", "include_path", "output")


def run_eval(checkpoint: Path, *, on_skip=None, on_progress=None, **o) -> tuple[str, object]:
    """(mode, what it computed) for the eval options `o` (the CLI's, by parameter name); `on_progress(what,
    done, total[, unit])` hears the work done (render.console.progress shows it)."""
    long = {k: o[k] for k in LONG}
    plain_only = [f"--{k.replace('_', '-')}" for k in ("state", "documents") if o[k] is not None]
    if plain_only and (o["tasks"] is not None or any(v not in (None, False) for v in long.values())):
        raise UsageError(
            f"{plain_only[0]} goes with the validation figures and --generate, not --tasks or long context"
        )
    if any(v not in (None, False) for v in long.values()):
        from rwkvx_cli.evaluation.long_context import run_long_context

        others = {"--tasks": o["tasks"], "--generate": o["generate"]}
        args = (checkpoint, o["data_dir"], o["seed"], others, on_skip, on_progress)
        result = run_long_context(*args, force=o["force"], reset_at_eod=o["reset_at_eod"], **long)
        return result["kind"], result
    if o["tasks"] is None:
        given = [f"--{k.replace('_', '-')}" for k in TASK_ONLY if o[k] is not None]
        if given:
            raise UsageError(f"{given[0]} goes with --tasks")
        from rwkvx_cli.evaluation.validation import eval_checkpoint

        sample = {"prompt": o["generate"], "n_tokens": o["tokens"], "temperature": o["temperature"]}
        sample |= {"top_p": o["top_p"], "seed": o["seed"], "reset_at_eod": o["reset_at_eod"]}
        sample |= {"documents": o["documents"], "state": o["state"]}
        return "plain", eval_checkpoint(checkpoint, o["data_dir"], on_skip=on_skip, on_progress=on_progress, **sample)
    if o["generate"] is not None:
        raise UsageError("--generate and --tasks do not go together; run them separately")
    if o["reset_at_eod"] is not None:
        raise UsageError("--reset-at-eod / --no-reset-at-eod do not go with --tasks")
    from rwkvx_cli.evaluation.harness import run_tasks

    keys = ("limit", "num_fewshot", "include_path", "batch_size", "bootstrap_iters", "seed", "output", "force")
    options = {k: o[k] for k in keys} | {"on_skip": on_skip, "on_progress": on_progress}
    scores = run_tasks(checkpoint, o["tasks"], data_dir=o["data_dir"], **options)
    return "tasks", scores
