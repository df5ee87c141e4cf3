"""Operators. Importing this package registers every op: each op's spec.py calls
`register` (see registry.py), and its __init__.py holds the public function."""

from rwkvx_cli.ops.channel_mix import channel_mix
from rwkvx_cli.ops.channel_mix import spec as _channel_mix_spec  # noqa: F401  (registers "channel_mix")
from rwkvx_cli.ops.gdn import gdn
from rwkvx_cli.ops.gdn import spec as _gdn_spec  # noqa: F401  (registers "gdn")
from rwkvx_cli.ops.kda import kda
from rwkvx_cli.ops.kda import spec as _kda_spec  # noqa: F401  (registers "kda")
from rwkvx_cli.ops.moba import moba
from rwkvx_cli.ops.moba import spec as _moba_spec  # noqa: F401  (registers "moba")
from rwkvx_cli.ops.registry import Backend, Case, OpSpec, get_op, op_names, resolve_backend
from rwkvx_cli.ops.rwkv7_out import rwkv7_out
from rwkvx_cli.ops.rwkv7_out import spec as _rwkv7_out_spec  # noqa: F401  (registers "rwkv7_out")
from rwkvx_cli.ops.rwkv7_prep import rwkv7_prep
from rwkvx_cli.ops.rwkv7_prep import spec as _rwkv7_prep_spec  # noqa: F401  (registers "rwkv7_prep")
from rwkvx_cli.ops.rwkv8 import rwkv8
from rwkvx_cli.ops.rwkv8 import spec as _rwkv8_spec  # noqa: F401  (registers "rwkv8")
from rwkvx_cli.ops.shift_mix import shift_mix
from rwkvx_cli.ops.shift_mix import spec as _shift_mix_spec  # noqa: F401  (registers "shift_mix")
from rwkvx_cli.ops.wkv4 import spec as _wkv4_spec  # noqa: F401  (registers "wkv4")
from rwkvx_cli.ops.wkv4 import wkv4
from rwkvx_cli.ops.wkv7 import spec as _wkv7_spec  # noqa: F401  (registers "wkv7")
from rwkvx_cli.ops.wkv7 import wkv7

__all__ = [
    "Backend",
    "Case",
    "OpSpec",
    "channel_mix",
    "gdn",
    "get_op",
    "kda",
    "moba",
    "op_names",
    "resolve_backend",
    "rwkv7_out",
    "rwkv7_prep",
    "rwkv8",
    "shift_mix",
    "wkv4",
    "wkv7",
]
