"""The training loop: AdamW with RWKV-LM's groups, warmup + cosine by tokens,
gradient accumulation and clipping, periodic validation and checkpoints, and an
exact resume (batches are a pure function of (seed, step); optimizer state and
RNG are restored bit for bit). Data-parallel under torchrun (train/distributed.py):
the global batch of a step is the same for any number of ranks, each rank taking its
rows in micro-batches of at most `train.micro_batch`, so the loss does not depend on N.

Library code: it reports through the `on_event` callback and never prints.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rwkvx_cli.config import Config, ConfigError, config_to_dict
from rwkvx_cli.data.sampler import StreamSampler, WindowSampler, sequential_windows
from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.fsio import atomic_write_text, fsync_file
from rwkvx_cli.models import LM, parameter_groups
from rwkvx_cli.train import checkpoint as ck
from rwkvx_cli.train import distributed
from rwkvx_cli.train.checkpoint import CheckpointError
from rwkvx_cli.train.distributed import SINGLE, DistInfo
from rwkvx_cli.train.schedule import lr_at


@dataclass
class StepMetrics:
    step: int
    tokens: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    elapsed_s: float
    peak_mem_mb: float
    val_loss: float | None = None
    val_bpb: float | None = None
    skipped: bool = False  # this step's loss or gradient was not finite and it was not applied
    skipped_steps: int = 0  # such steps so far in the run


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


def _json_line(m: StepMetrics) -> str:
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(m).items()}
    return json.dumps(row) + "\n"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    except ImportError:  # pragma: no cover - non-POSIX
        return float("nan")


@torch.no_grad()
def evaluate(model: LM, tokens, ctx_len: int, batch: int, max_tokens: int, device, tokenizer) -> dict:
    """Mean next-token loss over consecutive windows of the split (up to max_tokens), and
    bits per byte over exactly the UTF-8 bytes of the tokens it predicted."""
    model.eval()
    total, count = 0.0, 0
    xs, ys = [], []

    def flush():
        nonlocal total, count
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        loss, _ = model.loss(x, y)
        total += loss.item() * y.numel()
        count += y.numel()
        xs.clear()
        ys.clear()

    for x, y in sequential_windows(tokens, ctx_len):
        if xs and x.shape[1] != xs[0].shape[0]:
            flush()  # the last window is shorter: its own batch
        xs.append(x[0])
        ys.append(y[0])
        if len(xs) == batch:
            flush()
        if count + len(xs) * ctx_len >= max_tokens:
            break
    if xs:
        flush()
    model.train()
    loss = total / max(count, 1)
    arr = tokens.tokens if hasattr(tokens, "tokens") else tokens
    n_bytes = len(tokenizer.decode(np.asarray(arr[1 : count + 1]).tolist()).encode("utf-8"))
    return {
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
        "bpb": total / math.log(2) / max(n_bytes, 1),
        "tokens": count,
    }


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
        device: torch.device | None = None,
    ):
        self.cfg, self.run_dir, self.dist = cfg, Path(run_dir), dist
        self.device = device if device is not None else pick_device(cfg.train.device)
        self.model = model.to(self.device)
        self.train_tokens, self.val_tokens = train_tokens, val_tokens
        self.tokenizer = tokenizer
        t = cfg.train
        self.global_rows = t.micro_batch * t.grad_accum
        self.micro = micro_slices(self.global_rows, dist.world_size, t.micro_batch)
        # Groups are chosen on the plain parameters, by name; DDP wraps the model, FSDP shards it
        # in place (new parameter objects), and the optimizer must hold the final ones.
        names = {id(p): n for n, p in self.model.named_parameters()}
        groups = [
            {**g, "params": [names[id(p)] for p in g["params"]]}
            for g in parameter_groups(self.model, t.lr, t.weight_decay)
        ]
        self.wrapped = distributed.wrap(self.model, t.distributed, self.device)
        params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            [{**g, "params": [params[n] for n in g["params"]]} for g in groups], lr=t.lr, betas=t.betas, eps=t.eps
        )
        sampler = StreamSampler if t.tbptt else WindowSampler
        self.sampler = sampler(train_tokens, t.ctx_len, self.global_rows, t.seed)
        # TBPTT: the detached recurrent state each micro-batch carries into the next step.
        self.carry: list[list | None] = [None] * len(self.micro)
        self.step = 0
        self.skipped_steps = 0
        self.nonfinite_in_row = 0
        self.ckpt_root = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.forward = torch.compile(self.wrapped) if t.compile else self.wrapped

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write a checkpoint (rank 0; under FSDP every rank takes part in gathering it)."""
        weights, optim_state = distributed.full_state(self.model, self.optimizer)
        carry = self._carry_tensors()
        if not self.dist.is_main:
            return None
        meta = {
            "config": config_to_dict(self.cfg),
            "torch_rng": torch.get_rng_state().tolist(),
            "world_size": self.dist.world_size,
            "skipped_steps": self.skipped_steps,
            "nonfinite_in_row": self.nonfinite_in_row,
        }
        return ck.save_checkpoint(
            self.ckpt_root, self.step, weights, optim_state, meta, self.cfg.train.keep_last, carry
        )

    def _carry_tensors(self) -> dict[str, torch.Tensor]:
        """The TBPTT carry as global-batch tensors `carry.<block>.<field>`, so that a run
        resumes with any number of ranks."""
        if any(c is None for c in self.carry):
            return {}
        out = {}
        for i, template in enumerate(self.carry[0]):
            for name in template or {}:
                local = torch.cat([c[i][name] for c in self.carry])
                out[f"carry.{i}.{name}"] = distributed.gather_rows(local, self.dist.world_size)
        return out

    def _restore_carry(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        by_key: dict[tuple[int, str], torch.Tensor] = {}
        old: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        try:
            for key, val in tensors.items():
                parts = key.split(".")
                if len(parts) == 4 and parts[2].isdigit():  # the first format: carry.<micro>.<block>.<field>
                    old.setdefault((int(parts[2]), parts[3]), {})[int(parts[1])] = val
                else:
                    by_key[int(parts[1]), ".".join(parts[2:])] = val
        except (ValueError, IndexError):
            raise CheckpointError(f"{source}: unexpected tensor names in extra.safetensors") from None
        for key, parts in old.items():
            by_key[key] = torch.cat([parts[m] for m in sorted(parts)])
        if not by_key or not self.cfg.train.tbptt:
            return  # a run resumed without truncated BPTT starts each window from a zero state
        templates = self.model.empty_state(self.global_rows, "meta")
        wanted = {(i, name): t for i, tmpl in enumerate(templates) for name, t in (tmpl or {}).items()}
        for key, val in by_key.items():
            want = wanted.get(key)
            if want is None or val.shape != want.shape or not val.is_floating_point():
                raise CheckpointError(
                    f"{source}: the TBPTT carry {key[1]!r} of block {key[0]} does not fit this run "
                    f"({self.global_rows} sequences per step, {len(templates)} blocks)"
                )
        if set(by_key) != set(wanted):
            raise CheckpointError(f"{source}: the TBPTT carry is incomplete")
        for c, rows in enumerate(self.micro):
            self.carry[c] = [
                None
                if tmpl is None
                else {name: distributed.local_rows(by_key[i, name], self.dist)[rows].to(self.device) for name in tmpl}
                for i, tmpl in enumerate(templates)
            ]

    def resume(self, on_skip=None) -> int:
        """Load the newest good checkpoint; returns its step (0 if none). A damaged newer one is
        reported to `on_skip(path, reason)`, set aside (renamed corrupt-step_...), and skipped."""
        found = None
        if self.dist.is_main:
            found = ck.latest_good(self.ckpt_root, on_skip, quarantine=True)
        name = distributed.broadcast(found[0].name if found else None)
        if name is None:
            if self.dist.is_main:
                self._truncate_metrics(0)  # steps logged before a crash that left no checkpoint
            return 0
        path = self.ckpt_root / name
        meta = found[1] if found else ck.verify(path)
        weights = ck.load_weights(path)
        own = self.model_shapes()
        problems = ck.mismatch(own, weights)
        if problems:
            raise CheckpointError(f"{path} does not match the model: {problems}")
        ck.check_finite(weights, str(path))
        optim_state = ck.load_optimizer_state(path, meta)
        if optim_state is not None:
            shapes = [own[n].shape for n in distributed.param_names(self.model, self.optimizer)]
            ck.check_optimizer_state(optim_state, self.optimizer.param_groups, shapes, str(path))
        try:
            rng = torch.tensor(meta.get("torch_rng", torch.get_rng_state().tolist()), dtype=torch.uint8)
            skipped, in_row = int(meta.get("skipped_steps", 0)), int(meta.get("nonfinite_in_row", 0))
            distributed.load_full_state(self.model, self.optimizer, weights, optim_state)
            torch.set_rng_state(rng)
        except (ValueError, RuntimeError, KeyError, TypeError, OverflowError) as e:
            raise CheckpointError(f"{path} cannot be loaded: {e}") from None
        self._restore_carry(ck.load_extra(path), str(path))
        self.step, self.skipped_steps, self.nonfinite_in_row = meta["step"], skipped, in_row
        if self.dist.is_main:
            self._truncate_metrics(self.step)
        return self.step

    def model_shapes(self) -> dict[str, torch.Tensor]:
        """The model's state by name, with full shapes (a sharded DTensor reports its global shape)."""
        return self.model.state_dict()

    def load_initial(self, source: str) -> None:
        """Start from weights elsewhere (train.init_from); reports what differs from this model."""
        weights = ck.load_weights_file(source)
        problems = ck.mismatch(self.model_shapes(), weights)
        if problems:
            raise CheckpointError(f"{source} does not match the model: {problems}")
        ck.check_finite(weights, source)
        distributed.load_full_state(self.model, None, weights, None)

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric lines logged after the checkpoint we resume from, and a line torn by a crash."""
        if not self.metrics_path.exists():
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash: its step is after the checkpoint
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                keep.append(line + "\n")
        atomic_write_text(self.metrics_path, "".join(keep))

    # -- the loop ---------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float, float, bool]:
        """One optimizer step; returns (loss, lr, grad norm, applied). A step whose loss or gradient
        norm is not finite is not applied (train.nonfinite=skip) or raises NonFiniteError."""
        t = self.cfg.train
        tokens_done = self.step * self.cfg.tokens_per_step
        lr = lr_at(tokens_done, t.lr, t.lr_final, t.warmup_tokens, t.tokens)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["lr_scale"]
        x, y = self.sampler.batch(self.step, self.dist.rank, self.dist.world_size)
        x, y = x.to(self.device), y.to(self.device)
        rank_rows = x.shape[0]
        total = torch.zeros((), device=self.device)
        for micro, rows in enumerate(self.micro):
            # Each micro-batch weighs by its share of the rank's rows; DDP/FSDP then average the
            # ranks: the gradient of the mean loss over the global batch.
            weight = (rows.stop - rows.start) / rank_rows
            last = micro == len(self.micro) - 1
            with distributed.grad_sync(self.wrapped, t.distributed, sync=last):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                    logits, state = self.forward(x[rows], self.carry[micro])
                if t.tbptt:
                    self.carry[micro] = [None if s is None else {k: v.detach() for k, v in s.items()} for s in state]
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y[rows].flatten())
                (loss * weight).backward()
            total += loss.detach() * weight
        total = distributed.sum_all(total) / self.dist.world_size
        norm = distributed.grad_norm(self.model, t.grad_clip)
        loss_value, norm_value = torch.stack([total, norm.to(total.dtype)]).tolist()  # one host sync
        applied = math.isfinite(loss_value) and math.isfinite(norm_value)
        if applied:
            self.optimizer.step()
            self.nonfinite_in_row = 0
        else:
            self._nonfinite(loss_value, norm_value)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_value, lr, norm_value, applied

    def _nonfinite(self, loss: float, norm: float) -> None:
        t = self.cfg.train
        self.skipped_steps += 1
        self.nonfinite_in_row += 1
        what = f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} at step {self.step + 1}"
        values = f"(loss {loss}, gradient norm {norm}); the model was not updated"
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

    def run(self, on_event: Callable[[str, StepMetrics], None] | None = None, should_stop=lambda: False) -> StepMetrics:
        """Train to the end (or until `should_stop()` is true on any rank: then checkpoint and return).
        Events: "step", "skipped" (a non-finite step that was not applied), "checkpoint"."""
        cfg, t = self.cfg, self.cfg.train
        total_steps = cfg.total_steps
        start, start_step = time.perf_counter(), self.step
        last = None
        log = open(self.metrics_path, "a") if self.dist.is_main else None
        try:
            while self.step < total_steps:
                loss, lr, norm, applied = self.train_step()
                elapsed = time.perf_counter() - start
                done = (self.step - start_step) * cfg.tokens_per_step
                last = StepMetrics(
                    step=self.step,
                    tokens=self.step * cfg.tokens_per_step,
                    loss=loss,
                    lr=lr,
                    grad_norm=norm,
                    tokens_per_s=done / max(elapsed, 1e-9),
                    elapsed_s=elapsed,
                    peak_mem_mb=peak_memory_mb(self.device),
                    skipped=not applied,
                    skipped_steps=self.skipped_steps,
                )
                if self.step % t.eval_interval == 0 or self.step == total_steps:
                    ev = self.validate()
                    last.val_loss, last.val_bpb = ev["loss"], ev["bpb"]
                if log is not None:
                    log.write(_json_line(last))
                    log.flush()
                if on_event:
                    on_event("step" if applied else "skipped", last)
                stopping = distributed.any_rank(should_stop(), self.device)
                if self.step % t.ckpt_interval == 0 or self.step == total_steps or stopping:
                    if log is not None:
                        fsync_file(log)  # the metrics up to a checkpoint survive a power loss with it
                    self.save()
                    if on_event:
                        on_event("checkpoint", last)
                if stopping:
                    break
        finally:
            if log is not None:
                log.close()
        return last

    def validate(self) -> dict:
        """Validation loss and bits per byte (every rank computes the same; FSDP needs them all)."""
        t = self.cfg.train
        return evaluate(
            self.model, self.val_tokens, t.ctx_len, t.micro_batch, t.eval_tokens, self.device, self.tokenizer
        )
