"""The data layer: tokenizers, token files (binidx, raw), corpus preparation and batch sampling."""

from rwkvx_cli.data.binidx import BinIdx, RawTokens, dtype_for_vocab, open_tokens, write_binidx
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.prepare import PrepareStats, prepare
from rwkvx_cli.data.sampler import StreamSampler, WindowSampler, sequential_windows
from rwkvx_cli.data.tokenizer import (
    EOD_ID,
    EOD_TOKEN,
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "EOD_ID",
    "EOD_TOKEN",
    "BPETokenizer",
    "BinIdx",
    "ByteTokenizer",
    "DataError",
    "PrepareStats",
    "RawTokens",
    "StreamSampler",
    "WindowSampler",
    "dtype_for_vocab",
    "load_tokenizer",
    "open_tokens",
    "prepare",
    "sequential_windows",
    "train_tokenizer",
    "write_binidx",
]
