"""The tokenizer of a run: the one its data was prepared with, found the same way by every
command that reads a checkpoint (eval, eval --tasks, explain, export) and by training."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rwkvx_cli.config import Config, ConfigError
from rwkvx_cli.data import load_tokenizer
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.errors import UsageError
from rwkvx_cli.runs.layout import TOKENIZER_FILE, data_dir_for


def dir_tokenizer(ddir: Path):
    """A prepared directory's tokenizer, with the end-of-document id it was prepared with."""
    eod_id = None
    try:
        meta = json.loads((Path(ddir) / "meta.json").read_text())
        eod_id = meta["tokenizer"]["eod_id"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass  # an older meta.json: the default id
    return load_tokenizer(Path(ddir) / TOKENIZER_FILE, eod_id=eod_id if isinstance(eod_id, int) else None)


def named_tokenizer(cfg: Config):
    """data.tokenizer for tokens that came without one: byte, world or a tokenizer.json path."""
    name = cfg.data.tokenizer
    if name in ("byte", "world"):
        return load_tokenizer(name)
    if not Path(name).is_file():
        raise ConfigError(
            f"data.tokenizer: {name!r} is not a tokenizer name (byte, world) nor a tokenizer.json file"
        )
    return load_tokenizer(name, eod_id=cfg.data.eod_id)


def run_tokenizer(cfg: Config, run_dir: Path, data_dir: Path | None = None):
    """The tokenizer a run was trained with: `tokenizer.json` of its data directory (`data_dir`, by
    default where the run's data is: layout.data_dir_for), checked to be the run's own, else the
    one data.tokenizer names (byte, world, a tokenizer.json path; a BPE one is only in files)."""
    ddir = Path(data_dir) if data_dir is not None else data_dir_for(cfg, run_dir)
    if (ddir / TOKENIZER_FILE).is_file():
        check_same_tokenizer(run_dir, ddir)
        tokenizer = dir_tokenizer(ddir)
    elif data_dir is None and cfg.data.tokenizer != "bpe":
        tokenizer = named_tokenizer(cfg)
    else:
        raise UsageError(f"no tokenizer.json in {ddir}: pass the run's prepared data directory with --data")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UsageError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.model.vocab_size}: "
            "not this run's tokenizer"
        )
    return tokenizer


def check_same_tokenizer(run_dir: Path, data_dir: Path) -> None:
    """Refuse data tokenized otherwise than the run (its <run>/tokenizer.json): every loss and bits
    per byte figure would be silently wrong."""
    ours, theirs = Path(run_dir) / TOKENIZER_FILE, Path(data_dir) / TOKENIZER_FILE
    if not ours.is_file() or not theirs.is_file() or ours.resolve() == theirs.resolve():
        return
    if hashlib.sha256(ours.read_bytes()).digest() != hashlib.sha256(theirs.read_bytes()).digest():
        raise DataError(
            f"the tokenizer of {data_dir} ({theirs}) differs from the one the run was trained with ({ours}); "
            "use data tokenized with the run's tokenizer"
        )
