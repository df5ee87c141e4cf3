"""A run's data: prepared once from data.corpus (rank 0 tokenizes, the others open it), a bare
binidx prefix (data.binidx) or a mixture (data.mix), opened with the vocabulary checked and at
least one window per split. A prepared split's loss mask (data/masks.py) comes with it as its
`.mask` (None: every target carries loss). Where the files are: runs/layout.py."""

from __future__ import annotations

import contextlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rwkvx_cli.config import Config, ConfigError
from rwkvx_cli.data import PrepareStats, TokenChain, expand_inputs, open_prepared, open_tokens, prepare
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.prepare import read_prepared_meta
from rwkvx_cli.data.prepared import open_split, same_template, template_of
from rwkvx_cli.data.template import load_template
from rwkvx_cli.fsio import atomic_write_text
from rwkvx_cli.runs.layout import TOKENIZER_FILE, data_dir_for, is_prepared, prepared_corpus
from rwkvx_cli.runs.tokenizers import dir_tokenizer, named_tokenizer


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

    @property
    def mask(self) -> list | None:
        """Each source's loss mask (None for one without), or None when no source has one."""
        masks = [getattr(s, "mask", None) for s in self.sources]
        return None if all(m is None for m in masks) else masks


# Written beside a bare prefix's or a mixture's tokenizer.json: what the run trains and validates on.
SOURCE_FILE = "source.json"


def split_seed(cfg: Config) -> int:
    """The seed that chooses the held-out documents: data.split_seed, else train.seed."""
    return cfg.train.seed if cfg.data.split_seed is None else cfg.data.split_seed


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
    args += ["--val-fraction", f"{d.val_fraction:g}", "--seed", str(split_seed(cfg))]
    if d.template != "g1":
        args += ["--template", d.template]
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
            seed=split_seed(cfg),
            progress=progress,
            eod_id=None if named else cfg.data.eod_id,
            template=cfg.data.template,
        )
    elif not (cfg.data.binidx or cfg.data.mix is not None or prepared_corpus(cfg)):
        check_prepared_as_asked(cfg, data_dir_for(cfg, run_dir))
    data = open_data(cfg, run_dir)
    data.prepared = stats
    if cfg.data.binidx or cfg.data.mix is not None:
        _write_if_changed(data.data_dir / TOKENIZER_FILE, data.tokenizer.to_json())
        _write_if_changed(data.data_dir / SOURCE_FILE, json.dumps(_source_meta(cfg, data), indent=2) + "\n")
    return data


def check_prepared_as_asked(cfg: Config, ddir: Path) -> None:
    """A directory training would prepare into (data.prepared_dir, <run>/data) that already holds
    prepared data must hold what the config asks for: the same tokenizer, corpus files (and sizes),
    validation share and seed, as its meta.json records them; else a one-line refusal, never
    training on other data silently."""
    try:
        meta = json.loads((ddir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return  # unreadable: open_data refuses it with its own reason
    if not isinstance(meta, dict) or "shard" in meta:
        return
    d = cfg.data
    named = d.tokenizer in ("byte", "world", "bpe")
    tok = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else {}
    asked = {
        "tokenizer": d.tokenizer if named else "file",
        "tokenizer file": None if named else str(Path(d.tokenizer).resolve()),
        "val_fraction": d.val_fraction,
        "seed": split_seed(cfg),
    }
    found = {"tokenizer": tok.get("kind"), "tokenizer file": tok.get("source")}
    found |= {"val_fraction": meta.get("val_fraction"), "seed": meta.get("seed")}
    if d.tokenizer == "bpe":
        asked["BPE vocabulary"], found["BPE vocabulary"] = d.bpe_vocab_size, meta.get("vocab_size")
    if not named:
        asked["data.eod_id"], found["data.eod_id"] = d.eod_id, tok.get("eod_id")
    sources = meta.get("sources")
    if isinstance(sources, list):
        inputs = expand_inputs([Path(p) for p in d.corpus])
        asked["corpus"] = [(str(p.resolve()), p.stat().st_size) for p in inputs]
        found["corpus"] = [(s.get("path"), s.get("bytes")) for s in sources if isinstance(s, dict)]
    template = template_of(meta)
    if template is not None:  # rendered conversations: the same template (one without masks holds documents only)
        asked["template"] = load_template(d.template).sha256
        found["template"] = template.get("sha256")
    for what, want in asked.items():
        if what in found and found[what] is not None and found[what] != want:
            have = found[what]
            if what == "corpus":
                have, want = _files(have), _files(want)
            if what == "template":
                have, want = template.get("name"), d.template
            if what == "seed":  # the seed that chose the held-out documents, not the run's own
                what = "split seed"
                fix = f"set data.split_seed={have} to train on that split with any train.seed, point data.prepared_dir"
                fix += " elsewhere,"
            else:
                fix = "point data.prepared_dir elsewhere,"
            raise DataError(
                f"{ddir} was prepared with {what} {have}, but the config asks for {want}; {fix} "
                f"or remove {ddir} to prepare it again"
            )


def _files(listing: list) -> str:
    shown = ", ".join(f"{Path(p).name} ({b:,} bytes)" for p, b in listing[:3])
    return shown + (f" (+{len(listing) - 3} more)" if len(listing) > 3 else "")


def open_data(cfg: Config, run_dir: Path, data_dir: Path | None = None, check_train: bool = True) -> RunData:
    """Open a run's data as it is, without preparing anything: the prepared directory (`data_dir`,
    default `data_dir_for`), the bare prefix data.binidx, or the mixture data.mix. Token ids are
    checked against the vocabulary (and a prepared directory's files against its meta.json), and
    each split must hold one window of train.ctx_len + 1
    (only the validation split's when not `check_train`: evaluation reads nothing else)."""
    d = cfg.data
    shards = prepared_corpus(cfg) if data_dir is None else []
    prepared = data_dir is not None or not (d.binidx or d.mix is not None)
    if len(shards) > 1:  # several prepared directories read as one corpus, nothing copied
        corpus = open_prepared(shards)
        ddir, tokenizer, prepared = shards[0], corpus.tokenizer, False  # each meta.json checked by open_prepared
        train, val = TokenChain(corpus.train_tokens), corpus.val
        if corpus.masked:
            train.mask, val.mask = TokenChain(corpus.train_masks), corpus.val_mask
        where = f"{len(shards)} prepared directories, {shards[0]} ..."
        splits = [("training", where, train), ("validation", where, val)]
    elif prepared:
        ddir = data_dir if data_dir is not None else data_dir_for(cfg, run_dir)
        tokenizer = dir_tokenizer(ddir)
        train, val = _open_prepared_split(ddir, "train"), _open_prepared_split(ddir, "val")
        splits = [("training", ddir, train), ("validation", ddir, val)]
    elif d.binidx:
        ddir = data_dir_for(cfg, run_dir)
        tokenizer = named_tokenizer(cfg)
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
    if prepared and (ddir / "meta.json").is_file():  # a damaged or edited one is refused rather than read
        read_prepared_meta(ddir, tokenizer.vocab_size)
    _check_val_mask(val, cfg.train.eval_tokens)
    return RunData(train, val, tokenizer, ddir, None)


def _check_val_mask(val, eval_tokens: int) -> None:
    """Validation averages over the targets that carry loss among the first train.eval_tokens: there
    must be one."""
    mask = getattr(val, "mask", None)
    if mask is not None and not np.count_nonzero(np.asarray(mask[1 : eval_tokens + 1])):
        raise DataError(
            f"no target among the first {min(eval_tokens, len(mask) - 1):,} validation tokens carries loss (the "
            "split's loss masks): validation would average over none; raise train.eval_tokens"
        )


def _meta_of(ddir: Path) -> dict:
    """A prepared directory's meta.json as it is ({} when missing or damaged: read_prepared_meta says which)."""
    try:
        meta = json.loads((ddir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _open_prepared_split(ddir: Path, split: str):
    """A prepared directory's split with its loss mask when its meta.json records masks (checked by
    read_prepared_meta afterwards); a directory without meta.json is read as binidx files alone."""
    meta = _meta_of(ddir)
    if "mask" in meta and isinstance(meta.get(split), dict):
        return open_split(ddir, split, meta)
    return open_tokens(ddir / f"{split}.bin")


def _check_vocab(splits, cfg: Config, tokenizer) -> None:
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
        )
    for _, split in splits:
        if not isinstance(split, TokenSpan):  # a span's whole file is checked
            split.check_vocab(min(cfg.model.vocab_size, tokenizer.vocab_size))


def _open_mix(cfg: Config):
    """(train Mixture, validation split, tokenizer, splits to check) of data.mix."""
    d = cfg.data
    sources, splits, dirs = [], [], []
    for i, src in enumerate(d.mix):
        path = Path(src.path)
        if path.is_dir():
            if not is_prepared(path):
                raise DataError(
                    f"data.mix[{i}]: {path} is a directory without meta.json, not a prepared dataset; "
                    f"prepare it first with `rwkvx data prepare FILES --out {path}`"
                )
            split = _open_prepared_split(path, "train")
            dirs.append(path)
        else:
            split = open_tokens(path)
        sources.append(split)
        if src.weight > 0:
            splits.append(("training", f"data.mix[{i}] {path}", split))
    if dirs:
        tokenizer = dir_tokenizer(dirs[0])
        for other in dirs[1:]:
            if (other / "tokenizer.json").read_bytes() != (dirs[0] / "tokenizer.json").read_bytes():
                raise DataError(f"data.mix: {dirs[0]} and {other} were prepared with different tokenizers")
        same_template(dirs, [_meta_of(p) for p in dirs])
    else:
        tokenizer = named_tokenizer(cfg)
    if d.val_binidx:
        val, where = open_tokens(d.val_binidx), d.val_binidx
    elif dirs:
        val, where = _open_prepared_split(dirs[0], "val"), dirs[0]
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
