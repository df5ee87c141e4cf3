"""Operators. Importing this package registers every op (see registry.py)."""

from rwkvx_cli.ops import gdn as _gdn_package  # noqa: F401  (registers "gdn")
from rwkvx_cli.ops import kda as _kda_package  # noqa: F401  (registers "kda")
from rwkvx_cli.ops import moba as _moba_package  # noqa: F401  (registers "moba")
from rwkvx_cli.ops import rwkv8 as _rwkv8_package  # noqa: F401  (registers "rwkv8")
from rwkvx_cli.ops import wkv4 as _wkv4_package  # noqa: F401  (registers "wkv4")
from rwkvx_cli.ops import wkv7 as _wkv7_package  # noqa: F401  (registers "wkv7")
from rwkvx_cli.ops.gdn import gdn
from rwkvx_cli.ops.kda import kda
from rwkvx_cli.ops.moba import moba
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, get_op, op_names, resolve_backend
from rwkvx_cli.ops.rwkv8 import rwkv8
from rwkvx_cli.ops.wkv4 import wkv4
from rwkvx_cli.ops.wkv7 import wkv7

__all__ = [
    "Backend",
    "Case",
    "OpSpec",
    "gdn",
    "get_op",
    "kda",
    "moba",
    "op_names",
    "resolve_backend",
    "rwkv8",
    "wkv4",
    "wkv7",
]
