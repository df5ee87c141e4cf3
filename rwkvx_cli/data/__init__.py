"""The data layer: tokenizers, token files (binidx, raw), corpus reading and preparation, and batch sampling.

The samplers (torch) are imported on first use: `prepare`'s worker processes import this package and need
neither torch's start-up time (1-2 s) nor its memory (~200 MB each).
"""

from rwkvx_cli.data.binidx import (
    BinIdx,
    BinIdxWriter,
    RawTokens,
    dtype_for_vocab,
    open_tokens,
    write_binidx,
)
from rwkvx_cli.data.corpus import SUPPORTED, expand_inputs, iter_pieces
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.prepare import PrepareProgress, PrepareStats, prepare
from rwkvx_cli.data.prepared import PreparedCorpus, TokenChain, open_prepared
from rwkvx_cli.data.tokenizer import (
    EOD_ID,
    EOD_TOKEN,
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    train_tokenizer,
)
from rwkvx_cli.data.world import WorldTokenizer

_SAMPLER_NAMES = ("EpochSampler", "MixtureSampler", "StreamSampler", "WindowSampler", "permute", "sequential_windows")


def __getattr__(name: str):
    if name in _SAMPLER_NAMES:
        from rwkvx_cli.data import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EOD_ID",
    "EOD_TOKEN",
    "SUPPORTED",
    "BPETokenizer",
    "BinIdx",
    "BinIdxWriter",
    "ByteTokenizer",
    "DataError",
    "EpochSampler",
    "MixtureSampler",
    "PrepareProgress",
    "PrepareStats",
    "PreparedCorpus",
    "RawTokens",
    "StreamSampler",
    "TokenChain",
    "WindowSampler",
    "WorldTokenizer",
    "dtype_for_vocab",
    "expand_inputs",
    "iter_pieces",
    "load_tokenizer",
    "open_prepared",
    "open_tokens",
    "permute",
    "prepare",
    "sequential_windows",
    "train_tokenizer",
    "write_binidx",
]
