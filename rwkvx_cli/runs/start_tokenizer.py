"""train.init_from's tokenizer against the run's: an embedding row is a token id, so weights trained
with one tokenizer and run with another read every token as some other token. Where the weights
name their tokenizer, it must be the run's:

- an rwkvx run or checkpoint: the run's tokenizer.json (its data.tokenizer when the file is gone);
- an rwkvx safetensors export: its metadata's config (data.tokenizer: byte or world; a BPE one is
  named but not given: a run with byte or world is refused, any other cannot be told apart);
- an HF directory with tokenizer.json: that file (rwkvx's byte tokenizer in its HF form reads as byte).

RWKV-LM and RWKV-X `.pth` files, a bare `.safetensors` and an HF directory without tokenizer.json
name none: the rows are taken as the run's tokenizer's ids, and `init` says so (a note).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rwkvx_cli.config import Config
from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.formats.errors import FormatError

UNKNOWN_BPE = "bpe (trained on its own corpus; not in the file)"


def _identity(tokenizer) -> str:
    kind = getattr(tokenizer, "kind", "")
    if kind in ("byte", "world"):
        return kind
    digest = hashlib.sha256(tokenizer.to_json().encode("utf-8")).hexdigest()[:12]
    return f"a tokenizer.json (sha256 {digest}, {tokenizer.vocab_size} tokens)"


def _file_identity(path: Path) -> str | None:
    """The identity of a tokenizer file (rwkvx's byte / World JSON, an HF tokenizer.json, rwkvx's byte
    tokenizer in its HF form), or None when it cannot be read as one."""
    from rwkvx_cli.data import load_tokenizer
    from rwkvx_cli.formats.tokenizer_files import byte_tokenizer_json

    try:
        text = path.read_text(encoding="utf-8")
        if json.loads(text) == json.loads(byte_tokenizer_json()):
            return "byte"
        return _identity(load_tokenizer(path))
    except (RwkvxError, OSError, ValueError, RecursionError):
        return None


def source_tokenizer(path: Path) -> str | None:
    """The tokenizer the weights at `path` name (an identity string), or None."""
    from rwkvx_cli.runs.layout import TOKENIZER_FILE

    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():  # HF
        file = path / "tokenizer.json"
        return _file_identity(file) if file.is_file() else None
    if path.is_dir():
        from rwkvx_cli.runs.opening import find_checkpoint

        try:
            ckpt = find_checkpoint(path)
        except RwkvxError:
            return None  # not an rwkvx run (a bare model.safetensors): its reader says what it is
        file = ckpt.run_dir / TOKENIZER_FILE
        found = _file_identity(file) if file.is_file() else None
        return found or _named(ckpt.config.data.tokenizer)
    if path.suffix == ".safetensors":
        from rwkvx_cli.formats.tensors import SafetensorsFiles

        try:
            with SafetensorsFiles([path]) as source:
                config = json.loads(source.metadata.get("rwkvx_config", "null"))
            return _named(config["data"]["tokenizer"])
        except (RwkvxError, ValueError, RecursionError, KeyError, TypeError):
            return None
    return None


def _named(name: object) -> str | None:
    if name in ("byte", "world"):
        return name
    return UNKNOWN_BPE if name == "bpe" else None


def run_tokenizer_identity(cfg: Config) -> str | None:
    """The run's tokenizer: byte, world, a tokenizer.json's identity; "bpe" for one this run trains."""
    name = cfg.data.tokenizer
    if name in ("byte", "world", "bpe"):
        return name
    return _file_identity(Path(name))


def check_start_tokenizer(cfg: Config, notes: list[str], weights: Path | None = None) -> None:
    """Refuse weights whose tokenizer is not the run's (FormatError), or note that they name none.
    `weights`: where they are read (default train.init_from; runs/initial.py passes the checkpoint of a run)."""
    source = cfg.train.init_from
    theirs, ours = source_tokenizer(Path(weights or source)), run_tokenizer_identity(cfg)
    if theirs is None:
        notes.append(
            f"the weights name no tokenizer: their embedding rows are read as ids of this run's "
            f"(data.tokenizer: {cfg.data.tokenizer})"
        )
        return
    if ours is None or theirs == ours or (theirs == UNKNOWN_BPE and ours not in ("byte", "world")):
        return  # the same, or one rwkvx cannot tell apart (a BPE file against a BPE not in the weights)
    said = "a BPE tokenizer this run would train on its corpus" if ours == "bpe" else ours
    raise FormatError(
        f"train.init_from {source}: its weights were trained with the {theirs} tokenizer, but this run's "
        f"data.tokenizer is {said}: every embedding row would mean another token; set data.tokenizer to "
        "the weights' own (their tokenizer.json)"
    )
