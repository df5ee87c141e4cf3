"""The `rwkvx` command line: a table of commands (COMMANDS, at the end). Each command parses its options
(their types: cli_options.py), calls one library function, and renders what it returns (render/, a module
per command); errors become one line on stderr and an exit code (render/console.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rwkvx_cli import cli_options as opt
from rwkvx_cli.cli_options import Names
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import check_output, write_json
from rwkvx_cli.render.bench import bench_status, render_bench, render_model_bench
from rwkvx_cli.render.console import (
    OneLineErrors,
    err,
    one_line_warning,
    out,
    print_wide,
    progress,
    reports_errors,
    warn_skipped,
)
from rwkvx_cli.render.data import data_progress, prepare_progress, print_prepared, render_merged, render_prepared
from rwkvx_cli.render.eval import render_evaluation
from rwkvx_cli.render.export import render_export
from rwkvx_cli.render.gradcheck import gradcheck_run, warn_skipped_backend
from rwkvx_cli.render.train import TrainConsole, print_summary
from rwkvx_cli.train import signals
from rwkvx_cli.train.signals import Terminated


def gradcheck(
    op: Annotated[str, typer.Option("--op", help="Operator to check (see the op registry), or all.")],
    backend: Annotated[Names, typer.Option("--backend", help="Repeatable. Default: every production backend.")] = None,
    seed: Annotated[int, typer.Option(min=0, max=2**53, help="Seed of the sampled inputs and cotangents.")] = 0,
    size: Annotated[int, typer.Option(min=1, help="Multiply the sequence length of gate A's cases.")] = 1,
    json_path: opt.JsonOpt = None,
    force: opt.ForceOpt = False,
) -> None:
    """Check an op's backends against the fp64 oracle (gate A) and finite differences (gate B).
    `--op all` checks every registered op in turn: one report each, then an overall verdict."""
    from rwkvx_cli.tools.gradcheck import plan_gradcheck

    plan = plan_gradcheck(op, backend, size, on_skip=warn_skipped_backend)  # every usage error first
    if json_path is not None:
        check_output(json_path, force, "--json")  # before minutes of checks
    summary = gradcheck_run(plan, seed, size, all_ops=op == "all")
    write_json(json_path, summary if op == "all" else summary["ops"][0], force=force)
    if not summary["passed"]:
        raise typer.Exit(1)


def init(
    config: opt.ConfigOpt = None,
    overrides: opt.Overrides = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Run directory (default: the config's).")] = None,
    start: Annotated[Path | None, typer.Option("--from", help="Start from these weights; their sizes.")] = None,
) -> None:
    """Resolve the config, build the model, and write the run directory (config, step-0 weights, tokenizer).
    With --from (train.init_from), the model's sizes are read from the weights."""
    from rwkvx_cli.config import load_config
    from rwkvx_cli.train.runner import init_run

    cfg = load_config(config, overrides or [])
    cfg.run_dir, cfg.train.init_from = str(out_dir or cfg.run_dir), str(start or cfg.train.init_from)
    summary = init_run(cfg, data_progress=data_progress, on_prepared=print_prepared, on_skip=warn_skipped)
    print_summary(summary, Path(cfg.run_dir))


def train(
    config: opt.ConfigOpt = None,
    overrides: opt.Overrides = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest checkpoint.")] = False,
    allow_change: Annotated[Names, typer.Option(help="--resume: accept this changed setting; repeatable.")] = None,
) -> None:
    """Train (preparing the data first if needed), with a live view, checkpoints and metrics.jsonl.
    Under torchrun, data-parallel over the ranks (train.distributed: ddp or fsdp)."""
    from rwkvx_cli.config import load_config
    from rwkvx_cli.train import distributed
    from rwkvx_cli.train.runner import run_training

    with signals.terminate_raises():  # start-up: unwind and say so (then the run's graceful stop)
        cfg = load_config(config, overrides or [])
        dist = distributed.from_env()
        out.quiet = not dist.is_main  # rank 0 reports; errors (stderr) still come from every rank
        with TrainConsole(cfg, dist) as console:
            events = dict(on_event=console.on_event, on_skip=warn_skipped, data_progress=data_progress)
            result = run_training(cfg, resume, dist, allow_change=allow_change or (), **events)
        if result.stopped:
            signals.ignore_stop_signals()
        console.finish(result)


def eval_cmd(
    checkpoint: opt.CheckpointOpt,
    data_dir: opt.DataOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    generate: Annotated[str | None, typer.Option(help="Sample a continuation of PROMPT.")] = None,
    tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.85,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1)] = 0,
    tasks: opt.Tasks = None,
    limit: opt.Limit = None,
    batch_size: opt.BatchSize = 16,
    num_fewshot: opt.FewShot = None,
    include_path: opt.IncludePath = None,
    output: opt.Output = None,
    bootstrap_iters: opt.Bootstrap = 100_000,
    by_position: opt.ByPosition = False,
    max_len: opt.MaxLen = None,
    against: opt.Against = None,
    passkey: opt.Passkey = None,
    trials: opt.Trials = None,
    plot: opt.Plot = None,
    reset_at_eod: opt.ResetAtEod = None,
    documents: opt.Documents = None,
    state: opt.StateFile = None,
    force: opt.ForceOpt = False,
) -> None:
    """Validation loss, perplexity, bits/byte and tokens/s of a checkpoint (--generate: and a sample; --state: from
    a tuned state); --tasks:
    lm-evaluation-harness (docs/eval.md; pip install 'rwkvx\\[eval]'); --by-position, --passkey: long context."""
    options = dict(locals())  # every option, by name: the library checks which go together
    from rwkvx_cli.evaluation.command import run_eval

    with progress() as on_progress:
        mode, result = run_eval(options.pop("checkpoint"), on_skip=warn_skipped, on_progress=on_progress, **options)
    render_evaluation(mode, result, json_out, output)


def explain(
    checkpoint: opt.CheckpointOpt,
    text: Annotated[str, typer.Option("--text", help="The input text; its last token's prediction is explained.")],
    target: Annotated[str, typer.Option(help="The token whose logit to explain, or 'next': the top one.")] = "next",
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Also each block output's relevance.")] = False,
    epsilon: Annotated[float, typer.Option("--epsilon", min=0.0, help="LRP-epsilon stabiliser (0: exact).")] = 0.0,
    data_dir: opt.DataOpt = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write every number as JSON here.")] = None,
    html_path: Annotated[Path | None, typer.Option("--html", help="Also write the text coloured by relevance.")] = None,
    png_path: Annotated[Path | None, typer.Option("--png", help="Also write that picture as a PNG.")] = None,
    force: opt.ForceOpt = False,
) -> None:
    """Which input tokens made the model predict the next one: LRP for RWKV-4/RWKV-7 (docs/explain.md)."""
    from rwkvx_cli.explain import explain_checkpoint
    from rwkvx_cli.explain import render as pictures

    pictures.check_outputs(json_path, html_path, png_path, force)
    writers = ((json_path, pictures.write_json), (html_path, pictures.write_html), (png_path, pictures.write_png))
    result = explain_checkpoint(checkpoint, text, target, per_layer, epsilon, data_dir, on_skip=warn_skipped)
    print_wide(pictures.relevance_table(result))
    for path, write in writers:
        if path is not None:
            out.print(f"wrote {write(result, path, force)}", markup=False)


def export(
    checkpoint: opt.CheckpointOpt,
    out_path: Annotated[Path, typer.Option("--out", help="Output file (hf: a directory).")],
    fmt: opt.FormatOpt = opt.ExportFormat["rwkv-lm"],
    dtype: Annotated[opt.ExportDtype, typer.Option(help="Tensor dtype of the file.")] = opt.ExportDtype["fp32"],
    force: Annotated[bool, typer.Option("--force", help="Replace --out; export non-finite values anyway.")] = False,
) -> None:
    """Write a checkpoint for other tools: RWKV-LM .pth, safetensors, Hugging Face (fla) dir, RWKV-X .pth; a
    state-tuned run's state: RWKV-PEFT's .pth (state), rwkvx's .safetensors (state-safetensors)."""
    from rwkvx_cli.runs.export import export_checkpoint

    render_export(export_checkpoint(checkpoint, out_path, fmt.value, dtype.value, on_skip=warn_skipped, force=force))


def bench(
    op: opt.OpNames = None,
    backend: opt.Backends = None,
    shape: opt.Shapes = None,
    dtype: opt.BenchDtype = opt.BenchDtype["fp32"],
    mode: opt.Modes = None,
    starts_every: opt.StartsEvery = 0,
    baseline: opt.Baseline = "reference",
    device: opt.BenchDevice = opt.BenchDevice["auto"],
    model: opt.ModelCfg = None,
    steps: opt.Steps = 5,
    override: opt.Sets = None,
    vs_gpt: opt.VsGpt = False,
    vs_unchunked: opt.VsFull = False,
    vs_unfused: opt.VsUnfused = False,
    vs_packed: opt.VsPacked = False,
    vs_finetune: opt.VsFinetune = False,
    state: opt.StateFile = None,
    json_path: opt.JsonOpt = None,
    force: opt.ForceOpt = False,
) -> None:
    """Time ops (median of repeats, GFLOP/s, % of this device's matmul peak, speedup vs a baseline)."""
    from rwkvx_cli.runs.runtime import resolve_device

    flags = (
        ("--set", override),
        ("--vs-gpt", vs_gpt),
        ("--vs-unchunked", vs_unchunked),
        ("--vs-unfused", vs_unfused),
        ("--vs-packed", vs_packed),
        ("--vs-finetune", vs_finetune),
        ("--state", state),
    )
    if model is not None and starts_every:
        raise UsageError("--starts-every times ops; it does not go with --model")
    given = [flag for flag, on in flags if on]
    if model is None and given:
        raise UsageError(f"{given[0]} goes with --model CFG")
    dev = resolve_device(device.value, setting="--device")
    if json_path is not None:
        check_output(json_path, force, "--json")
    if model is not None:
        from rwkvx_cli.tools.bench_model import bench_model

        vs = dict(vs_gpt=vs_gpt, vs_unchunked=vs_unchunked, vs_unfused=vs_unfused, vs_packed=vs_packed)
        result = bench_model(model, steps, dev, override or [], **vs, state=state, vs_finetune=vs_finetune)
        render_model_bench(result)
        write_json(json_path, result, force=force)
        return
    from rwkvx_cli.tools.bench import plan_bench, run_bench

    specs, shapes = plan_bench(op, backend, shape, dtype.value, baseline, dev)
    modes = [m.value for m in mode or [opt.BenchMode["fwdbwd"]]]
    with bench_status() as on_row:
        report = run_bench(
            specs, backend, shapes, dtype.value, modes, baseline, dev, on_row=on_row, starts_every=starts_every
        )
    render_bench(report, baseline)
    write_json(json_path, report.to_dict(), force=force)


def data_prepare(
    inputs: opt.Inputs,
    out_dir: opt.OutDir,
    tokenizer: opt.Tokenizer = "byte",
    vocab_size: opt.VocabSize = None,
    val_fraction: opt.Fraction = 0.05,
    seed: opt.PrepareSeed = 0,
    text_field: opt.TextField = "text",
    skip_bad: opt.SkipBad = False,
    eod_id: opt.EodId = None,
    workers: opt.Workers = None,
    num_shards: opt.Shards = 1,
    shard_index: opt.ShardIndex = 0,
    resume: opt.Resume = False,
    template: opt.Template = "g1",
) -> None:
    """Tokenize a corpus into RWKV-LM binidx (.bin + .idx) with a validation split, on every core."""
    from rwkvx_cli.data import prepare

    options = dict(tokenizer_kind=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction, seed=seed)
    options |= dict(eod_id=eod_id, text_field=text_field, skip_bad=skip_bad, workers=workers, resume=resume)
    options["template"] = template
    with prepare_progress() as on_progress:
        stats = prepare(
            list(inputs), out_dir, on_progress=on_progress, num_shards=num_shards, shard_index=shard_index, **options
        )
    render_prepared(stats)


def data_merge(dirs: opt.Prepared, out_dir: opt.OutDir) -> None:
    """Write prepared directories (the shards of --num-shards, or any with one tokenizer) as one, copying tokens."""
    from rwkvx_cli.data.merge import merge_prepared

    render_merged(merge_prepared(list(dirs), out_dir))


def _root(version: opt.Version = False):
    pass


# The table of commands, in --help's order: `rwkvx NAME`, and `rwkvx data NAME`. Each reports the
# project's errors as one line on stderr and exits with their code (reports_errors).
COMMANDS = {
    "gradcheck": gradcheck,
    "init": init,
    "train": train,
    "eval": eval_cmd,
    "explain": explain,
    "export": export,
    "bench": bench,
}
DATA_COMMANDS = {"prepare": data_prepare, "merge": data_merge}

HELP = "Pretraining tool for RWKV-family recurrent language models."
app = typer.Typer(name="rwkvx", cls=OneLineErrors, help=HELP, no_args_is_help=True, add_completion=False)
app.pretty_exceptions_enable = False  # a bug's traceback stays plain
app.callback()(_root)
data_app = typer.Typer(help="Prepare tokenized data.", no_args_is_help=True)
app.add_typer(data_app, name="data")
for name, command in COMMANDS.items():
    app.command(name)(reports_errors(command))
for name, command in DATA_COMMANDS.items():
    data_app.command(name)(reports_errors(command))


def main() -> None:
    import warnings

    warnings.showwarning = one_line_warning
    signals.install_process_handlers()  # SIGTERM unwinds like Ctrl-C (exit 143); EFBIG instead of SIGXFSZ
    try:
        signals.restore_interrupt()  # the package's start-up handler (rwkvx_cli/__init__.py) hands over
        app()
    except Terminated:  # before a command's own handler (reports_errors) is reached
        signals.ignore_stop_signals()
        err.print("[bold red]terminated[/]")
        raise SystemExit(143) from None
    except KeyboardInterrupt:  # between the start-up handler and typer's (whose exit 130 OneLineErrors reports)
        signals.ignore_stop_signals()
        err.print("[bold red]interrupted[/]")
        raise SystemExit(130) from None
    finally:
        # The command is over: a late SIGTERM must not interrupt the exit (atexit hooks, e.g. torch's).
        signals.ignore_stop_signals()
