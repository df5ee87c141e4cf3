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
            err.print(f"[bold red]error:[/] {e}", soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:  # outside training's own handler (data preparation, eval, bench)
            err.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None

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
    seed: Annotated[int, typer.Option(help="Seed of the sampled inputs and cotangents.")] = 0,
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
    chosen = [(spec, _gradcheck_backends(spec, backend)) for spec in specs]  # every usage error first
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
    from rwkvx_cli.config import load_config
    from rwkvx_cli.train import distributed
    from rwkvx_cli.train.runner import run_training

    cfg = load_config(config, overrides or [])
    info = distributed.from_env()
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
    seed: int = 0,
) -> None:
    """Validation loss, perplexity, bits per byte and tokens/s of a checkpoint; optionally sample text."""
    from rwkvx_cli.config import config_from_dict
    from rwkvx_cli.data import load_tokenizer, open_tokens
    from rwkvx_cli.models import LM
    from rwkvx_cli.train import checkpoint as ck
    from rwkvx_cli.train.loop import evaluate, pick_device
    from rwkvx_cli.train.run import data_dir_for

    path = ck.resolve_checkpoint(checkpoint, _warn_skipped)
    meta = ck.read_meta(path)
    cfg = config_from_dict(meta["config"])
    model = LM(cfg.model)
    ck.load_into(model, ck.load_weights(path), str(path))
    device = pick_device(cfg.train.device)
    model.to(device)
    ddir = data_dir or data_dir_for(cfg, path.parent.parent)  # <run>/checkpoints/step_*: the run's rule
    tokenizer = load_tokenizer(ddir / "tokenizer.json")
    val = open_tokens(ddir / "val.bin")
    val.check_vocab(cfg.model.vocab_size)
    start = time.perf_counter()
    t = cfg.train
    ev = evaluate(model, val.tokens, t.ctx_len, t.micro_batch, t.eval_tokens, device, tokenizer)
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


@app.command()
@reports_errors
def export(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Checkpoint dir, or a run dir (latest).")],
    out_path: Annotated[Path, typer.Option("--out", help="Output file, e.g. model.pth.")],
    fmt: Annotated[str, typer.Option("--format", help="rwkv-lm (.pth state dict) or safetensors.")] = "rwkv-lm",
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16.")] = "fp32",
) -> None:
    """Write a checkpoint as RWKV-LM's state dict (.pth, tensors only) or as safetensors."""
    from rwkvx_cli.train.export import export_checkpoint

    info = export_checkpoint(checkpoint, out_path, fmt, dtype, on_skip=_warn_skipped)
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
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the numbers as JSON here.")] = None,
) -> None:
    """Time ops (median of repeats, GFLOP/s, % of this device's matmul peak, speedup vs a baseline)."""
    from rwkvx_cli.bench import DTYPES, run_bench
    from rwkvx_cli.ops import get_op, op_names
    from rwkvx_cli.train.loop import pick_device

    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: valid are auto, cpu, cuda")
    dev = pick_device(device)
    if model is not None:
        from rwkvx_cli.bench_model import bench_model

        result = bench_model(model, steps, dev)
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
        for name in backend or []:
            if name not in spec.backends:
                raise UsageError(f"unknown backend {name!r} for {spec.name}; valid: {', '.join(spec.backends)}")
    shapes = [_parse_shape(s) for s in shape] if shape else None
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
    inputs: Annotated[list[Path], typer.Argument(help='Text (.txt) or JSONL ({"text": ...}) files.')],
    out_dir: Annotated[Path, typer.Option("--out", help="Output directory for train/val binidx.")],
    tokenizer: Annotated[str, typer.Option(help="byte, bpe, or a tokenizer.json path.")] = "byte",
    vocab_size: Annotated[int | None, typer.Option(min=258, help="BPE vocabulary size (bpe only).")] = None,
    val_fraction: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.05,
    seed: int = 0,
) -> None:
    """Tokenize text/JSONL into RWKV-LM binidx (.bin + .idx) with a validation split."""
    from rwkvx_cli.data import prepare

    with data_progress() as update:
        stats = prepare(
            list(inputs),
            out_dir,
            tokenizer_kind=tokenizer,
            vocab_size=vocab_size,
            val_fraction=val_fraction,
            seed=seed,
            progress=update,
        )
    out.print(prepared_line(stats))


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    err.print(f"[yellow]warning:[/] {message}", soft_wrap=True)


def main() -> None:
    import warnings

    warnings.showwarning = _one_line_warning
    app()
