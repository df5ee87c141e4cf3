"""The `rwkvx` command line. Commands parse, call the library, and render."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Annotated

import typer

from rwkvx_cli import __version__
from rwkvx_cli.errors import RwkvxError, UsageError
from rwkvx_cli.render import (
    TrainConsole,
    data_progress,
    err,
    out,
    prepared_line,
    print_summary,
    render_bench,
    render_gradcheck,
    render_model_bench,
)
from rwkvx_cli.train import signals
from rwkvx_cli.train.signals import Terminated

app = typer.Typer(
    name="rwkvx",
    help="Pretraining tool for RWKV-family recurrent language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def reports_errors(fn):
    """Render the project's errors as one line on stderr and exit with their code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RwkvxError as e:
            from rich.markup import escape  # a message may hold brackets: pip install 'rwkvx[wandb]'

            err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except Terminated:  # SIGTERM outside training's graceful stop (start-up)
            signals.ignore_stop_signals()  # a second one must not interrupt the exit
            err.print("[bold red]terminated[/]")
            raise typer.Exit(143) from None
        except KeyboardInterrupt:  # outside training's own handler (data preparation, eval, bench)
            err.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None
        except MemoryError:
            err.print("[bold red]error:[/] out of memory; make the model, batch or shape smaller", soft_wrap=True)
            raise typer.Exit(1) from None
        except OSError as e:  # a full disk, a file-size limit, a read-only or vanished path
            where = f"{e.filename}: " if e.filename else ""
            err.print(f"[bold red]error:[/] {where}{e.strerror or e}", soft_wrap=True, markup=False)
            raise typer.Exit(1) from None

    return wrapper


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


@app.command()
@reports_errors
def gradcheck(
    op: Annotated[str, typer.Option("--op", help="Operator to check (see the op registry), or all.")],
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", help="Backend to check; repeatable. Default: every production backend."),
    ] = None,
    seed: Annotated[int, typer.Option(min=0, max=2**53, help="Seed of the sampled inputs and cotangents.")] = 0,
    size: Annotated[int, typer.Option(min=1, help="Multiply the sequence length of gate A's cases.")] = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the numbers as JSON here.")] = None,
) -> None:
    """Check an op's backends against the fp64 oracle (gate A) and finite differences (gate B).
    `--op all` checks every registered op in turn: one report each, then an overall verdict."""
    from rwkvx_cli.gradcheck import run_gradcheck
    from rwkvx_cli.ops import get_op, op_names

    try:
        specs = [get_op(name) for name in (op_names() if op == "all" else [op])]
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    if op == "all" and backend:  # each op with the named backends it has (moba has no `cpu`)
        picked = {spec.name: [n for n in backend if n == "auto" or n in spec.backends] for spec in specs}
        specs = [spec for spec in specs if picked[spec.name]]
        if not specs:
            raise UsageError(f"--backend {', '.join(backend)}: no op has such a backend")
        chosen = [(spec, _gradcheck_backends(spec, picked[spec.name])) for spec in specs]
    else:
        chosen = [(spec, _gradcheck_backends(spec, backend)) for spec in specs]  # every usage error first
    from rwkvx_cli.memcheck import check_op_shape

    for spec in specs:  # fp64: at least three inputs and the output of each case
        for case in spec.cases:
            check_op_shape(case.scaled(size).dims, 8, 4, f"gradcheck {spec.name} --size {size} ({case.name})", "cpu")
    results = []
    for spec, backends in chosen:
        start = time.perf_counter()
        with err.status("gradcheck") as status:
            report = run_gradcheck(spec, backends, seed=seed, size=size, on_case=status.update)
        seconds = time.perf_counter() - start
        render_gradcheck(report)
        out.print(
            f"{_verdict(report.passed)} {report.op}: {len(report.results)} cases, "
            f"{', '.join(b.name for b in backends)} in {seconds:.1f}s"
        )
        results.append({**report.to_dict(), "seconds": seconds})
    passed = all(r["passed"] for r in results)
    if op == "all":
        seconds = sum(r["seconds"] for r in results)
        failed = [r["op"] for r in results if not r["passed"]]
        out.print(
            f"{_verdict(passed)} all: {len(results) - len(failed)} of {len(results)} ops passed in {seconds:.1f}s"
            + (f" (failed: {', '.join(failed)})" if failed else "")
        )
        _write_json(json_path, {"ops": results, "passed": passed, "seconds": seconds})
    else:
        _write_json(json_path, results[0])
    if not passed:
        raise typer.Exit(1)


def _gradcheck_backends(spec, names: list[str] | None) -> list:
    """The named backends of `spec`, or its production backends that run here (warning about the others)."""
    import torch

    from rwkvx_cli.ops import resolve_backend

    if names:
        try:
            return [resolve_backend(spec, name, torch.device("cpu")) for name in names]
        except ValueError as e:
            raise UsageError(str(e)) from None
    backends = []
    for bk in spec.production_backends():
        reason = bk.unavailable() if "cpu" in bk.devices else "does not run on cpu"
        if reason is None:
            backends.append(bk)
        else:
            err.print(f"[yellow]warning:[/] skipping the {bk.name!r} backend: {reason}", soft_wrap=True)
    return backends


def _verdict(passed: bool) -> str:
    return "[bold green]PASS[/]" if passed else "[bold red]FAIL[/]"


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run configuration.")]
Overrides = Annotated[
    list[str] | None, typer.Argument(help="Dotted overrides, e.g. train.lr=3e-4 model.n_layer=6.", show_default=False)
]


@app.command()
@reports_errors
def init(
    config: ConfigOpt = None,
    overrides: Overrides = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default: run_dir of the config).")
    ] = None,
) -> None:
    """Resolve the config, build the model, and write the run directory (config, step-0 weights, tokenizer)."""
    from rwkvx_cli.config import load_config
    from rwkvx_cli.train.runner import init_run

    cfg = load_config(config, overrides or [])
    if out_dir is not None:
        cfg.run_dir = str(out_dir)
    summary = init_run(cfg, data_progress=data_progress, on_prepared=lambda stats: out.print(prepared_line(stats)))
    print_summary(summary, Path(cfg.run_dir))


def _warn_skipped(path: Path, reason: str) -> None:
    err.print(f"[yellow]warning:[/] skipping damaged checkpoint {path.name}: {reason}", soft_wrap=True)


@app.command()
@reports_errors
def train(
    config: ConfigOpt = None,
    overrides: Overrides = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest checkpoint.")] = False,
) -> None:
    """Train (preparing the data first if needed), with a live view, checkpoints and metrics.jsonl.
    Under torchrun, data-parallel over the ranks (train.distributed: ddp or fsdp)."""
    with signals.terminate_raises():  # start-up: unwind and say so (then the run's graceful stop)
        _train(config, overrides, resume)


def _train(config, overrides, resume) -> None:
    from rwkvx_cli.config import load_config
    from rwkvx_cli.train import distributed
    from rwkvx_cli.train.runner import run_training

    cfg = load_config(config, overrides or [])
    info = distributed.from_env()
    if cfg.train.device == "cuda" and not _cuda_available():
        raise UsageError("train.device=cuda: no CUDA device is available here")
    device = distributed.init(info, cfg.train.device)
    if not info.is_main:
        out.quiet = True  # rank 0 reports; errors (stderr) still come from every rank
    try:
        with TrainConsole(cfg, info) as console:
            result = run_training(
                cfg,
                resume,
                info,
                device,
                on_event=console.on_event,
                on_skip=_warn_skipped,
                data_progress=data_progress,
            )
        if result.stopped:
            signals.ignore_stop_signals()
        console.finish(result)
    finally:
        distributed.shutdown()


@app.command("eval")
@reports_errors
def eval_cmd(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Checkpoint dir, or a run dir (latest).")],
    data_dir: Annotated[Path | None, typer.Option("--data", help="Prepared data dir (default: the run's).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    generate_prompt: Annotated[str | None, typer.Option("--generate", help="Sample a continuation of PROMPT.")] = None,
    n_tokens: Annotated[int, typer.Option("--tokens", min=1, help="Tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 0.85,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1)] = 0,
    tasks: Annotated[
        str | None, typer.Option("--tasks", help="lm-eval tasks to run instead, e.g. lambada_openai,hellaswag.")
    ] = None,
    limit: Annotated[
        float | None, typer.Option("--limit", min=0.0, help="--tasks: at most N examples per task (<1: a fraction).")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="--tasks: sequences per forward.")] = 16,
    num_fewshot: Annotated[
        int | None, typer.Option("--num-fewshot", min=0, help="--tasks: few-shot examples (default: each task's).")
    ] = None,
    include_path: Annotated[
        Path | None, typer.Option("--include-path", help="--tasks: a directory of extra task YAMLs.")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", help="--tasks: also write the results as JSON here.")
    ] = None,
    bootstrap_iters: Annotated[
        int, typer.Option("--bootstrap-iters", min=0, help="--tasks: bootstrap samples for stderrs (0: none).")
    ] = 100_000,
) -> None:
    """Validation loss, perplexity, bits per byte and tokens/s of a checkpoint; optionally sample text.
    With --tasks, lm-evaluation-harness tasks instead (docs/eval.md; pip install 'rwkvx[eval]')."""
    if tasks is not None:
        if generate_prompt is not None:
            raise UsageError("--generate and --tasks do not go together; run them separately")
        harness = dict(limit=limit, batch_size=batch_size, num_fewshot=num_fewshot, include_path=include_path)
        harness["bootstrap_iters"] = bootstrap_iters
        _eval_tasks(checkpoint, tasks, data_dir, output, json_out, seed=seed, **harness)
        return
    task_only = {"--limit": limit, "--num-fewshot": num_fewshot, "--include-path": include_path, "--output": output}
    for name, value in task_only.items():
        if value is not None:
            raise UsageError(f"{name} goes with --tasks")
    from rwkvx_cli.config import config_from_dict
    from rwkvx_cli.models import LM
    from rwkvx_cli.train import checkpoint as ck
    from rwkvx_cli.train.loop import evaluate, pick_device
    from rwkvx_cli.train.precision import resolve as resolve_precision
    from rwkvx_cli.train.run import check_same_tokenizer, open_data

    if generate_prompt is not None:
        try:
            generate_prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("--generate: the prompt is not valid UTF-8 text") from None
    path = ck.resolve_checkpoint(checkpoint, _warn_skipped)
    meta = ck.read_meta(path)
    cfg = config_from_dict(meta["config"])
    model = LM(cfg.model)
    ck.load_into(model, ck.load_weights(path), str(path))
    device = pick_device(cfg.train.device)
    model.to(device)
    # <run>/checkpoints/step_*: the run's data (a prepared directory, data.binidx or data.mix), or --data's.
    data = open_data(cfg, path.parent.parent, data_dir, check_train=False)
    tokenizer, val = data.tokenizer, data.val
    check_same_tokenizer(path.parent.parent, data.data_dir)  # figures on other tokens would be wrong
    if (data.data_dir / "meta.json").is_file() and (data_dir is not None or not (cfg.data.binidx or cfg.data.mix)):
        from rwkvx_cli.data.prepare import read_prepared_meta

        read_prepared_meta(data.data_dir, tokenizer.vocab_size)
    start = time.perf_counter()
    t = cfg.train
    # The run's train.precision, as its validation ran (fp32 where this device cannot run it)
    mode = resolve_precision(t.precision, device, fallback=True)
    ev = evaluate(model, val.tokens, t.ctx_len, t.micro_batch, t.eval_tokens, device, tokenizer, mode)
    ev["tokens_per_s"] = ev["tokens"] / (time.perf_counter() - start)
    ev["step"] = meta["step"]
    ev["checkpoint"] = str(path)
    if generate_prompt is not None:
        from rwkvx_cli.models.generate import generate

        ids = generate(model, tokenizer.encode(generate_prompt), n_tokens, temperature, top_p, seed)
        ev["sample"] = generate_prompt + tokenizer.decode(ids)
    if json_out:
        out.print_json(json.dumps(ev))
        return
    out.print(
        f"step {ev['step']}: val loss {ev['loss']:.4f}, perplexity {ev['ppl']:.2f}, bits/byte {ev['bpb']:.4f} "
        f"over {ev['tokens']:,} tokens ({ev['tokens_per_s']:,.0f} tokens/s)"
    )
    if "sample" in ev:
        out.print(ev["sample"], markup=False)


def _eval_tasks(checkpoint: Path, tasks: str, data_dir, output: Path | None, json_out: bool, **options) -> None:
    from rwkvx_cli.evaluation.harness import run_tasks

    start = time.perf_counter()
    scores = run_tasks(checkpoint, tasks, data_dir=data_dir, on_skip=_warn_skipped, **options)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(scores.summary, indent=2) + "\n")
    if json_out:
        out.print_json(json.dumps(scores.summary))
    else:
        out.print(f"step {scores.step} ({scores.checkpoint}), {time.perf_counter() - start:.1f} s:", markup=False)
        for task, metric, value, stderr in scores.rows:
            pm = f" ± {stderr:.2g}" if stderr is not None else ""
            out.print(f"  {task:<28} {metric:<16} {value:.4g}{pm}", markup=False)
    if output is not None:
        err.print(f"wrote {output}", markup=False)


@app.command()
@reports_errors
def explain(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Checkpoint dir, or a run dir (latest).")],
    text: Annotated[str, typer.Option("--text", help="The input text; its last token's prediction is explained.")],
    target: Annotated[
        str, typer.Option("--target", help="The token whose logit to explain (one token), or 'next': the top one.")
    ] = "next",
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Also each block output's relevance.")] = False,
    epsilon: Annotated[float, typer.Option("--epsilon", min=0.0, help="LRP-epsilon stabiliser (0: exact).")] = 0.0,
    data_dir: Annotated[Path | None, typer.Option("--data", help="Dir of tokenizer.json (default: the run's).")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write every number as JSON here.")] = None,
    html_path: Annotated[Path | None, typer.Option("--html", help="Also write the text coloured by relevance.")] = None,
    png_path: Annotated[Path | None, typer.Option("--png", help="Also write that picture as a PNG.")] = None,
) -> None:
    """Which input tokens made the model predict the next one: LRP for RWKV-4/RWKV-7 (docs/explain.md)."""
    from rwkvx_cli.explain import explain_checkpoint
    from rwkvx_cli.explain.render import relevance_table, write_html, write_json, write_png
    from rwkvx_cli.render import print_wide

    result = explain_checkpoint(checkpoint, text, target, per_layer, epsilon, data_dir, on_skip=_warn_skipped)
    print_wide(relevance_table(result))
    for path, write in ((json_path, write_json), (html_path, write_html), (png_path, write_png)):
        if path is not None:
            write(result, path)
            out.print(f"wrote {path}")


@app.command()
@reports_errors
def export(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Checkpoint dir, or a run dir (latest).")],
    out_path: Annotated[Path, typer.Option("--out", help="Output file, e.g. model.pth.")],
    fmt: Annotated[str, typer.Option("--format", help="rwkv-lm (.pth state dict) or safetensors.")] = "rwkv-lm",
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16.")] = "fp32",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out file.")] = False,
) -> None:
    """Write a checkpoint as RWKV-LM's state dict (.pth, tensors only) or as safetensors."""
    from rwkvx_cli.train.export import export_checkpoint

    info = export_checkpoint(checkpoint, out_path, fmt, dtype, on_skip=_warn_skipped, force=force)
    out.print(f"wrote {info['out']} ({info['format']}, {info['tensors']} tensors, step {info['step']})")


def _parse_shape(text: str) -> dict[str, int]:
    try:
        B, T, H, N = (int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--shape {text!r} must be B,T,H,N (four integers)") from None
    if min(B, T, H, N) < 1:
        raise UsageError(f"--shape {text!r}: every dimension must be >= 1")
    return {"B": B, "T": T, "H": H, "N": N}


@app.command()
@reports_errors
def bench(
    op: Annotated[list[str] | None, typer.Option("--op", help="Op to bench; repeatable. Default: every op.")] = None,
    backend: Annotated[
        list[str] | None, typer.Option("--backend", help="Backend; repeatable. Default: production + baseline.")
    ] = None,
    shape: Annotated[
        list[str] | None, typer.Option("--shape", help="B,T,H,N; repeatable. Default: the op's set.")
    ] = None,
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp64.")] = "fp32",
    mode: Annotated[list[str] | None, typer.Option("--mode", help="fwd or fwdbwd; repeatable.")] = None,
    baseline: Annotated[str, typer.Option(help="Backend the speedup column divides by.")] = "reference",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    model: Annotated[Path | None, typer.Option("--model", help="Bench training steps of this config instead.")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Training steps to time with --model.")] = 5,
    override: Annotated[
        list[str] | None, typer.Option("--set", help="Config override for --model, e.g. train.grad_cp=true.")
    ] = None,
    vs_gpt: Annotated[
        bool, typer.Option("--vs-gpt", help="With --model: also time a same-size GPT, interleaved; report the ratio.")
    ] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the numbers as JSON here.")] = None,
) -> None:
    """Time ops (median of repeats, GFLOP/s, % of this device's matmul peak, speedup vs a baseline)."""
    import torch

    from rwkvx_cli.bench import DTYPES, run_bench
    from rwkvx_cli.ops import get_op, op_names
    from rwkvx_cli.train.loop import pick_device

    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: valid are auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")
    dev = pick_device(device)
    if override and model is None:
        raise UsageError("--set overrides a --model config; pass --model CFG")
    if vs_gpt and model is None:
        raise UsageError("--vs-gpt compares a --model config with a GPT; pass --model CFG")
    if model is not None:
        from rwkvx_cli.bench_model import bench_model

        result = bench_model(model, steps, dev, override or [], vs_gpt=vs_gpt)
        render_model_bench(result)
        _write_json(json_path, result)
        return
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: valid are {', '.join(DTYPES)}")
    modes = mode or ["fwdbwd"]
    for m in modes:
        if m not in ("fwd", "fwdbwd"):
            raise UsageError(f"--mode {m!r}: valid are fwd, fwdbwd")
    try:
        specs = [get_op(name) for name in (op or op_names())]
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    for spec in specs:
        for name in [*(backend or []), baseline]:
            if name not in spec.backends:
                flag = "--baseline: " if name == baseline else ""
                raise UsageError(f"{flag}unknown backend {name!r} for {spec.name}; valid: {', '.join(spec.backends)}")
    shapes = [_parse_shape(s) for s in shape] if shape else None
    from rwkvx_cli.memcheck import check_op_shape

    for spec in specs:  # at least three inputs and the output (gradients and workspaces come on top)
        for dims in shapes or spec.bench_shapes:
            label = ",".join(str(dims[k]) for k in "BTHN")
            check_op_shape(dims, DTYPES[dtype].itemsize, 4, f"bench {spec.name} --shape {label}", dev)
    with err.status("bench") as status:
        report = run_bench(specs, backend, shapes, dtype, modes, baseline, dev, on_row=status.update)
    render_bench(report, baseline)
    _write_json(json_path, report.to_dict())


def _write_json(path: Path | None, data) -> None:
    if path is None:
        return
    from rwkvx_cli.fsio import atomic_write_text

    try:
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise RwkvxError(f"cannot write {path}: {e.strerror}") from None


data_app = typer.Typer(help="Prepare tokenized data.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("prepare")
@reports_errors
def data_prepare(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="Files, directories or glob patterns: .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet.",
            show_default=False,
        ),
    ],
    out_dir: Annotated[Path, typer.Option("--out", help="Output directory for train/val binidx.")],
    tokenizer: Annotated[str, typer.Option(help="byte, bpe, world, or a tokenizer.json path.")] = "byte",
    vocab_size: Annotated[int | None, typer.Option(min=258, help="BPE vocabulary size (bpe only).")] = None,
    val_fraction: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.05,
    seed: int = 0,
    text_field: Annotated[str, typer.Option(help="The document text's field in JSONL records and parquet.")] = "text",
    skip_bad: Annotated[
        bool, typer.Option("--skip-bad", help="Skip (and count) bad records instead of stopping at the first.")
    ] = False,
    eod_id: Annotated[
        int | None, typer.Option(min=0, help="End-of-document id of a tokenizer.json (default 0).")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Tokenizing processes (default: the cores this process may use).")
    ] = None,
    num_shards: Annotated[int, typer.Option(min=1, help="Split the inputs into K disjoint shards (machines).")] = 1,
    shard_index: Annotated[int, typer.Option(min=0, help="The shard to prepare, 0..K-1.")] = 0,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted prepare of the same inputs and options.")
    ] = False,
) -> None:
    """Tokenize a corpus into RWKV-LM binidx (.bin + .idx) with a validation split."""
    from rwkvx_cli.data import prepare
    from rwkvx_cli.render import prepare_progress, prepare_warnings

    with prepare_progress() as on_progress:
        stats = prepare(
            list(inputs),
            out_dir,
            tokenizer_kind=tokenizer,
            vocab_size=vocab_size,
            val_fraction=val_fraction,
            seed=seed,
            on_progress=on_progress,
            eod_id=eod_id,
            text_field=text_field,
            skip_bad=skip_bad,
            workers=workers,
            num_shards=num_shards,
            shard_index=shard_index,
            resume=resume,
        )
    out.print(prepared_line(stats), soft_wrap=True)
    prepare_warnings(stats)
    if stats.skipped_records:
        from rich.markup import escape

        first = escape(str(stats.first_skipped))
        err.print(f"[yellow]warning:[/] skipped {stats.skipped_records:,} bad records (first: {first})", soft_wrap=True)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    err.print(f"[yellow]warning:[/] {message}", soft_wrap=True)


def main() -> None:
    import warnings

    warnings.showwarning = _one_line_warning
    signals.install_process_handlers()  # SIGTERM unwinds like Ctrl-C (exit 143); EFBIG instead of SIGXFSZ
    try:
        app()
    except Terminated:  # before a command's own handler (reports_errors) is reached
        signals.ignore_stop_signals()
        err.print("[bold red]terminated[/]")
        raise SystemExit(143) from None
    finally:
        # The command is over: a late SIGTERM must not interrupt the exit (atexit hooks, e.g. torch's).
        signals.ignore_stop_signals()
