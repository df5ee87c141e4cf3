"""The `rwkvx` commands' options as typer types (cli.py), by command: their flags, ranges, choices and
help. A type named here reads the same wherever a command takes it."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from rwkvx_cli import __version__
from rwkvx_cli.render.console import out


def _version(value: bool) -> None:
    if value:
        out.print(f"rwkvx {__version__}")
        raise typer.Exit()


def choices(name: str, *values: str) -> type[Enum]:
    """An option's fixed values, as the Enum typer checks them against."""
    return Enum(name, {v: v for v in values}, type=str)


Version = Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")]
Names = list[str] | None  # a repeatable option
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the numbers as JSON here.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace output files that exist.")]
CheckpointOpt = Annotated[Path, typer.Option("--checkpoint", help="Checkpoint dir, or a run dir (latest).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run configuration.")]
Overrides = Annotated[Names, typer.Argument(help="Dotted overrides, e.g. train.lr=3e-4 model.n_layer=6.")]
DataOpt = Annotated[Path | None, typer.Option("--data", help="Prepared data dir (default: the run's).")]

# eval --tasks and its options (lm-evaluation-harness, docs/eval.md)
Tasks = Annotated[str | None, typer.Option(help="lm-eval tasks to run instead, e.g. lambada_openai,hellaswag.")]
Limit = Annotated[float | None, typer.Option(min=0.0, help="--tasks: at most N examples per task (<1: a fraction).")]
BatchSize = Annotated[int, typer.Option(min=1, help="--tasks: sequences per forward.")]
FewShot = Annotated[int | None, typer.Option(min=0, help="--tasks: few-shot examples (default: each task's).")]
IncludePath = Annotated[Path | None, typer.Option(help="--tasks: a directory of extra task YAMLs.")]
Output = Annotated[Path | None, typer.Option(help="--tasks: also write the results as JSON here.")]
Bootstrap = Annotated[int, typer.Option(min=0, help="--tasks: bootstrap samples for stderrs (0: none).")]
# eval --by-position, --passkey and their options (docs/eval.md#long-context)
ByPosition = Annotated[bool, typer.Option("--by-position", help="Validation loss by token position, state carried.")]
MaxLen = Annotated[int | None, typer.Option(min=1, help="--by-position: the longest position (default <= 65,536).")]
Against = Annotated[Path | None, typer.Option(help="--by-position: also this checkpoint, on the same streams.")]
Passkey = Annotated[str | None, typer.Option(help="Passkey retrieval at these prompt lengths, e.g. 1k,4k,16k.")]
Trials = Annotated[int | None, typer.Option(min=1, help="--passkey: prompts per length and depth (default 4).")]
Plot = Annotated[Path | None, typer.Option(help="--by-position / --passkey: the PNG (default: in the run dir).")]
ResetAtEod = Annotated[
    bool | None,
    typer.Option(
        "--reset-at-eod/--no-reset-at-eod",
        help="Evaluate with / without a fresh state at each end-of-document token (default: as trained).",
    ),
]
Documents = Annotated[
    bool | None,
    typer.Option(
        "--documents/--no-documents",
        help="Read each validation document alone from its start / consecutive windows (default: as trained).",
    ),
]
StateFile = Annotated[
    Path | None,
    typer.Option("--state", help="Start every row from this tuned state (export --format state-safetensors)."),
]

# export
ExportFormat = choices("ExportFormat", "rwkv-lm", "safetensors", "hf", "rwkv-x", "state", "state-safetensors")
ExportDtype = choices("ExportDtype", "fp32", "bf16", "fp16")
FormatOpt = Annotated[
    ExportFormat,
    typer.Option("--format", help="rwkv-lm, safetensors, hf (a dir), rwkv-x; a tuned state: state, state-safetensors."),
]

# bench: ops
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
VsFinetune = Annotated[
    bool,
    typer.Option("--vs-finetune", help="With train.tune=state: also time full fine-tuning of the same model."),
]
VsPacked = Annotated[
    bool, typer.Option("--vs-packed", help="With data.reset_at_eod: also time the same step without document starts.")
]

# data prepare, data merge
Inputs = Annotated[
    list[str], typer.Argument(help="Files, folders or globs: .txt, .jsonl(.gz/.zst), .parquet.", show_default=False)
]
Prepared = Annotated[
    list[str], typer.Argument(help="Prepared directories or globs: the shards of one corpus.", show_default=False)
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
