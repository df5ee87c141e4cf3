"""Opening a run or a checkpoint for use: the one loader of every command that reads a model
(`eval`, `eval --tasks`, `explain`, `export`).

    find_checkpoint(path)   the checkpoint a path names (a checkpoint directory, or a run directory or
                            checkpoints folder: its newest good one), its verified meta.json and config;
                            nothing large is read
    run_dir_named(path)     the run directory that path is in (None: a checkpoint kept elsewhere), nothing read
    open_checkpoint(path)   that, plus the run's tokenizer, the Runtime (device and precision, resolved
                            once), and the model with its weights on the device, in eval mode; a
                            state-tuned run's (train.tune=state): its frozen base and its tuned state

Training opens its own run through the same pieces: the checkpoints (checkpoints/manager.py) for
resume, the weights loader (runs/weights.py) for train.init_from, the tokenizer rule (runs/tokenizers.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from rwkvx_cli.checkpoints import full, sharded
from rwkvx_cli.checkpoints.find import is_checkpoint_dir, open_weights, resolve_checkpoint
from rwkvx_cli.checkpoints.store import is_step_dir, step_dirs
from rwkvx_cli.config import Config, ConfigError, config_from_dict
from rwkvx_cli.errors import CheckpointError, UsageError
from rwkvx_cli.formats.errors import FormatError
from rwkvx_cli.fsio import RUN_MARKER
from rwkvx_cli.models import LM
from rwkvx_cli.models.state import InitialState
from rwkvx_cli.runs import tuned as tuning
from rwkvx_cli.runs.layout import checkpoints_dir, config_path, run_dir_of
from rwkvx_cli.runs.memory import check_model
from rwkvx_cli.runs.runtime import Runtime, resolve
from rwkvx_cli.runs.tokenizers import run_tokenizer
from rwkvx_cli.runs.weights import load_into, open_source

OnSkip = Callable[[Path, str], None]


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # the checkpoint directory (<run>/checkpoints/step_...)
    meta: dict  # its meta.json, checked against every file's checksum
    config: Config  # the run's config, as it trained

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def run_dir(self) -> Path:
        return run_dir_of(self.path)


@dataclass
class Opened:
    """A checkpoint ready to use: `model` on `runtime.device`, in eval mode; `initial`: the tuned initial
    state every row starts from (a state-tuned run's, or a state file's), None: the zero state."""

    model: LM
    tokenizer: object
    runtime: Runtime
    checkpoint: Checkpoint
    initial: InitialState | None = None

    @property
    def config(self) -> Config:
        return self.checkpoint.config

    @property
    def step(self) -> int:
        return self.checkpoint.step


def find_checkpoint(path: Path | str, on_skip: OnSkip | None = None) -> Checkpoint:
    """The checkpoint `path` names; `on_skip(path, reason)` hears of each damaged newer checkpoint
    of a run passed over for an older one."""
    found, meta = resolve_checkpoint(Path(path), on_skip)
    try:
        config = config_from_dict(meta["config"])
    except ConfigError as e:  # the file's, not the command line's: a damaged (or forged) checkpoint, exit 1
        raise CheckpointError(f"{found / 'meta.json'}: its config is not valid: {e}") from None
    return Checkpoint(found, meta, config)


def run_dir_named(path: Path | str) -> Path | None:
    """The run directory a checkpoint path is in, from the names alone (nothing is verified): a
    checkpoint's <run> (<run>/checkpoints/step_...), a checkpoints folder's parent, or the run directory
    itself. None where that is no run directory (rwkvx's marker, or an older run's config.yaml beside
    its checkpoints): a checkpoint kept outside one."""
    path = Path(path)
    if is_checkpoint_dir(path) or is_step_dir(path):  # a damaged step_*: the loader says why
        run = run_dir_of(path)
    elif not step_dirs(checkpoints_dir(path)) and step_dirs(path):
        run = path.parent  # a checkpoints folder (resolve_checkpoint's order)
    else:
        run = path
    older = config_path(run).is_file() and checkpoints_dir(run).is_dir()
    return run if (run / RUN_MARKER).exists() or older else None


def open_checkpoint(
    path: Path | str,
    *,
    device: str | None = None,
    precision: str | None = None,
    data_dir: Path | None = None,
    on_skip: OnSkip | None = None,
    check: Callable[[Config], None] | None = None,
    reset_at_eod: bool | None = None,
    state: Path | None = None,
    tuned: bool = False,
) -> Opened:
    """Open a checkpoint for evaluation or inference. `device` / `precision`: as train.device /
    train.precision (None: the run's own settings), with what this machine lacks falling back to
    the CPU and fp32. `data_dir`: where the run's tokenizer.json is (None: the run's data, as
    training found it). `check(config)` may refuse the model before any weights are read.
    `reset_at_eod`: evaluate with (True) or without (False) document starts at end-of-document
    tokens whatever the run trained with (None: as it trained); `opened.config` says which. `tuned`: the
    caller starts rows from `opened.initial`: a state-tuned run's checkpoint opens as its frozen base
    (read again from where its "base" says, checked by digest: runs/tuned.py) and its state, and `state`
    (rwkvx's state file) gives the state instead, checked to be tuned for this model's weights. Without
    `tuned` a state-tuned checkpoint is refused in one line."""
    ckpt = find_checkpoint(path, on_skip)
    base = tuning.base_of(ckpt.meta, str(ckpt.path))
    if base is not None and not tuned:
        raise UsageError(
            f"{ckpt.path} is a state-tuned run's checkpoint (its initial state alone): only rwkvx eval's validation "
            "and --generate start rows from a tuned state"
        )
    if reset_at_eod is not None and reset_at_eod != ckpt.config.data.reset_at_eod:
        data = copy.deepcopy(ckpt.meta["config"])
        data.setdefault("data", {})["reset_at_eod"] = reset_at_eod
        ckpt = replace(ckpt, config=config_from_dict(data))
    cfg = ckpt.config
    if check is not None:
        check(cfg)
    tokenizer = run_tokenizer(cfg, ckpt.run_dir, data_dir)
    runtime = resolve(device or cfg.train.device, precision or cfg.train.precision, fallback=True)
    runtime.apply()
    check_model(cfg.model, runtime.device)  # a forged meta.json can ask for any size
    initial = None
    if base is not None:
        model = _open_base(cfg, base, str(ckpt.path))
        initial = InitialState(model, cfg.train.tune_shifts)
        tuning.load_state(initial, tuning.checkpoint_state(ckpt.path, ckpt.meta), str(ckpt.path))
    else:
        model = LM(cfg.model)
        if sharded.is_sharded(ckpt.meta):  # read tensor by tensor from the shards: never a second copy of the model
            with open_weights(ckpt.path, ckpt.meta) as weights:
                load_into(model, weights, str(ckpt.path))
        else:
            load_into(model, full.load_weights(ckpt.path), str(ckpt.path))
    if state is not None:
        tensors, info = tuning.read_state_file(state)
        tuning.check_base(info["base"], model, f"--state {state}")
        initial = InitialState(model, tuning.tuned_shifts(tensors))
        tuning.load_state(initial, tensors, f"--state {state}")
    model.to(runtime.device)
    model.eval()
    if initial is not None:
        initial.to(runtime.device)
    return Opened(model, tokenizer, runtime, ckpt, initial)


def _open_base(cfg: Config, base: dict, where: str) -> LM:
    """The frozen model of a state-tuned run (`cfg`: its config; `base`: its checkpoint's record), read
    from base["weights"] tensor by tensor and checked against the digest."""
    model = LM(cfg.model)
    try:
        with open_source(base["weights"]) as source:
            load_into(model, source, base["weights"])
    except (FormatError, CheckpointError) as e:
        raise CheckpointError(f"{where}: its base weights cannot be read: {e}") from None
    tuning.check_base(base, model, where)
    return model
