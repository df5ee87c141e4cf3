"""A training run from start to end: the entry points of `rwkvx init` and `rwkvx train`.

`run_training` guards the run directory, prepares the data (rank 0, the others wait),
builds the trainer, resumes or starts fresh, trains under a graceful stop, and on a
finished run plots the losses, validates, and samples a little text. It reports through
`on_event(kind, payload)` and never prints; the CLI renders:

    "prepared"  PrepareStats   rank 0 tokenized the corpus
    "resumed"   int            --resume: the step it continues from (0: no checkpoint yet)
    "changed"   dict           --resume --allow-change: {setting: (the checkpoint's value, this run's)}
    "init_only" dict           --resume gave other INIT_ONLY settings: {setting: (the run's, kept; the one given)}
    "initial"   dict           train.init_from was loaded (start_report: its sizes, an upcycle's plan)
    "branched"  dict           train.decay_from's checkpoint was loaded: from, step, tokens, decay_tokens, shape
    "start"     TrainStart     the model is built and the loop is about to begin
    "step", "skipped"   StepMetrics   from the loop (train/loop.py)
    "checkpoint"  int            the step of a checkpoint now on disk
    "profile"   Path           the loop wrote the trace of train.profile_steps
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rwkvx_cli.checkpoints import full, store
from rwkvx_cli.checkpoints.manager import resume_changes, tokens_trained
from rwkvx_cli.config import Config, ConfigError, config_from_dict, config_to_dict, resolve_paths
from rwkvx_cli.data import PrepareStats
from rwkvx_cli.errors import CheckpointError, UsageError
from rwkvx_cli.formats.sizes import sizes_line
from rwkvx_cli.fsio import RUN_MARKER, atomic_write_bytes, atomic_write_text, check_writable_dir, claim_dir
from rwkvx_cli.models import LM, build_model
from rwkvx_cli.models.generate import generate
from rwkvx_cli.models.state import InitialState
from rwkvx_cli.models.summary import model_summary
from rwkvx_cli.runs import runtime as rt
from rwkvx_cli.runs.data import RunData, ensure_data, needs_preparing, prepare_command
from rwkvx_cli.runs.initial import Start, plan_start, plan_summary, sizes_from, start_weights
from rwkvx_cli.runs.layout import checkpoints_dir, config_path, loss_plot_path, metrics_path, tokenizer_path
from rwkvx_cli.runs.lock import LOCK_NAME, hold_run
from rwkvx_cli.runs.memory import check_model, check_training
from rwkvx_cli.runs.opening import Checkpoint, find_checkpoint
from rwkvx_cli.runs.tokenizers import check_same_tokenizer
from rwkvx_cli.runs.tuned import base_record
from rwkvx_cli.runs.weights import load_into
from rwkvx_cli.train import distributed
from rwkvx_cli.train.distributed import SINGLE, DistInfo
from rwkvx_cli.train.loggers import check_available as check_loggers
from rwkvx_cli.train.loop import Trainer
from rwkvx_cli.train.metrics import StepMetrics
from rwkvx_cli.train.plot import plot_losses
from rwkvx_cli.train.schedule import decay_start
from rwkvx_cli.train.signals import GracefulStop

# The sample printed at the end of a finished run: a continuation of a newline.
SAMPLE_PROMPT = "\n"
SAMPLE_TOKENS = 200
SAMPLE_TEMPERATURE = 1.0
SAMPLE_TOP_P = 0.85

OnEvent = Callable[[str, object], None]
DataProgress = Callable[[], contextlib.AbstractContextManager]


@dataclass
class TrainStart:
    summary: dict  # models/summary.py's model_summary
    device: torch.device
    last_step: int  # the step the run ends at (train.tokens over tokens per step, across resumes)


@dataclass
class TrainResult:
    step: int
    last: StepMetrics | None  # None: nothing to do, the run was already complete
    stopped: bool  # a stop request ended it before the last step (a checkpoint was saved)
    skipped_steps: int  # non-finite steps that were not applied
    val: dict | None = None  # final validation of a finished run (loss, bpb, ...)
    sample: str | None = None  # text sampled from the finished model


def init_run(
    cfg: Config,
    *,
    data_progress: DataProgress | None = None,
    on_prepared: Callable[[PrepareStats], None] | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
) -> dict:
    """Write a new run directory (config, tokenizer, prepared data, step-0 checkpoint) without
    training; returns the model summary. Refuses a directory that already holds checkpoints.
    `cfg`'s paths are made absolute first (config.resolve_paths): the run works from any directory.
    `on_skip(path, reason)` hears of each damaged checkpoint of a train.init_from run passed over."""
    resolve_paths(cfg)
    run_dir = Path(cfg.run_dir)
    start = _start_from(cfg, on_skip)
    check_model(cfg.model)
    check_training(cfg, rt.resolve(cfg.train.device, cfg.train.precision))  # what `train` would refuse
    with claim_run(cfg):
        if store.step_dirs(checkpoints_dir(run_dir)):
            raise UsageError(f"{run_dir} already holds checkpoints; choose another run directory")
        data, model = open_run(cfg, run_dir, data_progress, on_prepared)
        if start is not None:
            load_into(model, start_weights(start, model), start.source)
        meta = {"config": config_to_dict(cfg)}
        saved = model
        if cfg.train.tune == "state":  # the zero initial state, and the frozen weights it is tuned for
            meta["base"] = base_record(cfg.train.init_from, start.weights, start.step, model)
            saved = InitialState(model, cfg.train.tune_shifts)
        full.save_checkpoint(checkpoints_dir(run_dir), 0, saved, None, meta, cfg.train.keep_last)
    summary = model_summary(model)
    if start is not None:
        summary["initial"] = start_report(start)
    return summary


def _start_from(
    cfg: Config, on_skip: Callable[[Path, str], None] | None = None, base: dict | None = None
) -> Start | None:
    """train.init_from's plan, its sizes written into `cfg.model` (None without init_from). `base`: a
    state-tuned run's record of its frozen weights (its newest checkpoint's), read again from where they
    were read (an rwkvx run given as train.init_from may have newer checkpoints since)."""
    if not cfg.train.init_from:
        return None
    planned = cfg
    if base is not None:
        planned = copy.copy(cfg)
        planned.train = dataclasses.replace(cfg.train, init_from=base["weights"])
    start = plan_start(planned, on_skip)
    if cfg.train.tune == "state" and start.plan is not None:
        raise UsageError(
            "train.tune=state: the config asks for MoBA blocks that train.init_from's weights lack (an upcycle); "
            "state tuning keeps its base as it is: upcycle and train it first with train.tune=full"
        )
    cfg.model = start.model
    cfg.validate(cfg.written | {"model.vocab_size"})  # the weights gave the vocabulary (data.eod_id's check)
    return start


def start_report(start: Start) -> dict:
    """What `rwkvx init` / `train` say about train.init_from: where the weights are (a run's: the step of
    the checkpoint read), the sizes read and an upcycle's plan."""
    plan = plan_summary(start.plan) if start.plan is not None else None
    return {
        "source": start.source if start.step is None else f"{start.source}, step {start.step}",
        "step": start.step,
        "layout": start.sizes.layout,
        "sizes": sizes_line(start.sizes),
        "notes": list(start.sizes.notes),
        "plan": plan,
    }


def open_run(
    cfg: Config,
    run_dir: Path,
    data_progress: DataProgress | None = None,
    on_prepared: Callable[[PrepareStats], None] | None = None,
) -> tuple[RunData, LM]:
    """Prepare the data if needed, build the model, and write the run files. `data_progress()`
    is entered around the preparation and yields its progress callback (done, total);
    `on_prepared(stats)` hears when this call tokenized the corpus."""
    with data_progress() if data_progress else contextlib.nullcontext() as progress:
        data = ensure_data(cfg, run_dir, progress)
    if data.prepared is not None and on_prepared:
        on_prepared(data.prepared)
    model = build_model(cfg.model, cfg.train.seed)
    write_run_files(cfg, run_dir, data)
    return data, model


def write_run_files(cfg: Config, run_dir: Path, data: RunData) -> None:
    """config.yaml, and the tokenizer.json of the run's data (a trained run keeps the one it has)."""
    claim_dir(run_dir, RUN_MARKER)  # claim_run checked it is ours
    if data.data_dir.resolve() != run_dir.resolve():
        target, source = tokenizer_path(run_dir), tokenizer_path(data.data_dir)
        if not target.exists() or target.resolve() != source.resolve():
            if any(checkpoints_dir(run_dir).glob("step_*")):
                check_same_tokenizer(run_dir, data.data_dir)
            atomic_write_bytes(target, source.read_bytes())
    atomic_write_text(config_path(run_dir), yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def _older_run(run_dir: Path) -> bool:
    """A run directory made by an rwkvx older than the marker file (config.yaml and step checkpoints),
    or one that holds only the lock of a process that died before it wrote the marker."""
    if (run_dir / LOCK_NAME).is_file():
        return True
    return config_path(run_dir).is_file() and bool(store.step_dirs(checkpoints_dir(run_dir)))


@contextlib.contextmanager
def claim_run(cfg: Config):
    """Check that rwkvx may write into the run directory (new, empty, or its own: fsio.check_writable_dir),
    mark it as a run, and hold its lock (runs/lock.py) until the block ends."""
    run_dir = check_writable_dir(cfg.run_dir, RUN_MARKER, _older_run, "run_dir")
    claim_dir(run_dir, RUN_MARKER)
    with hold_run(run_dir) as lock:
        yield lock


def run_training(
    cfg: Config,
    resume: bool,
    dist: DistInfo = SINGLE,
    *,
    on_event: OnEvent | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
    data_progress: DataProgress | None = None,
    allow_change: Collection[str] = (),
) -> TrainResult:
    """Train `cfg` in its run directory (see the module docstring). `on_skip(path, reason)` hears
    of each damaged checkpoint passed over on resume; `data_progress()` is entered around the data
    preparation and yields its progress callback (done, total). A resume refuses settings that
    differ from its checkpoint's, but for those in `allow_change` (checkpoints/manager.py). `cfg`'s
    paths are made absolute first (config.resolve_paths), so the run's saved config names the same
    files from any directory, and a relative path given again from the run's first directory is no change."""
    resolve_paths(cfg)
    check_loggers(cfg.train.loggers)  # a missing tensorboard or wandb: the pip command, before anything runs
    # Resolved once, for the whole run: a device or precision this machine lacks is refused here.
    runtime = rt.resolve(cfg.train.device, cfg.train.precision, local_rank=dist.local_rank)
    check_training(cfg, runtime)
    distributed.init(dist, runtime.device)
    try:
        with distributed.peer_loss_in_one_line(), contextlib.ExitStack() as held:
            # Rank 0 claims the run directory; a refusal (in use, not a run directory) is every rank's.
            lock = distributed.agreed(lambda: held.enter_context(claim_run(cfg)) if dist.is_main else None)
            guard = lock.check if lock is not None else None
            return _run_training(cfg, resume, dist, runtime, guard, on_event, on_skip, data_progress, allow_change)
    finally:
        distributed.shutdown()


def _saved_config(run_dir: Path) -> Config | None:
    """The config of the run's newest readable checkpoint (None: none yet), its paths absolute: a run
    saved before they were keeps its relative ones, which name files from the current directory."""
    saved = _saved(run_dir)
    return saved[0] if saved is not None else None


def _saved(run_dir: Path) -> tuple[Config, dict | None] | None:
    """(config, "base": a state-tuned run's frozen weights) of the run's newest readable checkpoint."""
    for path in reversed(store.list_checkpoints(checkpoints_dir(run_dir))):
        try:
            meta = store.read_meta(path)
            base = meta.get("base")
            return resolve_paths(config_from_dict(meta["config"])), base if isinstance(base, dict) else None
        except (CheckpointError, ConfigError):
            continue  # damaged: resume reports it and falls back
    return None


def _plan_start(
    cfg: Config, resume: bool, dist: DistInfo, run_dir: Path, allow_change, on_skip=None
) -> tuple[Start | None, dict, Checkpoint | None]:
    """The checks every rank makes before any file is written: (train.init_from's plan, the settings a
    resume changes, train.decay_from's checkpoint); `on_skip`: see plan_start."""
    if not resume and any(store.step_of(p) > 0 for p in store.step_dirs(checkpoints_dir(run_dir))):
        raise UsageError(f"{run_dir} already has training checkpoints: pass --resume, or choose another run_dir")
    saved, base = (_saved(run_dir) if resume else None) or (None, None)
    start = branch = None
    if cfg.train.decay_from and saved is None:  # a branch that has not written a checkpoint yet
        branch = plan_decay(cfg, run_dir, on_skip)
        saved, allow_change = branch.config, {*allow_change, *DECAY_SETTINGS}
    elif cfg.train.decay_from and saved.train.decay_from:  # a branch resumed: it still ends where its decay does
        cfg.train.tokens = saved.train.tokens - saved.train.decay_tokens + cfg.train.decay_tokens
    if cfg.train.tune == "state":  # the frozen weights are read on every start, a resume's too
        start = _start_from(cfg, on_skip, base if saved is not None and saved.train.tune == "state" else None)
    elif cfg.train.init_from and saved is not None:
        cfg.model = sizes_from(saved.model, cfg)  # the sizes the weights gave when the run began
    elif cfg.train.init_from:
        start = _start_from(cfg, on_skip)
    changes = resume_changes(saved, cfg, allow_change) if saved is not None else {}
    if dist.world_size > 1 and needs_preparing(cfg, run_dir):
        # Preparing here would leave the other ranks waiting until they time out on a large corpus.
        raise UsageError(
            "the corpus is not prepared, and a multi-process train does not prepare it (the other ranks would "
            f"wait and time out); run {prepare_command(cfg, run_dir)}"
        )
    return start, changes, branch


# What a decay branch sets apart from the run it continues: the decay's length, shape and end rate.
DECAY_SETTINGS = frozenset({"train.decay_tokens", "train.decay_shape", "train.lr_final"})


def plan_decay(cfg: Config, run_dir: Path, on_skip=None) -> Checkpoint:
    """The checkpoint train.decay_from names (a run's newest good one; `on_skip` hears of a damaged newer
    one passed over), checked to lie in the stable phase of a warmup-stable-decay run other than this one;
    cfg.train.tokens becomes its tokens + train.decay_tokens."""
    source = Path(cfg.train.decay_from)
    ckpt = find_checkpoint(source, on_skip)
    if ckpt.run_dir.resolve() == run_dir.resolve():
        raise UsageError(f"train.decay_from: {ckpt.path} is this run's own; a decay branches into a new run_dir")
    src, tokens = ckpt.config.train, tokens_trained(ckpt.meta)
    if src.lr_schedule != "wsd":
        raise UsageError(
            f"train.decay_from: {ckpt.path} is of a {src.lr_schedule} run; a decay branches from the stable phase "
            "of a warmup-stable-decay run (train.lr_schedule=wsd)"
        )
    if not src.warmup_tokens <= tokens <= decay_start(src):
        raise UsageError(
            f"train.decay_from: {ckpt.path} ({tokens:,} tokens) is outside its run's stable phase "
            f"({src.warmup_tokens:,} to {decay_start(src):,} tokens)"
        )
    cfg.train.tokens = tokens + cfg.train.decay_tokens
    return ckpt


# Settings that decide only how a run starts (the init's key gain, the weights it starts from): a resume
# may give other values (checkpoints/manager.py's OPERATIONAL), which change nothing it computes, so the
# run keeps the ones it started with, in config.yaml and every checkpoint, and says so.
INIT_ONLY = ("model.ffn_key_gain", "train.init_from", "train.decay_from")


def keep_init_settings(saved: Config | None, cfg: Config) -> dict[str, tuple]:
    """{setting: (the run's value, the value given)} for each INIT_ONLY setting `cfg` gives otherwise than
    the run's newest checkpoint (`saved`); `cfg` takes the run's value back. A setting the checkpoint does
    not state (saved before it existed) takes the value given: the record had none to keep."""
    kept = {}
    for key in INIT_ONLY if saved is not None else ():
        section, name = key.split(".")
        old, new = getattr(getattr(saved, section), name), getattr(getattr(cfg, section), name)
        if key in saved.written and old != new:
            setattr(getattr(cfg, section), name, old)
            kept[key] = (old, new)
    return kept


def _run_training(cfg, resume, dist, runtime, guard, on_event, on_skip, data_progress, allow_change) -> TrainResult:
    emit = on_event or (lambda kind, payload: None)
    run_dir = Path(cfg.run_dir)
    kept = keep_init_settings(_saved_config(run_dir), cfg) if resume else {}  # before anything reads cfg

    def first():  # every rank's checks, then rank 0 prepares the data and writes the run files
        plan = _plan_start(cfg, resume, dist, run_dir, allow_change, on_skip)
        if not dist.is_main:
            return plan, None
        return plan, open_run(cfg, run_dir, data_progress, lambda stats: emit("prepared", stats))

    (start, changes, branch), opened = distributed.agreed(first)

    def then():  # the other ranks open what rank 0 wrote; the initial weights are read before the model is wrapped
        data, model = opened if dist.is_main else (ensure_data(cfg, run_dir), build_model(cfg.model, cfg.train.seed))
        initial = start_weights(start, model) if start is not None else None
        base = None
        if cfg.train.tune == "state":  # the frozen weights, loaded now whether the run starts or resumes
            load_into(model, initial, start.source)
            initial, base = None, base_record(cfg.train.init_from, start.weights, start.step, model)
        return data, model, initial, base

    data, model, initial, base = distributed.agreed(then)
    trainer = Trainer(
        cfg, run_dir, model, data.train.tokens, data.val.tokens, data.tokenizer, dist, runtime, guard,
        train_mask=getattr(data.train, "mask", None), val_mask=getattr(data.val, "mask", None), base=base,
    )
    if not resume or not store.had_checkpoints(checkpoints_dir(run_dir)):
        # A fresh run's log starts empty; lines of an earlier attempt that left no checkpoint are kept aside.
        aside = distributed.agreed(trainer.metrics.set_aside)  # rank 0's log
        if aside is not None:
            warnings.warn(
                f"{metrics_path(run_dir)} held steps with no checkpoint behind them; kept as {aside.name}",
                stacklevel=2,
            )
    if resume:
        emit("resumed", trainer.resume(on_skip))
        if changes and trainer.step > 0:
            note = {"event": "resume", "step": trainer.step, "changed": changes}
            distributed.agreed(lambda: trainer.metrics.note(note))
            emit("changed", changes)
        if kept:
            note = {"event": "resume", "step": trainer.step, "init_only": kept}
            distributed.agreed(lambda: trainer.metrics.note(note))
            emit("init_only", kept)
    if trainer.step == 0 and initial is not None:
        trainer.load_initial(initial, start.source)
    if trainer.step == 0 and start is not None:
        emit("initial", start_report(start))
    if trainer.step == 0 and branch is not None:
        trainer.branch_from(branch.path)
        note = {"event": "decay", "from": str(branch.path), "step": trainer.step, "tokens": trainer.tokens_done}
        distributed.agreed(lambda: trainer.metrics.note(note))
        emit("branched", {**note, "decay_tokens": cfg.train.decay_tokens, "shape": cfg.train.decay_shape})
    summary = model_summary(model)
    if trainer.tuned is not None:
        summary["trainable"] = sum(p.numel() for p in trainer.tuned.parameters())
    emit("start", TrainStart(summary, trainer.device, trainer.last_step))
    with GracefulStop() as stop:
        last = trainer.run(on_event, should_stop=lambda: stop.requested)
    result = TrainResult(trainer.step, last, stop.requested or trainer.step < trainer.last_step, trainer.skipped_steps)
    if last is None or result.stopped:
        return result
    if "jsonl" in cfg.train.loggers:  # the plot reads metrics.jsonl, rank 0's
        distributed.agreed(lambda: dist.is_main and plot_losses(metrics_path(run_dir), loss_plot_path(run_dir)))
    result.val = trainer.validate()
    # Every rank samples the same text (a sharded model needs them all); rank 0 shows it.
    result.sample = sample_text(trainer.model, data.tokenizer, cfg.train.seed, cfg.data.reset_at_eod, trainer.tuned)
    return result


def sample_text(model, tokenizer, seed: int, reset_at_eod: bool = False, initial=None) -> str:
    """The end-of-run sample: a continuation of SAMPLE_PROMPT (each end-of-document token starting a
    fresh document where the run trained with data.reset_at_eod), from the tuned state `initial`
    (train.tune=state) or the zero state."""
    prompt = tokenizer.encode(SAMPLE_PROMPT)
    reset = tokenizer.eod_id if reset_at_eod else None
    ids = generate(
        model, prompt, SAMPLE_TOKENS, SAMPLE_TEMPERATURE, SAMPLE_TOP_P, seed, tokenizer.vocab_size, reset_at=reset,
        state=None if initial is None else initial.expand(1),
    )
    return tokenizer.decode(ids)
