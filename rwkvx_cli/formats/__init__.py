"""Models in and out: rwkvx state dicts to and from the HF (fla) RWKV-7 layout and RWKV-X's
layout, size inference from tensor shapes alone (those two, RWKV-LM `.pth` and rwkvx), the
upcycle plan from RWKV-7 to a hybrid, and streaming, atomic writers (docs/formats.md). Below the
checkpoints (checkpoints/ writes and reads its files with `tensors` and `write`); what opens weights
of any kind, an rwkvx checkpoint included, is runs/weights.py.

Every conversion is a list of renaming rules applied lazily to a `TensorSource`, so a checkpoint
is read and written one tensor at a time.
"""

from rwkvx_cli.formats.errors import FormatError, OutputExistsError, SizeMismatchError
from rwkvx_cli.formats.hf import export_hf, from_hf, hf_config, load_hf, open_hf, to_hf
from rwkvx_cli.formats.rwkv_x import (
    export_rwkv_x,
    from_rwkv_x,
    moba_topk_from_rwkv_x,
    moba_topk_to_rwkv_x,
    open_rwkv_x,
    rwkv_x_args,
    to_rwkv_x,
)
from rwkvx_cli.formats.sizes import LoraRanks, Sizes, config_from_sizes, detect_layout, infer_sizes
from rwkvx_cli.formats.tensors import TensorSource, materialize, open_tensors
from rwkvx_cli.formats.upcycle import PlanRow, apply_plan, plan_table, upcycle_plan

__all__ = [
    "FormatError",
    "LoraRanks",
    "OutputExistsError",
    "PlanRow",
    "SizeMismatchError",
    "Sizes",
    "TensorSource",
    "apply_plan",
    "config_from_sizes",
    "detect_layout",
    "export_hf",
    "export_rwkv_x",
    "from_hf",
    "from_rwkv_x",
    "hf_config",
    "infer_sizes",
    "load_hf",
    "materialize",
    "moba_topk_from_rwkv_x",
    "moba_topk_to_rwkv_x",
    "open_hf",
    "open_rwkv_x",
    "open_tensors",
    "plan_table",
    "rwkv_x_args",
    "to_hf",
    "to_rwkv_x",
    "upcycle_plan",
]
