"""Where each file of a run directory is. The paths are built here only.

    <run>/config.yaml        the resolved config
    <run>/tokenizer.json     the tokenizer the run trains with
    <run>/data/              prepared tokens (unless data.prepared_dir or a prepared data.corpus says otherwise)
    <run>/checkpoints/       step_NNNNNNNN/ checkpoints (checkpoints/store.py)
    <run>/metrics.jsonl      one line per step (train/metrics.py)
    <run>/loss.png           the loss curves of a finished run
    <run>/.rwkvx-run         the marker that makes the directory rwkvx's (fsio.py)
    <run>/.rwkvx-lock        the one-writer lock (runs/lock.py)
"""

from __future__ import annotations

import glob
from pathlib import Path

from rwkvx_cli.config import Config

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"


def config_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / CONFIG_FILE


def tokenizer_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / TOKENIZER_FILE


def checkpoints_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def metrics_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / "metrics.jsonl"


def loss_plot_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / "loss.png"


def run_dir_of(checkpoint: Path | str) -> Path:
    """The run directory of a checkpoint directory (<run>/checkpoints/step_...)."""
    return Path(checkpoint).parent.parent


def is_prepared(path: Path) -> bool:
    """A directory `rwkvx data prepare` finished (meta.json is written last)."""
    return path.is_dir() and (path / "meta.json").is_file()


def prepared_corpus(cfg: Config) -> list[Path]:
    """The prepared directories data.corpus names (directories or globs of them, in that order, each
    holding meta.json: the shards of one prepare, or several prepares of one tokenizer), or [] when it
    names anything to prepare (files, a corpus folder) or the data comes from data.binidx / data.mix."""
    if cfg.data.binidx or cfg.data.mix is not None:
        return []
    dirs: list[Path] = []
    for item in cfg.data.corpus:
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not matches:
            return []
        dirs += [Path(m) for m in matches]
    return dirs if dirs and all(is_prepared(d) for d in dirs) else []


def data_dir_for(cfg: Config, run_dir: Path) -> Path:
    """Where a run's prepared tokens (or, for data.binidx / data.mix, its tokenizer.json and
    source.json) are: the corpus itself when it is prepared (the first of its prepared directories;
    any other directory is a corpus folder to prepare), else data.prepared_dir, else <run>/data.
    Training and every command that reads a checkpoint use this rule."""
    prepared = prepared_corpus(cfg)
    if prepared:
        return prepared[0]  # already prepared
    return Path(cfg.data.prepared_dir) if cfg.data.prepared_dir else Path(run_dir) / "data"
