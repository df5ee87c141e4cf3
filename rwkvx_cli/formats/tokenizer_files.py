"""A run's tokenizer as Hugging Face tokenizer files (`tokenizer.json` for the `tokenizers` library,
`tokenizer_config.json` for transformers' `PreTrainedTokenizerFast`), where a standard form exists.

- bpe: rwkvx's BPE tokenizers are `tokenizers` JSON already; written as they are. Two differences
  from rwkvx's own encoding, both only for unusual text: rwkvx encodes runs of more than 1024
  characters in parts (data/tokenizer.py, MAX_RUN), and treats a special token's spelling inside a
  document as text, where transformers' default is to parse it as the special token.
- byte: rwkvx's byte tokenizer (id 0 = `<|eod|>`, byte b = id b + 1) is not a `tokenizers` file;
  the same map is built as one: a byte-level BPE whose vocabulary is `<|eod|>` then the 256 byte
  symbols, with no merges. The tests check it encodes and decodes as rwkvx does.
- world: none. The RWKV World tokenizer is a greedy longest match over a byte trie, which no
  `tokenizers` model reproduces; its HF repositories ship it as remote code (a Python tokenizer
  class beside the vocabulary) that rwkvx does not write.
"""

from __future__ import annotations

import json

from rwkvx_cli.data.tokenizer import EOD_TOKEN, BPETokenizer, ByteTokenizer
from rwkvx_cli.data.world import WorldTokenizer

WORLD_NOTE = "none: the World tokenizer has no standard HF form (its HF repositories ship remote code)"


def byte_tokenizer_json() -> str:
    """rwkvx's byte tokenizer as a `tokenizers` JSON string."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_of = _byte_level_map()
    vocab = {EOD_TOKEN: 0, **{byte_of[b]: b + 1 for b in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    return tok.to_str()


def _byte_level_map() -> dict[int, str]:
    """GPT-2's byte -> printable character map that `tokenizers`' ByteLevel uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tokenizer_config(eod_token: str) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eod_token,
        "eos_token": eod_token,
        "model_max_length": 1_000_000_000,  # a recurrent model has no context limit
        "clean_up_tokenization_spaces": False,
    }


def hf_tokenizer_files(tokenizer) -> tuple[dict[str, str], str]:
    """({file name: text}, what was written) for an rwkvx tokenizer (None: no files)."""
    if tokenizer is None:
        return {}, "none: no tokenizer given"
    if isinstance(tokenizer, WorldTokenizer):
        return {}, WORLD_NOTE
    if isinstance(tokenizer, ByteTokenizer):
        body, eod, kind = byte_tokenizer_json(), EOD_TOKEN, "byte"
    elif isinstance(tokenizer, BPETokenizer):
        body, eod, kind = tokenizer.to_json(), tokenizer.eod_token, "bpe"
    else:
        return {}, f"none: no HF form for {type(tokenizer).__name__}"
    files = {"tokenizer.json": body, "tokenizer_config.json": json.dumps(tokenizer_config(eod), indent=2) + "\n"}
    return files, f"tokenizer.json ({kind})"
