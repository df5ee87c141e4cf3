"""Operators. Importing this package registers every op (see registry.py)."""

from rwkvx_cli.ops import moba as _moba_package  # noqa: F401  (registers "moba")
from rwkvx_cli.ops import wkv7 as _wkv7_package  # noqa: F401  (registers "wkv7")
from rwkvx_cli.ops.moba import moba
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, get_op, op_names, resolve_backend
from rwkvx_cli.ops.wkv7 import wkv7

__all__ = ["Backend", "Case", "OpSpec", "get_op", "moba", "op_names", "resolve_backend", "wkv7"]
