"""The `rwkvx` command line. Each command parses its options, calls one library function, and
renders what it returns (render/, a module per command); errors become one line on stderr and an exit code."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from rwkvx_cli import __version__
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import check_output, write_json
from rwkvx_cli.render.console import OneLineErrors, err, one_line_warning, out, reports_errors, warn_skipped
from rwkvx_cli.train import signals
from rwkvx_cli.train.signals import Terminated

HELP = "Pretraining tool for RWKV-family recurrent language models."
app = typer.Typer(name="rwkvx", cls=OneLineErrors, help=HELP, no_args_is_help=True, add_completion=False)
app.pretty_exceptions_enable = False  # a bug's traceback stays plain


def _version(value: bool) -> None:
    if value:
        out.print(f"rwkvx {__version__}")
        raise typer.Exit()


Version = Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")]


@app.callback()
def _root(version: Version = False):
    pass


Names = list[str] | None  # a repeatable option
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the numbers as JSON here.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace output files that exist.")]
CheckpointOpt = Annotated[Path, typer.Option("--checkpoint", help="Checkpoint dir, or a run dir (latest).")]


@app.command()
@reports_errors
def gradcheck(
    op: Annotated[str, typer.Option("--op", help="Operator to check (see the op registry), or all.")],
    backend: Annotated[Names, typer.Option("--backend", help="Repeatable. Default: every production backend.")] = None,
    seed: Annotated[int, typer.Option(min=0, max=2**53, help="Seed of the sampled inputs and cotangents.")] = 0,
    size: Annotated[int, typer.Option(min=1, help="Multiply the sequence length of gate A's cases.")] = 1,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
) -> None:
    """Check an op's backends against the fp64 oracle (gate A) and finite differences (gate B).
    `--op all` checks every registered op in turn: one report each, then an overall verdict."""
    from rwkvx_cli.render.gradcheck import gradcheck_run, warn_skipped_backend
    from rwkvx_cli.tools.gradcheck import plan_gradcheck

    plan = plan_gradcheck(op, backend, size, on_skip=warn_skipped_backend)  # every usage error first
    if json_path is not None:
        check_output(json_path, force, "--json")  # before minutes of checks
    summary = gradcheck_run(plan, seed, size, all_ops=op == "all")
    write_json(json_path, summary if op == "all" else summary["ops"][0], force=force)
    if not summary["passed"]:
        raise typer.Exit(1)


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run configuration.")]
Overrides = Annotated[Names, typer.Argument(help="Dotted overrides, e.g. train.lr=3e-4 model.n_layer=6.")]


@app.command()
@reports_errors
def init(
    config: ConfigOpt = None,
    overrides: Overrides = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Run directory (default: the config's).")] = None,
    start: Annotated[Path | None, typer.Option("--from", help="Start from these weights; their sizes.")] = None,
) -> None:
    """Resolve the config, build the model, and write the run directory (config, step-0 weights, tokenizer).
    With --from (train.init_from), the model's sizes are read from the weights."""
    from rwkvx_cli.config import load_config
    from rwkvx_cli.render.data import data_progress, print_prepared
    from rwkvx_cli.render.train import print_summary
    from rwkvx_cli.train.runner import init_run

    cfg = load_config(config, overrides or [])
    cfg.run_dir, cfg.train.init_from = str(out_dir or cfg.run_dir), str(start or cfg.train.init_from)
    summary = init_run(cfg, data_progress=data_progress, on_prepared=print_prepared, on_skip=warn_skipped)
    print_summary(summary, Path(cfg.run_dir))


@app.command()
@reports_errors
def train(
    config: ConfigOpt = None,
    overrides: Overrides = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest checkpoint.")] = False,
    allow_change: Annotated[Names, typer.Option(help="--resume: accept this changed setting; repeatable.")] = None,
) -> None:
    """Train (preparing the data first if needed), with a live view, checkpoints and metrics.jsonl.
    Under torchrun, data-parallel over the ranks (train.distributed: ddp or fsdp)."""
    from rwkvx_cli.config import load_config
    from rwkvx_cli.render.data import data_progress
    from rwkvx_cli.render.train import TrainConsole
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


DataOpt = Annotated[Path | None, typer.Option("--data", help="Prepared data dir (default: the run's).")]
# --tasks and its options (lm-evaluation-harness, docs/eval.md)
Tasks = Annotated[str | None, typer.Option(help="lm-eval tasks to run instead, e.g. lambada_openai,hellaswag.")]
Limit = Annotated[float | None, typer.Option(min=0.0, help="--tasks: at most N examples per task (<1: a fraction).")]
BatchSize = Annotated[int, typer.Option(min=1, help="--tasks: sequences per forward.")]
FewShot = Annotated[int | None, typer.Option(min=0, help="--tasks: few-shot examples (default: each task's).")]
IncludePath = Annotated[Path | None, typer.Option(help="--tasks: a directory of extra task YAMLs.")]
Output = Annotated[Path | None, typer.Option(help="--tasks: also write the results as JSON here.")]
Bootstrap = Annotated[int, typer.Option(min=0, help="--tasks: bootstrap samples for stderrs (0: none).")]
# --by-position, --passkey and their options (docs/eval.md#long-context)
ByPosition = Annotated[bool, typer.Option("--by-position", help="Validation loss by token position, state carried.")]
MaxLen = Annotated[int | None, typer.Option(min=1, help="--by-position: the longest position (default <= 65,536).")]
Against = Annotated[Path | None, typer.Option(help="--by-position: also this checkpoint, on the same streams.")]
Passkey = Annotated[str | None, typer.Option(help="Passkey retrieval at these prompt lengths, e.g. 1k,4k,16k.")]
Trials = Annotated[int | None, typer.Option(min=1, help="--passkey: prompts per length and depth (default 4).")]
Plot = Annotated[Path | None, typer.Option(help="--by-position / --passkey: the PNG (default: in the run dir).")]


@app.command("eval")
@reports_errors
def eval_cmd(
    checkpoint: CheckpointOpt,
    data_dir: DataOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    generate: Annotated[str | None, typer.Option(help="Sample a continuation of PROMPT.")] = None,
    tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.85,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1)] = 0,
    tasks: Tasks = None,
    limit: Limit = None,
    batch_size: BatchSize = 16,
    num_fewshot: FewShot = None,
    include_path: IncludePath = None,
    output: Output = None,
    bootstrap_iters: Bootstrap = 100_000,
    by_position: ByPosition = False,
    max_len: MaxLen = None,
    against: Against = None,
    passkey: Passkey = None,
    trials: Trials = None,
    plot: Plot = None,
    reset_at_eod: Annotated[
        bool | None,
        typer.Option(
            "--reset-at-eod/--no-reset-at-eod",
            help="Evaluate with / without a fresh state at each end-of-document token (default: as trained).",
        ),
    ] = None,
    force: ForceOpt = False,
) -> None:
    """Validation loss, perplexity, bits/byte and tokens/s of a checkpoint (--generate: and a sample); --tasks:
    lm-evaluation-harness (docs/eval.md; pip install 'rwkvx\\[eval]'); --by-position, --passkey: long context."""
    options = dict(locals())  # every option, by name: the library checks which go together
    from rwkvx_cli.evaluation.command import run_eval
    from rwkvx_cli.render.console import progress
    from rwkvx_cli.render.eval import render_evaluation

    with progress() as on_progress:
        mode, result = run_eval(options.pop("checkpoint"), on_skip=warn_skipped, on_progress=on_progress, **options)
    render_evaluation(mode, result, json_out, output)


@app.command()
@reports_errors
def explain(
    checkpoint: CheckpointOpt,
    text: Annotated[str, typer.Option("--text", help="The input text; its last token's prediction is explained.")],
    target: Annotated[str, typer.Option(help="The token whose logit to explain, or 'next': the top one.")] = "next",
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Also each block output's relevance.")] = False,
    epsilon: Annotated[float, typer.Option("--epsilon", min=0.0, help="LRP-epsilon stabiliser (0: exact).")] = 0.0,
    data_dir: DataOpt = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write every number as JSON here.")] = None,
    html_path: Annotated[Path | None, typer.Option("--html", help="Also write the text coloured by relevance.")] = None,
    png_path: Annotated[Path | None, typer.Option("--png", help="Also write that picture as a PNG.")] = None,
    force: ForceOpt = False,
) -> None:
    """Which input tokens made the model predict the next one: LRP for RWKV-4/RWKV-7 (docs/explain.md)."""
    from rwkvx_cli.explain import explain_checkpoint
    from rwkvx_cli.explain import render as pictures
    from rwkvx_cli.render.console import print_wide

    pictures.check_outputs(json_path, html_path, png_path, force)
    writers = ((json_path, pictures.write_json), (html_path, pictures.write_html), (png_path, pictures.write_png))
    result = explain_checkpoint(checkpoint, text, target, per_layer, epsilon, data_dir, on_skip=warn_skipped)
    print_wide(pictures.relevance_table(result))
    for path, write in writers:
        if path is not None:
            out.print(f"wrote {write(result, path, force)}", markup=False)


def choices(name: str, *values: str) -> type[Enum]:
    """An option's fixed values, as the Enum typer checks them against."""
    return Enum(name, {v: v for v in values}, type=str)


ExportFormat = choices("ExportFormat", "rwkv-lm", "safetensors", "hf", "rwkv-x")
ExportDtype = choices("ExportDtype", "fp32", "bf16", "fp16")
FormatOpt = Annotated[ExportFormat, typer.Option("--format", help="rwkv-lm, safetensors, hf (a dir), rwkv-x.")]


@app.command()
@reports_errors
def export(
    checkpoint: CheckpointOpt,
    out_path: Annotated[Path, typer.Option("--out", help="Output file (hf: a directory).")],
    fmt: FormatOpt = ExportFormat["rwkv-lm"],
    dtype: Annotated[ExportDtype, typer.Option(help="Tensor dtype of the file.")] = ExportDtype["fp32"],
    force: Annotated[bool, typer.Option("--force", help="Replace --out; export non-finite values anyway.")] = False,
) -> None:
    """Write a checkpoint for other tools: RWKV-LM .pth, safetensors, Hugging Face (fla) dir, RWKV-X .pth."""
    from rwkvx_cli.render.export import render_export
    from rwkvx_cli.runs.export import export_checkpoint

    render_export(export_checkpoint(checkpoint, out_path, fmt.value, dtype.value, on_skip=warn_skipped, force=force))


BenchDevice = choices("BenchDevice", "auto", "cpu", "cuda")
BenchDtype = choices("BenchDtype", "fp32", "bf16", "fp64")
BenchMode = choices("BenchMode", "fwd", "fwdbwd")
OpNames = Annotated[Names, typer.Option("--op", help="Op to bench; repeatable. Default: every op.")]
Backends = Annotated[Names, typer.Option("--backend", help="Backend; repeatable. Default: production + baseline.")]
Shapes = Annotated[Names, typer.Option("--shape", help="B,T,H,N; repeatable. Default: the op's set.")]
Modes = Annotated[list[BenchMode] | None, typer.Option("--mode", help="Repeatable (default fwdbwd).")]
StartsEvery = Annotated[
    int,
    typer.Option(
        "--starts-every",
        min=0,
        help="Also time each row with a document start every K tokens (the ops that take starts).",
    ),
]
Baseline = Annotated[str, typer.Option(help="Backend the speedup column divides by.")]
# bench --model CFG: training steps of a config
ModelCfg = Annotated[Path | None, typer.Option("--model", help="Bench training steps of this config instead.")]
Steps = Annotated[int, typer.Option(min=1, help="Training steps to time with --model.")]
Sets = Annotated[Names, typer.Option("--set", help="Config override for --model, e.g. train.grad_cp=true.")]
VsGpt = Annotated[bool, typer.Option("--vs-gpt", help="With --model: also time a same-size GPT; report the ratio.")]
VsFull = Annotated[bool, typer.Option("--vs-unchunked", help="With train.chunk_len: also time the unchunked step.")]
VsUnfused = Annotated[bool, typer.Option("--vs-unfused", help="Also time the same model unfused (model.fused=false).")]
VsPacked = Annotated[
    bool, typer.Option("--vs-packed", help="With data.reset_at_eod: also time the same step without document starts.")
]


@app.command()
@reports_errors
def bench(
    op: OpNames = None,
    backend: Backends = None,
    shape: Shapes = None,
    dtype: BenchDtype = BenchDtype["fp32"],
    mode: Modes = None,
    starts_every: StartsEvery = 0,
    baseline: Baseline = "reference",
    device: BenchDevice = BenchDevice["auto"],
    model: ModelCfg = None,
    steps: Steps = 5,
    override: Sets = None,
    vs_gpt: VsGpt = False,
    vs_unchunked: VsFull = False,
    vs_unfused: VsUnfused = False,
    vs_packed: VsPacked = False,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
) -> None:
    """Time ops (median of repeats, GFLOP/s, % of this device's matmul peak, speedup vs a baseline)."""
    from rwkvx_cli.render.bench import bench_status, render_bench, render_model_bench
    from rwkvx_cli.runs.runtime import resolve_device

    flags = (
        ("--set", override),
        ("--vs-gpt", vs_gpt),
        ("--vs-unchunked", vs_unchunked),
        ("--vs-unfused", vs_unfused),
        ("--vs-packed", vs_packed),
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

        result = bench_model(
            model,
            steps,
            dev,
            override or [],
            vs_gpt=vs_gpt,
            vs_unchunked=vs_unchunked,
            vs_unfused=vs_unfused,
            vs_packed=vs_packed,
        )
        render_model_bench(result)
        write_json(json_path, result, force=force)
        return
    from rwkvx_cli.tools.bench import plan_bench, run_bench

    specs, shapes = plan_bench(op, backend, shape, dtype.value, baseline, dev)
    modes = [m.value for m in mode or [BenchMode["fwdbwd"]]]
    with bench_status() as on_row:
        report = run_bench(
            specs, backend, shapes, dtype.value, modes, baseline, dev, on_row=on_row, starts_every=starts_every
        )
    render_bench(report, baseline)
    write_json(json_path, report.to_dict(), force=force)


data_app = typer.Typer(help="Prepare tokenized data.", no_args_is_help=True)
app.add_typer(data_app, name="data")


Inputs = Annotated[
    list[str], typer.Argument(help="Files, folders or globs: .txt, .jsonl(.gz/.zst), .parquet.", show_default=False)
]
OutDir = Annotated[Path, typer.Option("--out", help="Output directory for train/val binidx.")]
Tokenizer = Annotated[str, typer.Option(help="byte, bpe, world, or a tokenizer.json path.")]
VocabSize = Annotated[int | None, typer.Option(min=257, max=2**31 - 1, help="BPE vocabulary size (bpe only).")]
Fraction = Annotated[float, typer.Option(min=0.0, max=1.0, help="Held-out share of the tokens.")]
TextField = Annotated[str, typer.Option(help="The document text's field in JSONL records and parquet.")]
SkipBad = Annotated[bool, typer.Option("--skip-bad", help="Skip (and count) bad records instead of stopping.")]
EodId = Annotated[int | None, typer.Option(min=0, help="End-of-document id of a tokenizer.json (default 0).")]
PrepareSeed = Annotated[int, typer.Option(min=0, max=2**63 - 1, help="Seed of the validation documents' choice.")]
Workers = Annotated[int | None, typer.Option(min=1, help="Tokenizing processes (default: the cores available).")]
Shards = Annotated[int, typer.Option(min=1, help="Split the inputs into K disjoint shards (machines).")]
ShardIndex = Annotated[int, typer.Option(min=0, help="The shard to prepare, 0..K-1.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue an interrupted prepare of the same inputs.")]
Template = Annotated[
    str, typer.Option(help="Chat template of JSONL conversations and prompt/response records: g1, or a file.")
]


@data_app.command("prepare")
@reports_errors
def data_prepare(
    inputs: Inputs,
    out_dir: OutDir,
    tokenizer: Tokenizer = "byte",
    vocab_size: VocabSize = None,
    val_fraction: Fraction = 0.05,
    seed: PrepareSeed = 0,
    text_field: TextField = "text",
    skip_bad: SkipBad = False,
    eod_id: EodId = None,
    workers: Workers = None,
    num_shards: Shards = 1,
    shard_index: ShardIndex = 0,
    resume: Resume = False,
    template: Template = "g1",
) -> None:
    """Tokenize a corpus into RWKV-LM binidx (.bin + .idx) with a validation split, on every core."""
    from rwkvx_cli.data import prepare
    from rwkvx_cli.render.data import prepare_progress, render_prepared

    options = dict(tokenizer_kind=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction, seed=seed)
    options |= dict(eod_id=eod_id, text_field=text_field, skip_bad=skip_bad, workers=workers, resume=resume)
    options["template"] = template
    with prepare_progress() as on_progress:
        stats = prepare(
            list(inputs), out_dir, on_progress=on_progress, num_shards=num_shards, shard_index=shard_index, **options
        )
    render_prepared(stats)


Prepared = Annotated[
    list[str], typer.Argument(help="Prepared directories or globs: the shards of one corpus.", show_default=False)
]


@data_app.command("merge")
@reports_errors
def data_merge(dirs: Prepared, out_dir: OutDir) -> None:
    """Write prepared directories (the shards of --num-shards, or any with one tokenizer) as one, copying tokens."""
    from rwkvx_cli.data.merge import merge_prepared
    from rwkvx_cli.render.data import render_merged

    render_merged(merge_prepared(list(dirs), out_dir))


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
