"""Run directories: their layout, resolving the data, building the model, summarising it.

<run>/config.yaml (resolved), <run>/tokenizer.json, <run>/data/ (prepared
tokens unless data.prepared_dir says otherwise), <run>/checkpoints/,
<run>/metrics.jsonl, <run>/loss.png. The paths are built here only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from rwkvx_cli.config import Config, ConfigError, config_to_dict
from rwkvx_cli.data import PrepareStats, load_tokenizer, open_tokens, prepare
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.fsio import atomic_write_bytes, atomic_write_text
from rwkvx_cli.models import LM, build_model
from rwkvx_cli.ops import get_op


def checkpoints_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def metrics_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / "metrics.jsonl"


def loss_plot_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / "loss.png"


@dataclass
class RunData:
    train: object
    val: object
    tokenizer: object
    data_dir: Path
    prepared: PrepareStats | None  # set when this call tokenized the corpus


def data_dir_for(cfg: Config, run_dir: Path) -> Path:
    """Where a run's prepared tokens are: the corpus itself when it is a prepared directory,
    else data.prepared_dir, else <run>/data. Training and `rwkvx eval` both use this rule."""
    corpus = [Path(p) for p in cfg.data.corpus]
    if len(corpus) == 1 and corpus[0].is_dir():
        return corpus[0]  # already prepared
    return Path(cfg.data.prepared_dir) if cfg.data.prepared_dir else run_dir / "data"


def ensure_data(cfg: Config, run_dir: Path, progress=None) -> RunData:
    """Prepare the corpus once (tokenize, split, write binidx), then open it."""
    data_dir = data_dir_for(cfg, run_dir)
    stats = None
    if not (data_dir / "meta.json").is_file():
        for p in cfg.data.corpus:
            if not Path(p).exists():
                raise ConfigError(f"data.corpus: {p} does not exist")
        stats = prepare(
            [Path(p) for p in cfg.data.corpus],
            data_dir,
            tokenizer_kind=cfg.data.tokenizer,
            vocab_size=cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else None,
            val_fraction=cfg.data.val_fraction,
            seed=cfg.train.seed,
            progress=progress,
        )
    tokenizer = load_tokenizer(data_dir / "tokenizer.json")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
        )
    train, val = open_tokens(data_dir / "train.bin"), open_tokens(data_dir / "val.bin")
    for split in (train, val):
        split.check_vocab(cfg.model.vocab_size)
    for name, split in (("training", train), ("validation", val)):
        if len(split.tokens) < cfg.train.ctx_len + 1:
            raise DataError(
                f"the {name} split ({data_dir}) has {len(split.tokens)} tokens, fewer than one window of "
                f"train.ctx_len + 1 = {cfg.train.ctx_len + 1}"
            )
    return RunData(train, val, tokenizer, data_dir, stats)


def open_run(
    cfg: Config,
    run_dir: Path,
    data_progress: Callable[[], contextlib.AbstractContextManager] | None = None,
    on_prepared: Callable[[PrepareStats], None] | None = None,
) -> tuple[RunData, LM]:
    """Prepare the data if needed, build the model, and write the run files. `data_progress()`
    is entered around the preparation and yields its progress callback (done, total);
    `on_prepared(stats)` hears when this call tokenized the corpus."""
    with data_progress() if data_progress else contextlib.nullcontext() as progress:
        data = ensure_data(cfg, run_dir, progress)
    if data.prepared is not None and on_prepared:
        on_prepared(data.prepared)
    model = new_model(cfg)
    write_run_files(cfg, run_dir, data)
    return data, model


def write_run_files(cfg: Config, run_dir: Path, data: RunData) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    if data.data_dir.resolve() != run_dir.resolve():
        target = run_dir / "tokenizer.json"
        if not target.exists() or target.resolve() != (data.data_dir / "tokenizer.json").resolve():
            atomic_write_bytes(target, (data.data_dir / "tokenizer.json").read_bytes())


# One letter per block in the model summary.
BLOCK_LETTERS = {"rwkv7": "R", "moba": "A", "rwkv4": "4", "gdn": "G", "kda": "K", "rwkv8": "8"}


def model_summary(model: LM) -> dict:
    """Parameter counts per component, forward FLOPs per token, recurrent state size."""
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        if name.startswith("emb."):
            key = "embedding"
        elif name.startswith("head."):
            key = "head"
        elif name.startswith("blocks."):
            kind = model.kinds[int(name.split(".")[1])]
            part = name.split(".")[2]
            key = f"{kind}.{'time_mix' if part == 'att' else 'channel_mix' if part == 'ffn' else 'norms'}"
        else:
            key = "norms"
        groups[key] = groups.get(key, 0) + p.numel()
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("emb."))
    # FLOPs/token: 2 per matmul weight forward (6 with backward), plus each recurrent
    # layer's op count for one token (the op's registry `flops`, e.g. wkv7: 9 N² per head
    # forward, 28 N² with backward). Attention's score/value products are not counted.
    fwd = bwd = 0.0
    state_floats = 0
    for kind, blk in zip(model.kinds, model.blocks, strict=True):
        if kind == "moba":
            continue
        op, dims = blk.att.op_dims()
        fwd += get_op(op).flops(dims, "fwd")
        bwd += get_op(op).flops(dims, "fwdbwd")
        state_floats += sum(t.numel() for t in blk.empty_state(1, "cpu").values())
    return {
        "parameters": sum(groups.values()),
        "by_component": groups,
        "forward_flops_per_token": int(2 * matmul + fwd),
        "train_flops_per_token": int(6 * matmul + bwd),
        "state_bytes_per_sequence_fp32": 4 * state_floats,
        "blocks": "".join(BLOCK_LETTERS[k] for k in model.kinds),
    }


def new_model(cfg: Config) -> LM:
    return build_model(cfg.model, cfg.train.seed)
