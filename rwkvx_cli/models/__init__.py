from rwkvx_cli.models.model import LM, block_kinds, build_model, init_weights, parameter_groups

__all__ = ["LM", "block_kinds", "build_model", "init_weights", "parameter_groups"]
