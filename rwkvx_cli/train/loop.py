"""The training loop: AdamW with RWKV-LM's groups, warmup + cosine by tokens,
gradient accumulation and clipping, periodic validation, checkpoints (when, and an
exact resume: checkpoints/manager.py) and the metrics log (train/metrics.py). Batches
are a pure function of (seed, step). Data-parallel under torchrun (train/distributed.py):
the global batch of a step is the same for any number of ranks, each rank taking its
rows in micro-batches of at most `train.micro_batch`, so the loss does not depend on N.
With loss masks (conversations) the step's loss is the sum of the cross-entropy of every
target that carries loss, in every micro-batch and rank, over their global count
(docs/training.md#loss-masks).

Library code: it reports through the `on_event` callback and never prints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rwkvx_cli.checkpoints.manager import CheckpointManager
from rwkvx_cli.checkpoints.ranks import sharded
from rwkvx_cli.config import Config, ConfigError
from rwkvx_cli.data.sampler import DocumentSampler, EpochSampler, MixtureSampler, StreamSampler, WindowSampler
from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.evaluation.validation import evaluate, evaluate_documents
from rwkvx_cli.models import LM, document_starts, parameter_groups
from rwkvx_cli.models import optimizer as optimizers
from rwkvx_cli.models.losses import micro_batch_loss, uses_l2wrap
from rwkvx_cli.models.state import InitialState
from rwkvx_cli.models.summary import model_summary
from rwkvx_cli.runs import runtime as rt
from rwkvx_cli.runs.layout import checkpoints_dir, metrics_path
from rwkvx_cli.train import distributed
from rwkvx_cli.train.distributed import SINGLE, DistInfo
from rwkvx_cli.train.loggers import Sinks, mfu_pct
from rwkvx_cli.train.metrics import MetricsLog, StepMetrics
from rwkvx_cli.train.profiling import StepProfiler
from rwkvx_cli.train.schedule import lr_at


class NonFiniteError(RwkvxError):
    """A non-finite loss or gradient under train.nonfinite=stop (or past nonfinite_limit)."""


def micro_slices(global_rows: int, world_size: int, micro_batch: int) -> list[slice]:
    """This rank's rows of a step (global_rows / world_size) cut into micro-batches of at most
    micro_batch: with more ranks, each rank accumulates fewer micro-batches."""
    if global_rows % world_size:
        raise ConfigError(
            f"train.micro_batch x train.grad_accum = {global_rows} sequences per step do not split evenly "
            f"over {world_size} processes"
        )
    rows = global_rows // world_size
    size = min(micro_batch, rows)
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    except ImportError:  # pragma: no cover - non-POSIX
        return float("nan")


def make_sampler(cfg: Config, train_tokens, global_rows: int, masks=None, eod_id: int = 0):
    """The training batches: consecutive streams under TBPTT; a weighted mixture for data.mix
    (`train_tokens` then lists its sources' tokens, `masks` their masks); else one pass per epoch
    (train.sampler=epoch), random windows with replacement (random), or rows that start at documents
    (documents: `eod_id` ends one). Each is a pure function of (seed, step). `masks`: the training
    tokens' loss masks, or None."""
    t = cfg.train
    if t.sampler == "documents":
        return DocumentSampler(train_tokens, eod_id, t.ctx_len, global_rows, t.seed, masks=masks)
    if t.tbptt:
        return StreamSampler(train_tokens, t.ctx_len, global_rows, t.seed, masks=masks)
    if cfg.data.mix is not None:
        weights = [s.weight for s in cfg.data.mix]
        return MixtureSampler(train_tokens, weights, t.ctx_len, global_rows, t.seed, masks=masks)
    sampler = EpochSampler if t.sampler == "epoch" else WindowSampler
    return sampler(train_tokens, t.ctx_len, global_rows, t.seed, masks=masks)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        model: LM,
        train_tokens,
        val_tokens,
        tokenizer,
        dist: DistInfo = SINGLE,
        runtime: rt.Runtime | None = None,
        guard: Callable[[], None] | None = None,
        *,
        train_mask=None,
        val_mask=None,
        base: dict | None = None,
    ):
        """`runtime`: the command's resolved device and precision (None: resolve train.device and
        train.precision here, for a Trainer built outside `rwkvx train`). `guard()`: called before
        each checkpoint is written; raises when the run directory is no longer this process's.
        `train_mask`, `val_mask`: the splits' loss masks (a byte per token; for data.mix a list,
        one per source), or None: every target carries loss. `base`: with train.tune=state, the record of
        the frozen weights `model` holds (runs/tuned.py's base_record), which its checkpoints name."""
        self.cfg, self.run_dir, self.dist = cfg, Path(run_dir), dist
        self.runtime = runtime if runtime is not None else rt.resolve(cfg.train.device, cfg.train.precision)
        self.model = model.to(self.device)
        self.train_tokens, self.val_tokens = train_tokens, val_tokens
        self.val_mask = val_mask
        self.tokenizer = tokenizer
        t = cfg.train
        self.global_rows = t.micro_batch * t.grad_accum
        self.micro = micro_slices(self.global_rows, dist.world_size, t.micro_batch)
        # State tuning (train.tune=state): the weights frozen, the initial state the one thing trained.
        self.tuned = InitialState(self.model, t.tune_shifts).to(self.device) if t.tune == "state" else None
        if self.tuned is not None:
            self.model.requires_grad_(False)
        self.trainable = self.tuned if self.tuned is not None else self.model
        # Groups are chosen on the plain parameters, by name; DDP wraps the model, FSDP shards it
        # in place (new parameter objects), and the optimizer must hold the final ones.
        names = {id(p): n for n, p in self.trainable.named_parameters()}
        if self.tuned is None:
            chosen = parameter_groups(self.model, t.lr, t.weight_decay, t.optimizer == "muon", t.muon_lora)
        else:  # AdamW without weight decay: decay would pull the state back to zero, the frozen model's own
            chosen = [{"params": list(self.tuned.parameters()), "lr_scale": 1.0, "weight_decay": 0.0, "name": "state"}]
        groups = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in chosen]
        self.runtime.apply()
        self.wrapped = distributed.wrap(
            self.model, t.distributed, self.device, self.precision, trains=self.tuned is None
        )
        params = dict(self.trainable.named_parameters())
        self.optimizer = optimizers.build(
            [{**g, "params": [params[n] for n in g["params"]]} for g in groups], t, sharded(self.trainable)
        )
        self.sampler = make_sampler(cfg, train_tokens, self.global_rows, train_mask, tokenizer.eod_id)
        self.loss_tokens: int | None = None  # the last step's targets that carry loss (with masks)
        # TBPTT: the detached recurrent state each micro-batch carries into the next step.
        self.carry: list[list | None] = [None] * len(self.micro)
        self.step = 0
        self.tokens_done = 0  # the LR schedule's position: steps x tokens per step, across resumes
        self.skipped_steps = 0
        self.nonfinite_in_row = 0
        self.metrics = MetricsLog(metrics_path(self.run_dir), enabled=dist.is_main and "jsonl" in t.loggers)
        self.sinks = Sinks(cfg, self.run_dir, self.metrics, is_main=dist.is_main)  # train.loggers
        self.checkpoints = CheckpointManager(
            checkpoints_dir(self.run_dir),
            cfg,
            self.trainable,  # state tuning: the state alone, the frozen weights named by `base`
            self.optimizer,
            self.micro,
            dist,
            self.device,
            before_save=self.sinks.sync,
            guard=guard,
            base=base,
        )
        self.forward = torch.compile(self.wrapped) if t.compile else self.wrapped
        self.model.grad_checkpointing = t.grad_cp
        self.l2wrap = uses_l2wrap(t.l2wrap, self.model.kinds)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def precision(self) -> str:
        return self.runtime.precision

    # -- checkpoints (what and when: checkpoints/manager.py) -----------------------------------------
    def save(self) -> Path | None:
        """Checkpoint now (full: rank 0 writes, under FSDP every rank takes part in gathering it;
        sharded: every rank writes its own rows)."""
        return self.checkpoints.save(self.step, self.carry, **self._counters())

    def _counters(self) -> dict:
        """What a checkpoint keeps besides the tensors: the schedule's position and the non-finite counts."""
        return dict(tokens=self.tokens_done, skipped_steps=self.skipped_steps, nonfinite_in_row=self.nonfinite_in_row)

    @property
    def last_step(self) -> int:
        """The step the run ends at: this one plus the whole steps the tokens still to train make (a
        fresh run takes at least one)."""
        left = (self.cfg.train.tokens - self.tokens_done) // self.cfg.tokens_per_step
        return self.step + (max(1, left) if self.step == 0 else max(0, left))

    def resume(self, on_skip=None) -> int:
        """Continue from the newest good checkpoint; returns its step (0 if none). A damaged newer
        one is reported to `on_skip(path, reason)`, set aside, and skipped."""
        restored = self.checkpoints.load_latest(on_skip)
        if restored is not None:
            self._continue(restored)
        # Rank 0's log, agreed: also the steps logged before a crash that left no checkpoint.
        distributed.agreed(lambda: self.metrics.truncate(self.step))
        return self.step

    def branch_from(self, path: Path) -> int:
        """Continue another run's checkpoint at `path` here (train.decay_from); returns its step."""
        self._continue(self.checkpoints.load_from(path))
        return self.step

    def _continue(self, restored) -> None:
        self.step, self.tokens_done, self.skipped_steps = restored.step, restored.tokens, restored.skipped_steps
        self.nonfinite_in_row = restored.nonfinite_in_row
        if restored.carry is not None:
            self.carry = restored.carry

    def load_initial(self, weights: dict, source: str) -> None:
        """Start from weights elsewhere (train.init_from, read by runs/initial.py); not with state tuning,
        whose frozen weights the model holds from the start."""
        self.checkpoints.load_initial(weights, source)

    # -- the loop ---------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float, float, bool]:
        """One optimizer step; returns (loss, lr, grad norm, applied). A step whose loss or gradient
        norm is not finite is not applied (train.nonfinite=skip) or raises NonFiniteError."""
        t = self.cfg.train
        lr = lr_at(self.tokens_done, t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["lr_scale"]
        x, y = self.sampler.batch(self.step, self.dist.rank, self.dist.world_size)
        x, y = x.to(self.device), y.to(self.device)
        rank_rows = x.shape[0]
        weights = self._target_weights()
        total = torch.zeros((), device=self.device)
        for micro, rows in enumerate(self.micro):
            # Each micro-batch weighs by its share of the rank's rows; DDP/FSDP then average the
            # ranks: the gradient of the mean loss over the global batch. With masks the targets'
            # weights say it all (_target_weights).
            weight = (rows.stop - rows.start) / rank_rows if weights is None else 1.0
            last = micro == len(self.micro) - 1
            with distributed.grad_sync(self.wrapped, t.distributed, sync=last):
                with self.runtime.autocast():
                    w = None if weights is None else weights[rows]
                    start = self.carry[micro] if self.tuned is None else self.tuned.expand(rows.stop - rows.start)
                    loss, state = self._loss(x[rows], y[rows], start, w)
                if t.tbptt:
                    self.carry[micro] = self.model.carried(state)
                (loss * weight if weights is None else loss).backward()
            total += loss.detach() * weight
        total = distributed.sum_all(total) / self.dist.world_size
        if self.tuned is not None:  # outside DDP and FSDP (the frozen model has nothing for them to reduce)
            distributed.average_grads(self.tuned)
        norm = distributed.clip_grad_norm_(self.trainable, t.grad_clip)
        loss_value, norm_value = torch.stack([total, norm.to(total.dtype)]).tolist()  # one host sync
        if self.loss_tokens == 0:
            loss_value = math.nan  # a mean over no target: not applied, as a non-finite step
        applied = math.isfinite(loss_value) and math.isfinite(norm_value)
        if applied:
            self.optimizer.step()
            self.nonfinite_in_row = 0
        else:
            self._nonfinite(loss_value, norm_value)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_done += self.cfg.tokens_per_step
        return loss_value, lr, norm_value, applied

    def _target_weights(self) -> torch.Tensor | None:
        """With loss masks, each of this rank's targets' weight in the step's loss, [rows, ctx_len]:
        N / D where it carries loss and 0 elsewhere, D the count of such targets in the whole global
        batch (every rank reads it from the sampler alike: no communication) and N the ranks, whose
        gradients DDP and FSDP average. So the step's gradient is that of Σ CE over every target
        that carries loss / D, whatever the micro-batches and ranks; a step with D = 0 is not applied.
        None without masks (the loss is today's mean)."""
        got = self.sampler.target_masks(self.step, self.dist.rank, self.dist.world_size)
        if got is None:
            return None
        mask, self.loss_tokens = got
        scale = self.dist.world_size / self.loss_tokens if self.loss_tokens else 0.0
        return mask.to(self.device, torch.float32) * scale

    def _loss(self, x, y, carry, weights=None):
        t = self.cfg.train
        starts = document_starts(x, self.tokenizer.eod_id if self.cfg.data.reset_at_eod else None)
        return micro_batch_loss(self.forward, x, y, carry, t.head, self.l2wrap, t.chunk_len, starts, weights)

    def _nonfinite(self, loss: float, norm: float) -> None:
        t = self.cfg.train
        self.skipped_steps += 1
        self.nonfinite_in_row += 1
        what = f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} at step {self.step + 1}"
        values = f"(loss {loss}, gradient norm {norm}); the model was not updated"
        if self.loss_tokens == 0:
            what = f"no target of step {self.step + 1}'s batch carries loss (the data's loss masks)"
            values = "(its loss, a mean over none, is not defined); the model was not updated"
            if t.nonfinite == "stop":
                raise NonFiniteError(
                    f"{what} {values}. Train on longer windows (train.ctx_len) or more rows per step, or set "
                    "train.nonfinite=skip"
                )
        if t.nonfinite == "stop":
            raise NonFiniteError(
                f"{what} {values}. Resume from the last checkpoint with a lower train.lr, or set train.nonfinite=skip"
            )
        if self.nonfinite_in_row >= t.nonfinite_limit:
            raise NonFiniteError(
                f"{what} {values}: {self.nonfinite_in_row} non-finite steps in a row "
                f"(train.nonfinite_limit={t.nonfinite_limit}), the run is diverging; lower train.lr and resume "
                "from the last checkpoint"
            )
        self.carry = [None] * len(self.micro)  # a carried state from this step may hold NaNs

    def run(
        self, on_event: Callable[[str, object], None] | None = None, should_stop=lambda: False
    ) -> StepMetrics | None:
        """Train to the end (or until `should_stop()` is true on any rank: then checkpoint and return).
        Events: "step" and "skipped" (a non-finite step that was not applied), with the StepMetrics;
        "checkpoint", with the step of a checkpoint now on disk (with train.async_checkpoint, once its
        writer is done); "profile", with the path of the trace train.profile_steps asked for, once
        written. Returns the last step's metrics; None when the run was already complete. Returns only
        once every checkpoint is written (after an error too; then without raising the writer's)."""
        try:
            last = self._run(on_event or (lambda kind, payload: None), should_stop)
            self.checkpoints.wait()  # the last checkpoint, or a stop request's, may still be in flight
            self._report_checkpoints(on_event)
            return last
        finally:
            self.checkpoints.close()

    def _report_checkpoints(self, on_event) -> None:
        for step in self.checkpoints.take_committed():
            if on_event:
                on_event("checkpoint", step)

    def _run(self, on_event: Callable[[str, object], None], should_stop) -> StepMetrics | None:
        cfg, t = self.cfg, self.cfg.train
        total_steps = self.last_step
        if self.step >= total_steps:
            return None  # already complete: no sink opened (a wandb run), no probe
        # MFU as `rwkvx bench --model` computes it; the matmul peak is probed once, before timing starts.
        peak = rt.matmul_peak(self.device, self.precision)
        flops_per_token = model_summary(self.model)["train_flops_per_token"]
        profiler = StepProfiler(self.run_dir, t.profile_steps, self.device, self.dist.rank, self.dist.world_size)
        start, start_step = time.perf_counter(), self.step
        last = None
        self.sinks.start_step = self.step
        with self.sinks, profiler:
            while self.step < total_steps:
                with profiler.step(self.step + 1):
                    loss, lr, norm, applied = self.train_step()
                elapsed = time.perf_counter() - start
                done = (self.step - start_step) * cfg.tokens_per_step
                last = StepMetrics(
                    step=self.step,
                    tokens=self.tokens_done,
                    loss=loss,
                    lr=lr,
                    grad_norm=norm,
                    tokens_per_s=done / max(elapsed, 1e-9),
                    elapsed_s=elapsed,
                    peak_mem_mb=peak_memory_mb(self.device),
                    skipped=not applied,
                    skipped_steps=self.skipped_steps,
                    epoch=self.sampler.epoch(self.step - 1),
                )
                last.mfu_pct = mfu_pct(last.tokens_per_s, flops_per_token, peak, self.dist.world_size)
                if self.step % t.eval_interval == 0 or self.step == total_steps:
                    ev = self.validate()
                    last.val_loss, last.val_bpb = ev["loss"], ev["bpb"]
                self.sinks.log(last)
                on_event("step" if applied else "skipped", last)
                if (trace := profiler.take_written()) is not None:
                    on_event("profile", trace)
                # One all-reduce agrees on a stop request and on whether a background save is still being
                # written anywhere; once it is done everywhere, its outcome is taken (a failure stops the run).
                stopping, writing = distributed.any_rank(should_stop(), self.checkpoints.writing, device=self.device)
                if not writing:
                    self.checkpoints.wait()
                self.checkpoints.maybe_save(self.step, total_steps, self.carry, force=stopping, **self._counters())
                self._report_checkpoints(on_event)
                if stopping:
                    break
        if (trace := profiler.take_written()) is not None:  # the loop ended inside the range
            on_event("profile", trace)
        return last

    def validate(self) -> dict:
        """Validation loss and bits per byte (every rank computes the same; FSDP needs them all); with
        train.sampler=documents every validation document read alone from its start, from the tuned state
        (train.tune=state) or the zero state, as training reads its rows."""
        t = self.cfg.train
        if t.sampler == "documents":
            figures = (t.ctx_len, t.micro_batch, t.eval_tokens, self.tokenizer, self.runtime)
            return evaluate_documents(self.model, self.val_tokens, *figures, masks=self.val_mask, initial=self.tuned)
        return evaluate(
            self.model,
            self.val_tokens,
            t.ctx_len,
            t.micro_batch,
            t.eval_tokens,
            self.tokenizer,
            self.runtime,
            reset_at_eod=self.cfg.data.reset_at_eod,
            masks=self.val_mask,
        )
