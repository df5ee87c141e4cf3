from rwkvx_cli.models.model import (
    LM,
    Block,
    block_kinds,
    build_model,
    document_starts,
    init_weights,
    layer_kinds,
    parameter_groups,
)

__all__ = [
    "LM",
    "Block",
    "block_kinds",
    "build_model",
    "document_starts",
    "init_weights",
    "layer_kinds",
    "parameter_groups",
]
