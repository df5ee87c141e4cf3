"""Models in and out: rwkvx state dicts to and from the HF (fla) RWKV-7 layout and RWKV-X's
layout, size inference from tensor shapes alone (those two, RWKV-LM `.pth` and rwkvx), the
upcycle plan from RWKV-7 to a hybrid, and streaming, atomic writers (docs/formats.md).

Every conversion is a list of renaming rules applied lazily to a `TensorSource`, so a checkpoint
is read and written one tensor at a time.
"""

from rwkvx_cli.runs.formats.errors import FormatError, OutputExistsError, SizeMismatchError
from rwkvx_cli.runs.formats.hf import export_hf, from_hf, hf_config, load_hf, open_hf, to_hf
from rwkvx_cli.runs.formats.rwkv_x import (
    export_rwkv_x,
    from_rwkv_x,
    moba_topk_from_rwkv_x,
    moba_topk_to_rwkv_x,
    open_rwkv_x,
    rwkv_x_args,
    to_rwkv_x,
)
from rwkvx_cli.runs.formats.sizes import LoraRanks, Sizes, config_from_sizes, detect_layout, infer_sizes
from rwkvx_cli.runs.formats.tensors import TensorSource, materialize, open_tensors
from rwkvx_cli.runs.formats.upcycle import PlanRow, apply_plan, plan_table, upcycle_plan


def _open(path, need_sizes: bool) -> tuple[TensorSource, Sizes | None]:
    from pathlib import Path

    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        return open_hf(path)
    base = open_tensors(path)
    layout = "rwkvx" if "emb.weight" in base else detect_layout(base.names())
    if layout == "rwkv-x":
        base.close()
        return open_rwkv_x(path)
    if layout == "hf":
        from rwkvx_cli.runs.formats.hf import from_hf_rules
        from rwkvx_cli.runs.formats.tensors import MappedSource

        base = MappedSource(base, from_hf_rules(base.shapes()))
    if not need_sizes:
        return base, None
    sizes = infer_sizes(base.shapes())
    if layout == "rwkvx":
        sizes.ln_x_eps = _rwkvx_ln_x_eps(base)
    elif layout == "hf":  # no config.json: fla's defaults, norm_eps 1e-5, so its group norm's eps is head_dim x 1e-5
        from rwkvx_cli.runs.formats.hf import LN_EPS

        sizes.layout, sizes.ln_x_eps = "hf", sizes.head_size * LN_EPS
    return base, sizes


def _rwkvx_ln_x_eps(source: TensorSource) -> float | None:
    """model.ln_x_eps of an rwkvx checkpoint (its meta.json) or safetensors export (its metadata's
    config); None where none is stated (a checkpoint from before the setting: the default)."""
    import json
    import math

    from rwkvx_cli.runs.formats.tensors import SafetensorsFiles
    from rwkvx_cli.runs.sharded import ShardedSource

    if isinstance(source, ShardedSource):  # a sharded checkpoint: its meta.json, verified when it was opened
        path = source.ckpt / "meta.json"
    elif not isinstance(source, SafetensorsFiles) or len(source.paths) != 1:
        return None
    else:
        path = source.paths[0]
    try:
        if isinstance(source, SafetensorsFiles) and "rwkvx_config" in source.metadata:
            config = json.loads(source.metadata["rwkvx_config"])
        elif (path.parent / "meta.json").is_file():
            config = json.loads((path.parent / "meta.json").read_text(encoding="utf-8"))["config"]
        else:
            return None
        eps = config["model"].get("ln_x_eps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None  # no readable config beside the weights: the tensors alone, as for a bare file
    if eps is None:
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise FormatError(f"{path}: its config's model.ln_x_eps is {eps!r}, not a finite number > 0")
    return float(eps)


def open_source(path) -> TensorSource:
    """Weights from any supported layout at `path`, lazily, under rwkvx's names: an HF directory, an
    RWKV-X or RWKV-LM `.pth`, an rwkvx checkpoint or run directory, or a `.safetensors` file."""
    return _open(path, need_sizes=False)[0]


def open_any(path) -> tuple[TensorSource, Sizes]:
    """`open_source`, and the sizes the tensors give (what `rwkvx init --from` and `train.init_from` read)."""
    return _open(path, need_sizes=True)


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
    "open_any",
    "open_source",
    "open_hf",
    "open_rwkv_x",
    "open_tensors",
    "plan_table",
    "rwkv_x_args",
    "to_hf",
    "to_rwkv_x",
    "upcycle_plan",
]
