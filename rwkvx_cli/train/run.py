"""Run directories: their layout, resolving the data, building the model, summarising it.

<run>/config.yaml (resolved), <run>/tokenizer.json, <run>/data/ (prepared
tokens unless data.prepared_dir says otherwise), <run>/checkpoints/,
<run>/metrics.jsonl, <run>/loss.png. The paths are built here only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from rwkvx_cli.config import Config, ConfigError, config_to_dict
from rwkvx_cli.data import PrepareStats, load_tokenizer, open_tokens, prepare
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.fsio import RUN_MARKER, atomic_write_bytes, atomic_write_text, claim_dir
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
    train: object  # a token split (`.tokens`), or a Mixture
    val: object
    tokenizer: object
    data_dir: Path
    prepared: PrepareStats | None  # set when this call tokenized the corpus


@dataclass
class TokenSpan:
    """Part of a token file: the training head or validation tail of a bare prefix (data.val_tokens)."""

    tokens: np.ndarray


@dataclass
class Mixture:
    """data.mix's training splits, in its order. `tokens` lists their token arrays: the Trainer
    draws from them by data.mix's weights."""

    sources: list

    @property
    def tokens(self) -> list[np.ndarray]:
        return [s.tokens for s in self.sources]


# Written beside a bare prefix's or a mixture's tokenizer.json: what the run trains and validates on.
SOURCE_FILE = "source.json"


def _prepared(path: Path) -> bool:
    return path.is_dir() and (path / "meta.json").is_file()


def data_dir_for(cfg: Config, run_dir: Path) -> Path:
    """Where a run's prepared tokens (or, for data.binidx / data.mix, its tokenizer.json and
    source.json) are: the corpus itself when it is a prepared directory (one holding meta.json;
    any other directory is a corpus folder to prepare), else data.prepared_dir, else <run>/data.
    Training and `rwkvx eval` both use this rule."""
    corpus = [Path(p) for p in cfg.data.corpus]
    if not cfg.data.binidx and cfg.data.mix is None and len(corpus) == 1 and _prepared(corpus[0]):
        return corpus[0]  # already prepared
    return Path(cfg.data.prepared_dir) if cfg.data.prepared_dir else run_dir / "data"


def needs_preparing(cfg: Config, run_dir: Path) -> bool:
    """True when training would tokenize data.corpus first (a bare prefix or a mixture never is)."""
    if cfg.data.binidx or cfg.data.mix is not None:
        return False
    return not (data_dir_for(cfg, run_dir) / "meta.json").is_file()


def prepare_command(cfg: Config, run_dir: Path) -> str:
    """What to run before a multi-process train of an unprepared corpus: the `rwkvx data prepare`
    command that prepares what `ensure_data` would, and where the config then finds it."""
    d = cfg.data
    # The run directory itself is not the place: rwkvx claims only a new or empty run directory.
    out = Path(d.prepared_dir) if d.prepared_dir else run_dir.parent / "data" / run_dir.name
    args = ["rwkvx", "data", "prepare", *d.corpus, "--out", str(out), "--tokenizer", d.tokenizer]
    if d.tokenizer == "bpe":
        args += ["--vocab-size", str(d.bpe_vocab_size)]
    if d.tokenizer not in ("byte", "bpe", "world"):
        args += ["--eod-id", str(d.eod_id)]
    args += ["--val-fraction", f"{d.val_fraction:g}", "--seed", str(cfg.train.seed)]
    then = "then train again" if d.prepared_dir else f"then train with data.corpus={shlex.quote(str(out))}"
    return f"`{shlex.join(args)}` once first (one process), {then}"


def ensure_data(cfg: Config, run_dir: Path, progress=None) -> RunData:
    """Prepare the corpus once (tokenize, split, write binidx), then open it. A bare prefix or a
    mixture is opened as it is, and its tokenizer.json and source.json written to the data directory."""
    stats = None
    if needs_preparing(cfg, run_dir):
        for p in cfg.data.corpus:
            if not Path(p).exists() and not any(ch in p for ch in "*?["):
                raise ConfigError(f"data.corpus: {p} does not exist")
        named = cfg.data.tokenizer in ("byte", "bpe", "world")
        stats = prepare(
            [Path(p) for p in cfg.data.corpus],
            data_dir_for(cfg, run_dir),
            tokenizer_kind=cfg.data.tokenizer,
            vocab_size=cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else None,
            val_fraction=cfg.data.val_fraction,
            seed=cfg.train.seed,
            progress=progress,
            eod_id=None if named else cfg.data.eod_id,
        )
    data = open_data(cfg, run_dir)
    data.prepared = stats
    if cfg.data.binidx or cfg.data.mix is not None:
        _write_if_changed(data.data_dir / "tokenizer.json", data.tokenizer.to_json())
        _write_if_changed(data.data_dir / SOURCE_FILE, json.dumps(_source_meta(cfg, data), indent=2) + "\n")
    return data


def open_data(cfg: Config, run_dir: Path, data_dir: Path | None = None, check_train: bool = True) -> RunData:
    """Open a run's data as it is, without preparing anything: the prepared directory (`data_dir`,
    default `data_dir_for`), the bare prefix data.binidx, or the mixture data.mix. Token ids are
    checked against the vocabulary, and each split must hold one window of train.ctx_len + 1
    (only the validation split's when not `check_train`: evaluation reads nothing else)."""
    d = cfg.data
    if data_dir is not None or not (d.binidx or d.mix is not None):
        ddir = data_dir if data_dir is not None else data_dir_for(cfg, run_dir)
        tokenizer = _dir_tokenizer(ddir)
        train, val = open_tokens(ddir / "train.bin"), open_tokens(ddir / "val.bin")
        splits = [("training", ddir, train), ("validation", ddir, val)]
    elif d.binidx:
        ddir = data_dir_for(cfg, run_dir)
        tokenizer = _named_tokenizer(cfg)
        whole = open_tokens(d.binidx)
        if d.val_binidx:
            train, val = whole, open_tokens(d.val_binidx)
            splits = [("training", d.binidx, train), ("validation", d.val_binidx, val)]
        else:
            n = len(whole.tokens)
            if d.val_tokens >= n:
                raise ConfigError(f"data.val_tokens: {d.val_tokens} leaves no training data: {d.binidx} has {n} tokens")
            _check_vocab([("data.binidx", whole)], cfg, tokenizer)  # the spans below are parts of it
            train, val = TokenSpan(whole.tokens[: n - d.val_tokens]), TokenSpan(whole.tokens[n - d.val_tokens :])
            tail = f"the last {d.val_tokens} tokens of {d.binidx}"
            splits = [("training", d.binidx, train), ("validation", tail, val)]
    else:
        ddir = data_dir_for(cfg, run_dir)
        train, val, tokenizer, splits = _open_mix(cfg)
    if not check_train:
        splits = [s for s in splits if s[0] != "training"]
    _check_vocab([(f"the {name} split ({where})", split) for name, where, split in splits], cfg, tokenizer)
    for name, where, split in splits:
        if len(split.tokens) < cfg.train.ctx_len + 1:
            raise DataError(
                f"the {name} split ({where}) has {len(split.tokens)} tokens, fewer than one window of "
                f"train.ctx_len + 1 = {cfg.train.ctx_len + 1}"
            )
    return RunData(train, val, tokenizer, ddir, None)


def _check_vocab(splits, cfg: Config, tokenizer) -> None:
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
        )
    for _, split in splits:
        if not isinstance(split, TokenSpan):  # a span's whole file is checked
            split.check_vocab(min(cfg.model.vocab_size, tokenizer.vocab_size))


def _dir_tokenizer(ddir: Path):
    """A prepared directory's tokenizer, with the end-of-document id it was prepared with."""
    eod_id = None
    try:
        meta = json.loads((ddir / "meta.json").read_text())
        eod_id = meta["tokenizer"]["eod_id"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # an older meta.json: the default id
    return load_tokenizer(ddir / "tokenizer.json", eod_id=eod_id if isinstance(eod_id, int) else None)


def _named_tokenizer(cfg: Config):
    """data.tokenizer for tokens that came without one: byte, world or a tokenizer.json path."""
    name = cfg.data.tokenizer
    if name in ("byte", "world"):
        return load_tokenizer(name)
    if not Path(name).is_file():
        raise ConfigError(
            f"data.tokenizer: {name!r} is not a tokenizer name (byte, world) nor a tokenizer.json file"
        )
    return load_tokenizer(name, eod_id=cfg.data.eod_id)


def _open_mix(cfg: Config):
    """(train Mixture, validation split, tokenizer, splits to check) of data.mix."""
    d = cfg.data
    sources, splits, dirs = [], [], []
    for i, src in enumerate(d.mix):
        path = Path(src.path)
        if path.is_dir():
            if not _prepared(path):
                raise DataError(
                    f"data.mix[{i}]: {path} is a directory without meta.json, not a prepared dataset; "
                    f"prepare it first with `rwkvx data prepare FILES --out {path}`"
                )
            split = open_tokens(path / "train.bin")
            dirs.append(path)
        else:
            split = open_tokens(path)
        sources.append(split)
        if src.weight > 0:
            splits.append(("training", f"data.mix[{i}] {path}", split))
    if dirs:
        tokenizer = _dir_tokenizer(dirs[0])
        for other in dirs[1:]:
            if (other / "tokenizer.json").read_bytes() != (dirs[0] / "tokenizer.json").read_bytes():
                raise DataError(f"data.mix: {dirs[0]} and {other} were prepared with different tokenizers")
    else:
        tokenizer = _named_tokenizer(cfg)
    if d.val_binidx:
        val, where = open_tokens(d.val_binidx), d.val_binidx
    elif dirs:
        val, where = open_tokens(dirs[0] / "val.bin"), dirs[0]
    else:
        raise ConfigError("data.mix: no source is a prepared directory with a validation split; set data.val_binidx")
    return Mixture(sources), val, tokenizer, [*splits, ("validation", where, val)]


def _source_meta(cfg: Config, data: RunData) -> dict:
    """What a bare-prefix or mixture run trains and validates on (<data dir>/source.json)."""
    d = cfg.data

    def describe(split, path) -> dict:
        return {"path": str(Path(path).resolve()), "tokens": len(split.tokens), "dtype": str(split.tokens.dtype)}

    if d.binidx:
        train = describe(data.train, d.binidx)
        if d.val_tokens:
            train["held_out_tokens"] = d.val_tokens
            val = {"held_out": f"the last {d.val_tokens} tokens of data.binidx", "tokens": d.val_tokens}
        else:
            val = describe(data.val, d.val_binidx)
        body = {"train": train}
    else:
        body = {
            "mix": [
                {**describe(split, src.path), "weight": src.weight}
                for src, split in zip(d.mix, data.train.sources, strict=True)
            ]
        }
        first_dir = next((s.path for s in d.mix if Path(s.path).is_dir()), None)
        val = describe(data.val, d.val_binidx or Path(first_dir) / "val")
    return {
        "format": "rwkvx-source",
        "tokenizer": d.tokenizer,
        "eod_id": data.tokenizer.eod_id,
        "vocab_size": cfg.model.vocab_size,
        **body,
        "val": val,
    }


def _write_if_changed(path: Path, text: str) -> None:
    # Every rank of a multi-process run opens the data; they all write the same text.
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    atomic_write_text(path, text)


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
    claim_dir(run_dir, RUN_MARKER)  # the runner checked it is ours (runner.claim_run)
    if data.data_dir.resolve() != run_dir.resolve():
        target = run_dir / "tokenizer.json"
        if not target.exists() or target.resolve() != (data.data_dir / "tokenizer.json").resolve():
            if any(checkpoints_dir(run_dir).glob("step_*")):
                check_same_tokenizer(run_dir, data.data_dir)  # a trained run keeps its tokenizer
            atomic_write_bytes(target, (data.data_dir / "tokenizer.json").read_bytes())
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def check_same_tokenizer(run_dir: Path, data_dir: Path) -> None:
    """Refuse data tokenized otherwise than the run (its <run>/tokenizer.json): every loss and bits
    per byte figure would be silently wrong."""
    ours, theirs = Path(run_dir) / "tokenizer.json", Path(data_dir) / "tokenizer.json"
    if not ours.is_file() or not theirs.is_file() or ours.resolve() == theirs.resolve():
        return
    if hashlib.sha256(ours.read_bytes()).digest() != hashlib.sha256(theirs.read_bytes()).digest():
        raise DataError(
            f"the tokenizer of {data_dir} ({theirs}) differs from the one the run was trained with ({ours}); "
            "use data tokenized with the run's tokenizer"
        )


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
