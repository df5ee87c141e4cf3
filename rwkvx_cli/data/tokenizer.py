"""Tokenizers: bytes (vocab 257) and byte-level BPE (HuggingFace `tokenizers`). Id 0 is always `<|eod|>`.

Both share one interface: `vocab_size`, `eod_id`, `encode(str) -> list[int]`, `encode_arrays(list[str]) ->
list[np.ndarray]` (the fast path `prepare` uses), `decode(ids) -> str` (invalid UTF-8 replaced, `<|eod|>` skipped)
and `save(path)`; `load_tokenizer(path)` returns the right class from a saved file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from rwkvx_cli.data.errors import DataError
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


class BPETokenizer:
    """A HuggingFace `tokenizers` tokenizer whose id 0 is the special token `<|eod|>`."""

    kind = "bpe"
    eod_id = EOD_ID

    def __init__(self, tokenizer, source: str | None = None):
        eod = tokenizer.token_to_id(EOD_TOKEN)
        where = source or "the tokenizer"
        if eod != EOD_ID:
            found = "it has no such token" if eod is None else f"it has it at id {eod}"
            raise DataError(f"{where}: id 0 must be the end-of-document token {EOD_TOKEN!r}, but {found}")
        added = tokenizer.get_added_tokens_decoder().get(EOD_ID)
        if added is None or not added.special:
            raise DataError(f"{where}: {EOD_TOKEN!r} (id 0) must be a special token")
        # The literal text "<|eod|>" inside a document stays text; only prepare inserts id 0.
        tokenizer.encode_special_tokens = True
        self._tok = tokenizer
        self.source = source

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Byte-level BPE with `vocab_size` entries (fewer if the text runs out of merges); offline."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + 1:
            raise UsageError(
                f"BPE vocab_size must be at least {len(alphabet) + 1} (256 bytes + {EOD_TOKEN}), got {vocab_size}"
            )
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOD_TOKEN], initial_alphabet=alphabet, show_progress=False
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> BPETokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        text = _read_text(path)
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception for a malformed file
            raise DataError(f"cannot load tokenizer {path}: {str(e).splitlines()[0] if str(e) else e!r}") from None
        return cls(tok, source=str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.20) skips computing offsets.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encs = encode(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_json(self) -> str:
        return self._tok.to_str()

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json())

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


Tokenizer = ByteTokenizer | BPETokenizer


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
    if not isinstance(obj, dict):
        raise DataError(f"tokenizer file {path} is not a JSON object")
    return obj


def load_tokenizer(path: str | os.PathLike) -> ByteTokenizer | BPETokenizer:
    """A saved tokenizer: our byte JSON or any HuggingFace `tokenizer.json` with `<|eod|>` at id 0."""
    path = Path(path)
    obj = _read_json(path)
    if obj.get("type") == "byte":
        return ByteTokenizer()
    if "model" in obj:
        return BPETokenizer.from_file(path)
    raise DataError(f"{path} is neither a byte tokenizer file nor a HuggingFace tokenizer.json")


def train_tokenizer(
    kind: str, files: Iterable[str | os.PathLike], vocab_size: int | None = None
) -> ByteTokenizer | BPETokenizer:
    """`byte` (fixed vocab 257), or `bpe` trained on the documents of `files` (read as `prepare` reads them)."""
    if kind == "byte":
        if vocab_size not in (None, ByteTokenizer.vocab_size):
            raise UsageError(f"the byte tokenizer has a fixed vocab_size of 257, got {vocab_size}")
        return ByteTokenizer()
    if kind == "bpe":
        if vocab_size is None:
            raise UsageError("a BPE tokenizer needs a vocab_size")
        from rwkvx_cli.data.corpus import iter_pieces

        texts = (p.text for f in files for p in iter_pieces(Path(f)) if p.text)
        return BPETokenizer.train(texts, vocab_size)
    raise UsageError(f"unknown tokenizer kind {kind!r} (byte, bpe, or the path of a tokenizer.json)")
