"""One time mix per layer kind (`model.layers`), each in its own file with its init.

Every time mix maps [B, T, C] -> [B, T, C] behind the same interface, so one
`Block` holds any of them:

- `from_config(cfg, layer_id)`: build it from the model config;
- `forward(x, v_first, state, graph=PLAIN) -> (y, v_first, state)`: `state` is a
  dict of tensors, batch first (MoBA's: tuples of key and value tensors, the tokens
  read so far, whose kind sets `grows = True`: not carried across TBPTT steps); `v_first` is
  RWKV-7's first-layer value, passed through by the other kinds; `graph` the
  hooks (common.Graph) through which LRP reads the same forward as its modified
  graph: a kind whose forward calls none has no LRP rules (explain refuses it);
- `empty_state(B, device)`: the zero state (None for MoBA, whose state grows);
- `reset_parameters(gen, layer, n_layer)`: its seeded init, at depth `layer` of
  `n_layer` (docs/model.md#initialisation);
- `op_dims()`, for the recurrent ones: the op and its dims for one token (FLOP counts);
- `letter`: the kind's letter in the model summary's block string (`rwkvx init`).

Adding a kind: docs/extending.md.
"""

from rwkvx_cli.models.layers.common import (
    PLAIN,
    ChannelMix,
    GatedRMSNorm,
    Graph,
    ShortConv,
    State,
    orthogonal_,
    orthogonal_scaled_,
    shifted,
)
from rwkvx_cli.models.layers.delta import DeltaMix, GatedDeltaNet, KimiDeltaAttention
from rwkvx_cli.models.layers.moba import MobaAttention
from rwkvx_cli.models.layers.rwkv4 import RWKV4TimeMix
from rwkvx_cli.models.layers.rwkv7 import RWKV7TimeMix
from rwkvx_cli.models.layers.rwkv8 import RWKV8Mix

# The one place a layer kind (config.LAYER_KINDS) becomes its time mix.
TIME_MIXES: dict[str, type] = {
    "rwkv7": RWKV7TimeMix,
    "moba": MobaAttention,
    "rwkv4": RWKV4TimeMix,
    "gdn": GatedDeltaNet,
    "kda": KimiDeltaAttention,
    "rwkv8": RWKV8Mix,
}

__all__ = [
    "PLAIN",
    "TIME_MIXES",
    "ChannelMix",
    "DeltaMix",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "Graph",
    "KimiDeltaAttention",
    "MobaAttention",
    "RWKV4TimeMix",
    "RWKV7TimeMix",
    "RWKV8Mix",
    "ShortConv",
    "State",
    "orthogonal_",
    "orthogonal_scaled_",
    "shifted",
]
