"""Explain a model's prediction: layer-wise relevance propagation (LRP) for RWKV-4 and RWKV-7
(docs/explain.md). `explain_checkpoint` / `explain_tokens` return an `ExplainResult`; `render`
turns one into a terminal table, JSON, an HTML page or a PNG."""

from rwkvx_cli.explain.lrp import (
    Attribution,
    ExplainResult,
    LayerRelevance,
    explain_checkpoint,
    explain_tokens,
    lrp,
)
from rwkvx_cli.explain.rules import SUPPORTED_KINDS, UnsupportedModelError

__all__ = [
    "SUPPORTED_KINDS",
    "Attribution",
    "ExplainResult",
    "LayerRelevance",
    "UnsupportedModelError",
    "explain_checkpoint",
    "explain_tokens",
    "lrp",
]
