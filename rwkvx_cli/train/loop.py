"""The training loop: AdamW with RWKV-LM's groups, warmup + cosine by tokens,
gradient accumulation and clipping, periodic validation and checkpoints, and an
exact resume (batches are a pure function of (seed, step); optimizer state and
RNG are restored bit for bit).

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

from rwkvx_cli.config import Config, config_to_dict
from rwkvx_cli.data.sampler import StreamSampler, WindowSampler, sequential_windows
from rwkvx_cli.models import LM, parameter_groups
from rwkvx_cli.models.rwkv7 import BlockState
from rwkvx_cli.train import checkpoint as ck
from rwkvx_cli.train.schedule import lr_at

CARRY_FIELDS = ("att_shift", "wkv", "ffn_shift")


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
    def __init__(self, cfg: Config, run_dir: Path, model: LM, train_tokens, val_tokens, tokenizer):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.device = pick_device(cfg.train.device)
        self.model = model.to(self.device)
        self.train_tokens, self.val_tokens = train_tokens, val_tokens
        self.tokenizer = tokenizer
        t = cfg.train
        groups = parameter_groups(model, t.lr, t.weight_decay)
        self.optimizer = torch.optim.AdamW(
            [{k: v for k, v in g.items()} for g in groups], lr=t.lr, betas=t.betas, eps=t.eps
        )
        sampler = StreamSampler if t.tbptt else WindowSampler
        self.sampler = sampler(train_tokens, t.ctx_len, t.micro_batch * t.grad_accum, t.seed)
        # TBPTT: the detached recurrent state each micro-batch carries into the next step.
        self.carry: list[list | None] = [None] * t.grad_accum
        self.step = 0
        self.ckpt_root = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.forward = torch.compile(model) if t.compile else model

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self) -> Path:
        meta = {
            "config": config_to_dict(self.cfg),
            "torch_rng": torch.get_rng_state().tolist(),
        }
        return ck.save_checkpoint(
            self.ckpt_root, self.step, self.model, self.optimizer, meta, self.cfg.train.keep_last, self._carry_tensors()
        )

    def _carry_tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"carry.{m}.{i}.{field}": getattr(s, field)
            for m, state in enumerate(self.carry)
            for i, s in enumerate(state or [])
            if s is not None
            for field in CARRY_FIELDS
        }

    def _restore_carry(self, tensors: dict[str, torch.Tensor]) -> None:
        for m in range(len(self.carry)):
            if any(k.startswith(f"carry.{m}.") for k in tensors):
                self.carry[m] = [
                    BlockState(*(tensors[f"carry.{m}.{i}.{f}"].to(self.device) for f in CARRY_FIELDS))
                    if f"carry.{m}.{i}.wkv" in tensors
                    else None
                    for i in range(len(self.model.blocks))
                ]

    def resume(self) -> int:
        """Load the newest complete checkpoint; returns its step (0 if none)."""
        found = ck.list_checkpoints(self.ckpt_root)
        if not found:
            return 0
        path = found[-1]
        meta = ck.read_meta(path)
        ck.load_into(self.model, ck.load_weights(path), str(path))
        if "optimizer" in meta:
            ck.load_optimizer(path, self.optimizer, meta)
        torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
        self._restore_carry(ck.load_extra(path))
        self.step = int(meta["step"])
        self._truncate_metrics(self.step)
        return self.step

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric lines logged after the checkpoint we resume from."""
        if not self.metrics_path.exists():
            return
        keep = [line for line in self.metrics_path.read_text().splitlines() if json.loads(line)["step"] <= step]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(self.metrics_path)

    # -- the loop ---------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float, float]:
        t = self.cfg.train
        tokens_done = self.step * self.cfg.tokens_per_step
        lr = lr_at(tokens_done, t.lr, t.lr_final, t.warmup_tokens, t.tokens)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["lr_scale"]
        x, y = self.sampler.batch(self.step)
        x, y = x.to(self.device), y.to(self.device)
        total = torch.zeros((), device=self.device)
        for micro in range(t.grad_accum):
            rows = slice(micro * t.micro_batch, (micro + 1) * t.micro_batch)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                logits, state = self.forward(x[rows], self.carry[micro])
            if t.tbptt:
                self.carry[micro] = [
                    BlockState(*(getattr(s, f).detach() for f in CARRY_FIELDS)) if s is not None else None
                    for s in state
                ]
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y[rows].flatten())
            (loss / t.grad_accum).backward()
            total += loss.detach() / t.grad_accum  # one host sync per step, not per micro-batch
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total.item(), lr, float(norm)

    def run(self, on_event: Callable[[str, StepMetrics], None] | None = None, should_stop=lambda: False) -> StepMetrics:
        cfg, t = self.cfg, self.cfg.train
        total_steps = cfg.total_steps
        start, start_step = time.perf_counter(), self.step
        last = None
        with open(self.metrics_path, "a") as log:
            while self.step < total_steps:
                loss, lr, norm = self.train_step()
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
                )
                if self.step % t.eval_interval == 0 or self.step == total_steps:
                    ev = self.validate()
                    last.val_loss, last.val_bpb = ev["loss"], ev["bpb"]
                log.write(json.dumps(asdict(last)) + "\n")
                log.flush()
                if on_event:
                    on_event("step", last)
                stopping = should_stop()
                if self.step % t.ckpt_interval == 0 or self.step == total_steps or stopping:
                    self.save()
                    if on_event:
                        on_event("checkpoint", last)
                if stopping:
                    break
        return last

    def validate(self) -> dict:
        t = self.cfg.train
        return evaluate(
            self.model, self.val_tokens, t.ctx_len, t.micro_batch, t.eval_tokens, self.device, self.tokenizer
        )
