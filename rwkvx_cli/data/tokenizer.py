"""Tokenizers: bytes (vocab 257), RWKV World (vocab 65536, `world.py`) and HuggingFace `tokenizers` (BPE trained
here with `<|eod|>` at id 0, or any `tokenizer.json` with a chosen end-of-document id).

All share one interface: `kind`, `vocab_size`, `eod_id`, `encode(str) -> list[int]`, `encode_arrays(list[str]) ->
list[np.ndarray]` (the fast path `prepare` uses), `decode(ids) -> str` (invalid UTF-8 replaced, the end-of-document
id skipped) and `save(path)`; `load_tokenizer(path_or_name)` returns the right class from a saved file or a name.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from rwkvx_cli.config import MAX_VOCAB, MIN_BPE_VOCAB
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.world import WorldTokenizer
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import atomic_write_text

EOD_TOKEN = "<|eod|>"
EOD_ID = 0


class ByteTokenizer:
    """id 0 = `<|eod|>`, UTF-8 byte b = id b + 1."""

    kind = "byte"
    vocab_size = 257
    eod_id = EOD_ID

    def encode(self, text: str) -> list[int]:
        return self.encode_arrays([text])[0].tolist()

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) + 1 for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 256):
            bad = int(arr[(arr < 0) | (arr > 256)][0])
            raise DataError(f"token id {bad} is outside the byte vocabulary (0..256)")
        return (arr[arr != EOD_ID] - 1).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"type": "byte", "vocab_size": self.vocab_size, "eod_token": EOD_TOKEN, "eod_id": EOD_ID})

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ByteTokenizer:
        obj = _read_json(Path(path))
        if obj.get("type") != "byte":
            raise DataError(f"{path} is not a byte tokenizer file")
        return cls()

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257)"


def check_bpe_vocab_size(vocab_size) -> None:
    """A BPE vocabulary size to train: an integer from MIN_BPE_VOCAB to MAX_VOCAB, else a UsageError."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not (
        MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB
    ):
        raise UsageError(
            f"BPE vocab_size must be an integer at least {MIN_BPE_VOCAB} (256 bytes + {EOD_TOKEN}) and at most "
            f"{MAX_VOCAB:,} (int32 ids), got {vocab_size!r}"
        )


class BPETokenizer:
    """A HuggingFace `tokenizers` tokenizer whose `eod_id` (default 0) is a special end-of-document token.

    Trained here it is `<|eod|>`; a loaded `tokenizer.json` may spell it otherwise (GPT-NeoX 20B's `<|endoftext|>`).
    Runs of more than MAX_RUN characters without (or of only) whitespace are encoded in MAX_RUN-character parts, both
    when training and encoding: BPE training over one pre-token is quadratic in its length (256 KiB: minutes).
    """

    kind = "bpe"

    def __init__(self, tokenizer, source: str | None = None, eod_id: int = EOD_ID):
        where = source or "the tokenizer"
        _check_eod_id(eod_id)
        named = tokenizer.token_to_id(EOD_TOKEN)
        if named is not None and named != eod_id:
            raise DataError(
                f"{where}: id {eod_id} must be the end-of-document token {EOD_TOKEN!r}, but it has it at id {named}"
            )
        token = tokenizer.id_to_token(eod_id)
        if token is None:
            raise DataError(f"{where}: no token has the end-of-document id {eod_id}")
        added = tokenizer.get_added_tokens_decoder().get(eod_id)
        if added is None or not added.special:
            raise DataError(
                f"{where}: id {eod_id} is {token!r}, an ordinary token, not a special end-of-document token "
                "(set eod_id to the id of one)"
            )
        if re.sub(r"^[<\[|▁]+|[>\]|]+$", "", token).lower() in _NOT_EOD:
            raise DataError(
                f"{where}: id {eod_id} is the special token {token!r}, which is not an end-of-document token "
                f"(set eod_id to the id of one, or give the tokenizer {EOD_TOKEN!r})"
            )
        # Special tokens written inside a document stay text; only prepare inserts eod_id.
        tokenizer.encode_special_tokens = True
        self._tok = tokenizer
        self.source = source
        self.eod_id = eod_id
        self.eod_token = token

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Byte-level BPE with `vocab_size` entries (fewer if the text runs out of merges); offline."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        check_bpe_vocab_size(vocab_size)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOD_TOKEN], initial_alphabet=alphabet, show_progress=False
        )
        tok.train_from_iterator((part for t in texts for part in bound_runs(t)), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eod_id: int = EOD_ID) -> BPETokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        text = _read_text(path)
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception for a malformed file
            raise DataError(f"cannot load tokenizer {path}: {str(e).splitlines()[0] if str(e) else e!r}") from None
        return cls(tok, source=str(path), eod_id=eod_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.encode_arrays([text])[0].tolist()

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        parts, owner = [], []
        for k, t in enumerate(texts):
            split = bound_runs(t)
            parts += split
            owner += [k] * len(split)
        # encode_batch_fast (tokenizers >= 0.20) skips computing offsets; both run on all cores.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        ids = [np.asarray(e.ids, dtype=np.int64) for e in encode(parts, add_special_tokens=False)]
        if len(parts) == len(texts):
            return ids
        out: list[list[np.ndarray]] = [[] for _ in texts]
        for k, a in zip(owner, ids, strict=True):
            out[k].append(a)
        return [a[0] if len(a) == 1 else np.concatenate(a) for a in out]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_json(self) -> str:
        return self._tok.to_str()

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json())

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


Tokenizer = ByteTokenizer | BPETokenizer | WorldTokenizer
NAMES = ("byte", "world")  # tokenizers that load_tokenizer knows by name

# Special tokens whose name says they are not an end of document (`<pad>`, `[UNK]`, `<|padding|>`, `<s>`, ...).
_NOT_EOD = {"pad", "padding", "unk", "unknown", "mask", "cls", "s", "bos", "startoftext", "begin_of_text"}
MAX_RUN = 1024


@functools.lru_cache(maxsize=4)
def _long_runs(max_run: int) -> re.Pattern:
    # Each alternative starts only where its run starts, so the scan is linear.
    return re.compile(rf"(?<!\S)\S{{{max_run + 1},}}|(?<!\s)\s{{{max_run + 1},}}")


def bound_runs(text: str, max_run: int = MAX_RUN) -> list[str]:
    """`text` cut inside every run of more than `max_run` non-whitespace (or whitespace) characters, so that no
    pre-token is longer than `max_run` characters; `[text]` when there is no such run (almost always)."""
    if not _may_have_long_run(text, max_run):
        return [text]
    cuts = [c for m in _long_runs(max_run).finditer(text) for c in range(m.start() + max_run, m.end(), max_run)]
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _may_have_long_run(text: str, max_run: int) -> bool:
    """False when `text` surely has no run of more than `max_run` whitespace or non-whitespace characters: such a run
    holds a whole aligned block of (max_run + 1) // 2 characters, all whitespace or none. A scan of those blocks,
    each ended at its first change, costs a tenth of the regex over every character (which finds the runs)."""
    step = (max_run + 1) // 2
    if len(text) <= max_run or step < 1:
        return len(text) > max_run
    for a in range(0, len(text) - step + 1, step):
        block = text[a : a + step]
        if block.isspace():
            return True
        first = block.split(None, 1)  # up to the first whitespace: one part, as long as the block, when there is none
        if len(first) == 1 and len(first[0]) == step:
            return True
    return False


def _check_eod_id(eod_id) -> None:
    if isinstance(eod_id, bool) or not isinstance(eod_id, int) or eod_id < 0:
        raise UsageError(f"eod_id must be a token id (an integer >= 0), got {eod_id!r}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"tokenizer file not found: {path}") from None
    except UnicodeDecodeError:
        raise DataError(f"tokenizer file {path} is not UTF-8 text") from None
    except OSError as e:
        raise DataError(f"cannot read tokenizer file {path}: {e.strerror}") from None


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise DataError(f"tokenizer file {path} is not valid JSON ({e})") from None
    except RecursionError:
        raise DataError(f"tokenizer file {path} is not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise DataError(f"tokenizer file {path} is not a JSON object")
    return obj


def load_tokenizer(path_or_name: str | os.PathLike, eod_id: int | None = None) -> Tokenizer:
    """A tokenizer by name (`byte`, `world`) or from a saved file: our byte/World JSON, or any HuggingFace
    `tokenizer.json` whose `eod_id` (default 0) is a special end-of-document token. `eod_id` other than 0 is only
    for HuggingFace files (byte and World fix it at 0)."""
    if eod_id is not None:
        _check_eod_id(eod_id)
    if isinstance(path_or_name, str) and path_or_name in NAMES:
        obj, where = {"type": path_or_name}, path_or_name
    else:
        path = Path(path_or_name)
        obj, where = _read_json(path), str(path)
        if "model" in obj and "type" not in obj:
            return BPETokenizer.from_file(path, eod_id=EOD_ID if eod_id is None else eod_id)
    kind = obj.get("type")
    if kind not in NAMES:
        raise DataError(f"{where} is neither a byte tokenizer file nor a HuggingFace tokenizer.json (nor a World one)")
    if eod_id not in (None, EOD_ID):
        raise UsageError(f"the {kind} tokenizer's end-of-document id is {EOD_ID}, not {eod_id}")
    return ByteTokenizer() if kind == "byte" else WorldTokenizer.from_json(obj, where)


def train_tokenizer(
    kind: str, files: Iterable[str | os.PathLike], vocab_size: int | None = None, **read_options
) -> Tokenizer:
    """`byte` (fixed vocab 257), `world` (fixed vocab 65536), or `bpe` trained on the documents of `files` (read
    as `prepare` reads them; `read_options` are `iter_pieces`'s, e.g. text_field)."""
    if kind in NAMES:
        fixed = ByteTokenizer.vocab_size if kind == "byte" else WorldTokenizer.vocab_size
        if vocab_size not in (None, fixed):
            raise UsageError(f"the {kind} tokenizer has a fixed vocab_size of {fixed}, got {vocab_size}")
        return ByteTokenizer() if kind == "byte" else WorldTokenizer()
    if kind == "bpe":
        if vocab_size is None:
            raise UsageError("a BPE tokenizer needs a vocab_size")
        from rwkvx_cli.data.corpus import iter_pieces

        texts = (p.text for f in files for p in iter_pieces(Path(f), **read_options) if p.text)
        return BPETokenizer.train(texts, vocab_size)
    raise UsageError(f"unknown tokenizer kind {kind!r} (byte, bpe, world, or the path of a tokenizer.json)")
