"""`train.init_from` (and `rwkvx init --from`): the weights a run starts from, and the model they make.

The sizes come from the tensors (formats/sizes.py: n_layer, n_embd, head_size, vocab_size and
RWKV-7's four low-rank sizes), in any layout rwkvx reads (an rwkvx checkpoint or run, RWKV-LM's
or RWKV-X's `.pth`, an HF (fla) directory, a `.safetensors` file): the config need not repeat them,
and a size it does write must agree, or each tensor it contradicts is named. A config that asks
for MoBA blocks the weights do not have is an upcycle, as RWKV-X's `init_moba_from_rwkv`: the
RWKV-7 blocks load in order and each MoBA block starts from the RWKV-7 block below it
(formats/upcycle.py); the plan says what was loaded, copied, initialised or left out.

An rwkvx run directory (or checkpoints folder) is read at its newest good checkpoint, found once as
`eval` and `export` find it (checkpoints/find.py: each damaged newer one told to `on_skip`), and the
start names its step.

Before anything of the run is written, the weights are checked: every file's fields by its reader
(docs/formats.md#files-from-elsewhere-what-is-refused-what-is-accepted), their values in one pass
(`check_values`), and the tokenizer they name against the run's (runs/start_tokenizer.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rwkvx_cli.checkpoints.find import resolve_checkpoint
from rwkvx_cli.config import Config, ModelConfig
from rwkvx_cli.formats import (
    PlanRow,
    Sizes,
    apply_plan,
    config_from_sizes,
    materialize,
    upcycle_plan,
)
from rwkvx_cli.formats.errors import FormatError
from rwkvx_cli.formats.sizes import LORA_FIELDS, SIZE_KEYS
from rwkvx_cli.formats.tensors import from_store
from rwkvx_cli.models import LM, layer_kinds
from rwkvx_cli.runs.start_tokenizer import check_start_tokenizer
from rwkvx_cli.runs.weights import open_any, open_source

OnSkip = Callable[[Path, str], None]


@dataclass
class Start:
    source: str  # train.init_from
    model: ModelConfig  # the run's model section, with the sizes the weights give
    sizes: Sizes  # what the tensors say
    plan: list[PlanRow] | None  # an upcycle's rows; None: the weights load as they are
    checkpoint: Path | None = None  # the rwkvx checkpoint read, where `source` names a run (or one)
    step: int | None = None  # its step

    @property
    def weights(self) -> str:
        """Where the weights are read: the checkpoint found once, or `source` itself."""
        return str(self.checkpoint) if self.checkpoint is not None else self.source


def plan_start(cfg: Config, on_skip: OnSkip | None = None) -> Start:
    """The model `cfg.train.init_from`'s weights make with `cfg`'s settings, from their names and shapes,
    after one pass over their values (`check_values`): refused here, nothing of the run is written yet.
    `on_skip(path, reason)` hears of each damaged checkpoint of an rwkvx run passed over for an older one."""
    path = Path(cfg.train.init_from)
    checkpoint = step = None
    if path.is_dir() and not (path / "config.json").is_file() and from_store(path):  # not HF: weights._open
        checkpoint, meta = resolve_checkpoint(path, on_skip)
        step = meta["step"]
        if meta.get("base") is not None:
            base = meta["base"] if isinstance(meta["base"], dict) else {}
            raise FormatError(
                f"train.init_from {checkpoint}: a state-tuned run's checkpoint holds its initial state, not weights; "
                f"start from the weights it was tuned for ({base.get('weights')})"
            )
    weights = str(checkpoint) if checkpoint is not None else cfg.train.init_from
    source, sizes = open_any(weights)
    check_start_tokenizer(cfg, sizes.notes, Path(weights))
    with source:
        shapes = source.shapes()
        check_values(source, weights)
    written = {k.split(".", 1)[1] for k in cfg.written if k.startswith("model.")}
    kinds = layer_kinds(cfg.model)
    upcycle = "moba" in kinds and sizes.n_attn == 0  # MoBA blocks only the config asks for
    given = dataclasses.replace(sizes, kinds=kinds) if upcycle else sizes  # the stack is the config's
    try:
        model = config_from_sizes(given, cfg.model, written)
    except FormatError as e:
        raise type(e)(f"train.init_from {cfg.train.init_from}: {e}") from None
    plan = None
    if upcycle:
        with torch.device("meta"):
            target = LM(model).state_dict()
        plan = upcycle_plan(shapes, target)
    return Start(cfg.train.init_from, model, sizes, plan, checkpoint, step)


def check_values(source, where: str) -> None:
    """Refuse, tensor by tensor, weights the model's fp32 parameters cannot take as they are: a tensor
    that is not floating point, NaN / inf, and fp64 values past fp32's range (they would load as inf)."""
    for name in source.names():
        dtype = source.dtype(name)
        if not dtype.is_floating_point:
            raise FormatError(f"{where}: {name} is {str(dtype).removeprefix('torch.')}, not floating point")
        t = source.get(name)
        if not torch.isfinite(t).all():
            raise FormatError(f"{where}: {name} holds non-finite values")
        if dtype == torch.float64 and not torch.isfinite(t.float()).all():
            raise FormatError(f"{where}: {name} holds values too large for the model's float32")
        del t
        source.release(name)


def start_weights(start: Start, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict `model` (built from `start.model`) starts with: the weights as they are, or an
    upcycle's loaded, copied and fresh tensors (the fresh ones `model`'s own init)."""
    with open_source(start.weights) as source:
        if start.plan is None:
            return materialize(source)
        needed = {r.source for r in start.plan if r.target is not None and r.source is not None}
        tensors = {}
        for name in needed:
            tensors[name] = source.get(name).clone()
            source.release(name)
    return apply_plan(start.plan, tensors, model.state_dict())


def sizes_from(saved: ModelConfig, cfg: Config) -> ModelConfig:
    """The model of a run resumed after it started from train.init_from: the sizes its checkpoints
    have (the weights gave them), where the config does not write its own."""
    keys = (*SIZE_KEYS, *LORA_FIELDS, "ln_x_eps")  # ln_x_eps: an HF file's (formats/hf.py)
    kept = {k: getattr(saved, k) for k in keys if f"model.{k}" not in cfg.written and hasattr(saved, k)}
    return dataclasses.replace(cfg.model, **kept)


def plan_summary(plan: list[PlanRow]) -> list[tuple[str, str, str, int]]:
    """An upcycle's plan as (target, action, source, tensors) rows, one per block and action."""
    rows: dict[tuple[str, str, str], int] = {}
    for r in plan:
        key = (_block(r.target) if r.target else "-", r.action, _block(r.source) if r.source else "-")
        rows[key] = rows.get(key, 0) + 1
    return [(t, a, s, n) for (t, a, s), n in rows.items()]


def _block(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else "embedding, ln_out, head"


