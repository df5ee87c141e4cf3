"""The trainer's checkpointer: what a training run checkpoints, and when; resuming from the newest good
checkpoint. The trainer (train/loop.py) hands it the config, the model, the optimizer and its rank
layout, and calls `maybe_save` and `load_latest`; it reaches into no checkpoint file itself.

A checkpoint holds the weights and optimizer state, the torch RNG, the non-finite step
counters and, with truncated BPTT, the recurrent state each micro-batch carries into the
next step. With those the run resumes bit for bit: batches are a pure function of (seed,
step). The files themselves (safetensors, meta.json with checksums, atomic renames,
keep-last) are the store's (store.py): `train.checkpoint_format: full` gathers the
weights and optimizer state and rank 0 writes them (full.py); `sharded` has every rank write its own
rows (sharded.py). A run resumes from either format, whatever the setting says.

With `train.async_checkpoint` a save is staged, then written in the background: the loop waits
while the state (and the TBPTT carry, meta.json's RNG and counters) is copied into CPU buffers
(background.py), then goes on while a writer thread writes the copy, in either format. The
thread's agreements between ranks (sharded) go over a gloo process group of its own, never
interleaved with training's collectives. At most one save is in flight: the next one, the end
of the run and a stop request wait for it. Whether it is done is agreed between ranks once per
step (with the stop request: the same all-reduce); a failed write then stops every rank with one
CheckpointError, the earlier checkpoints intact. A kill at any moment leaves at most a
`.tmp-step_*` directory behind, which resuming never reads and the next save removes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from rwkvx_cli.checkpoints import find, full, ranks, sharded, store
from rwkvx_cli.checkpoints.background import Staging, Writer, writer_group
from rwkvx_cli.checkpoints.fit import check_finite, mismatch
from rwkvx_cli.config import Config, ConfigError, config_to_dict
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.models.optimizer import IMPLEMENTATION

# The TBPTT carry: per micro-batch, per block, the block's state (a dict of tensors), or None
# for a micro-batch that starts from a zero state (and for MoBA blocks, which keep none).
Carry = list[list[dict[str, torch.Tensor] | None] | None]


class Ranks(Protocol):
    """This process among the run's ranks (train/distributed.py's DistInfo)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_main(self) -> bool: ...


@dataclass
class Restored:
    """What a resumed run continues from (the weights and optimizer are loaded in place)."""

    step: int
    tokens: int  # trained so far (the LR schedule's position)
    skipped_steps: int
    nonfinite_in_row: int
    carry: Carry | None  # None: every micro-batch starts from a zero state


class CheckpointManager:
    """Saves every `train.ckpt_interval` steps and at the last step (or when forced, on a stop
    request), keeping the newest `train.keep_last`; in the full format every rank takes part in
    gathering the state (under FSDP) and rank 0 writes it, in the sharded format every rank writes
    its own rows. `before_save()` runs first: the trainer fsyncs its metrics there, so that a
    checkpoint on disk never lacks the metric lines up to it. `guard()` runs on rank 0 before
    anything is written and raises when the run directory is no longer this process's
    (runs/lock.py); it may return the locked directory's (st_dev, st_ino). Rank 0 writes into the
    checkpoints folder it opened at its first save (store.Root), which must be in that directory and
    still at its path for the whole save: a run directory moved or replaced meanwhile receives
    nothing. A checkpoints folder that is a symbolic link is refused when the manager is made.

    State tuning (train.tune=state): `model` is the trainable initial state alone (models/state.py), and
    `base` the record of the frozen weights (runs/tuned.py's base_record), kept in meta.json; a checkpoint
    whose base has another digest is refused on load (its state was tuned for other weights)."""

    def __init__(
        self,
        root: Path,
        cfg: Config,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        micro: list[slice],
        dist: Ranks,
        device: torch.device,
        before_save: Callable[[], None] | None = None,
        guard: Callable[[], None] | None = None,
        base: dict | None = None,
    ):
        self.root, self.cfg, self.model, self.optimizer = Path(root), cfg, model, optimizer
        self.base = base
        self.micro, self.dist, self.device, self.before_save = micro, dist, device, before_save
        self.guard = guard
        self.interval, self.keep_last = cfg.train.ckpt_interval, cfg.train.keep_last
        self.global_rows = cfg.train.micro_batch * cfg.train.grad_accum
        self.background = cfg.train.async_checkpoint
        self.staging = Staging()
        self.writer: Writer | None = None  # the save in flight (or finished, its outcome not yet taken)
        self.committed: list[int] = []  # steps of checkpoints written since the loop last took them
        self._group = None  # the writer thread's process group (created with the first background save)
        store.check_root(self.root)  # on every rank, before anything is read or written
        self._held: store.Root | None = None  # rank 0's checkpoints folder, open from its first save on

    # -- saving ------------------------------------------------------------------------------------
    def maybe_save(self, step: int, last_step: int, carry: Carry, force: bool = False, **counters) -> bool:
        """Save if `step` is due (every train.ckpt_interval, and the run's `last_step`) or `force`d;
        True when it saved (with train.async_checkpoint: when it started writing). `counters`: save's
        keyword arguments. A checkpoint written lands in `committed`."""
        if not (force or step % self.interval == 0 or step == last_step):
            return False
        if self.background:
            self.save_async(step, carry, **counters)
        else:
            self.save(step, carry, **counters)
        return True

    def _meta(self, tokens: int, skipped_steps: int, nonfinite_in_row: int) -> dict:
        """meta.json's fields besides the files (rank 0's is written: the RNG every rank restores is
        rank 0's, in both formats)."""
        return {
            "config": config_to_dict(self.cfg),
            "torch_rng": torch.get_rng_state().tolist(),
            "world_size": self.dist.world_size,
            "tokens": tokens,
            "skipped_steps": skipped_steps,
            "nonfinite_in_row": nonfinite_in_row,
            **({"base": self.base} if self.base is not None else {}),
        }

    def save(
        self, step: int, carry: Carry, *, tokens: int, skipped_steps: int, nonfinite_in_row: int
    ) -> Path | None:
        """Write the checkpoint of `step`, in train.checkpoint_format, before returning (after any save
        still in flight); its path on rank 0, None on the others."""
        write = self._prepare(step, carry, self._meta(tokens, skipped_steps, nonfinite_in_row), background=False)
        path = write()
        self.committed.append(step)
        return path

    def save_async(
        self, step: int, carry: Carry, *, tokens: int, skipped_steps: int, nonfinite_in_row: int
    ) -> None:
        """Stage the checkpoint of `step` and start writing it in the background (after the save still
        in flight, if any, is written: its failure is raised here). Returns once the state is copied."""
        write = self._prepare(step, carry, self._meta(tokens, skipped_steps, nonfinite_in_row), background=True)
        self.writer = Writer(step, write)

    def _prepare(self, step: int, carry: Carry, meta: dict, background: bool) -> Callable[[], Path | None]:
        """Everything a save does on the loop's thread, every rank together: wait for the save in flight,
        sync the metrics, gather the TBPTT carry, agree on the guard, and pick (sharded) or gather (full)
        the state, copied into the staging buffers when the write is to run in the background (a full
        state gathered under FSDP is a fresh copy already). Returns the write itself: it writes only
        what it was given, so it may run on another thread (with its own process group)."""
        self.wait()
        if self.before_save is not None:
            self.before_save()
        root, keep_last = self.root, self.keep_last
        staging = self.staging if background else None
        if staging is not None:
            staging.begin()
        carry_tensors = self._carry_tensors(carry)
        if staging is not None:
            carry_tensors = {k: staging.copy(("carry", k), v) for k, v in carry_tensors.items()}
        self._check_guard(step)
        if self.cfg.train.checkpoint_format == "sharded":
            copy = None if staging is None else staging.copy
            staged = ranks.together(
                lambda: sharded.stage_sharded(self.model, self.optimizer, copy), sharded.save_failure(root, step)
            )
            group = self._writer_group() if background else None

            place = self._held if self.dist.is_main else root

            def write() -> Path | None:
                return sharded.write_sharded(place, step, staged, meta, keep_last, carry_tensors or None, group)

        else:
            held = self._held
            weights, optim_state = full.full_state(self.model, self.optimizer)
            if staging is not None and not ranks.sharded(self.model):  # the live tensors
                weights = staging.tree(weights, ("model",))
                optim_state = staging.tree(optim_state, ("optim",))

            def write() -> Path | None:
                if not self.dist.is_main:
                    return None
                return full.save_checkpoint(held, step, weights, optim_state, meta, keep_last, carry_tensors)

        if staging is not None:
            staging.finish()
        return write

    def _check_guard(self, step: int) -> None:
        """The guard on rank 0, its outcome agreed by every rank: a run directory no longer ours stops
        every rank rather than leaving the others waiting in the save. Rank 0 opens the checkpoints
        folder at its first save, and checks that the one it holds is in the locked run directory."""

        def check() -> None:
            if self.dist.is_main:
                locked = self.guard() if self.guard is not None else None  # the run directory is still ours
                if self._held is None:
                    self._held = store.Root.open(self.root)
                self._held.check(locked)

        ranks.together(check, lambda why: f"cannot write the checkpoint of step {step}: {why}")

    def _writer_group(self):
        """The writer thread's process group (made with the first background save: every rank is here)."""
        if self._group is None and self.dist.world_size > 1:
            self._group = writer_group()
        return self._group

    @property
    def writing(self) -> bool:
        """A save is being written in the background on this rank."""
        return self.writer is not None and self.writer.writing

    def wait(self) -> None:
        """Wait for the save in flight (a collective when there is one: every rank calls it at the same
        step) and take its outcome: its step lands in `committed`, or a CheckpointError on every rank."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.wait()
            self.committed.append(writer.step)

    def take_committed(self) -> list[int]:
        """The steps of the checkpoints written since the last call."""
        out, self.committed = self.committed, []
        return out

    def close(self) -> None:
        """After an error elsewhere: let a save in flight finish (its checkpoint is good), without
        raising what it may raise; nothing is agreed with the other ranks."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()

    def _carry_tensors(self, carry: Carry) -> dict[str, torch.Tensor]:
        """The TBPTT carry as global-batch tensors `carry.<block>.<field>`, so that a run
        resumes with any number of ranks."""
        if any(c is None for c in carry):
            return {}
        out = {}
        for i, template in enumerate(carry[0]):
            for name in template or {}:
                local = torch.cat([c[i][name] for c in carry])
                out[f"carry.{i}.{name}"] = ranks.gather_rows(local, self.dist.world_size)
        return out

    # -- loading -----------------------------------------------------------------------------------
    def load_latest(self, on_skip: Callable[[Path, str], None] | None = None) -> Restored | None:
        """Load the newest good checkpoint into the model and optimizer (None if there is none).
        A damaged newer one is reported to `on_skip(path, reason)`, set aside (renamed
        corrupt-step_...), and skipped."""
        found = self._newest_good(on_skip)
        if found is None:
            return None
        return self._load(*found)

    def load_from(self, path: Path) -> Restored:
        """Load the checkpoint at `path`, a checkpoint directory of another run (`train.decay_from`),
        verified first by every rank together; nothing there is written, renamed or set aside."""
        rank, world, main = self.dist.rank, self.dist.world_size, self.dist.is_main

        def verify() -> dict:
            if (path / "meta.json").is_file() and sharded.is_sharded(store.read_meta(path)):
                return sharded.verify(path, (rank, world))[0]
            return find.verify_step(path) if main else {}

        return self._load(path, ranks.together(verify, lambda why: why))

    def _load(self, path: Path, meta: dict) -> Restored:
        """Load a verified checkpoint (`meta`: its meta.json on rank 0) into the model and optimizer."""
        if sharded.is_sharded(meta):  # every rank reads its own rows (load_sharded), however many ranks wrote them
            meta, load = self._sharded_loader(path)
        else:
            meta, load = self._full_loader(path, meta)
        self._check_base(path, meta)
        try:
            rng = torch.tensor(meta.get("torch_rng", torch.get_rng_state().tolist()), dtype=torch.uint8)
            skipped, in_row = int(meta.get("skipped_steps", 0)), int(meta.get("nonfinite_in_row", 0))
            settings = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            load()
            # The groups' settings (betas, eps, weight decay, lr_scale) are the config's, which the resume
            # compared with the checkpoint's: a saved value that differs is damage or an allowed change.
            for group, own in zip(self.optimizer.param_groups, settings, strict=True):
                group.update(own)
            torch.set_rng_state(rng)
        except (ValueError, RuntimeError, KeyError, TypeError, OverflowError) as e:
            raise CheckpointError(f"{path} cannot be loaded: {e}") from None
        carry = self._restore_carry(store.load_extra(path), str(path))
        return Restored(meta["step"], tokens_trained(meta), skipped, in_row, carry)

    def _check_base(self, path: Path, meta: dict) -> None:
        """A state-tuned run's checkpoint names the frozen weights this run holds (their digest): else the
        state was tuned for others. (Either kind of run refuses the other's checkpoints by train.tune.)"""
        saved = meta.get("base")
        if self.base is None or saved is None:
            return
        saved = saved if isinstance(saved, dict) else {}
        if saved.get("sha256") != self.base["sha256"]:
            raise CheckpointError(
                f"{path}: its state was tuned for the weights of {saved.get('weights')} (sha256 "
                f"{str(saved.get('sha256'))[:12]}...), "
                f"not those of {self.base['weights']} ({self.base['sha256'][:12]}...) that train.init_from gives now"
            )

    def _newest_good(self, on_skip) -> tuple[Path, dict] | None:
        """(path, meta.json) of the newest checkpoint that verifies, every rank agreeing (None: there is
        none): find.latest_good over rank 0's list, each check a collective. A sharded checkpoint's
        files are hashed by all ranks, each its share, in parallel (load_sharded then does not hash
        them again); a full one's by rank 0 (its meta is {} on the others, which read and check the
        files whole as they load them). Rank 0 reports the damaged ones and sets them aside."""
        rank, world, main = self.dist.rank, self.dist.world_size, self.dist.is_main
        names = [p.name for p in reversed(store.step_dirs(self.root))] if main else None
        had = store.had_checkpoints(self.root) if main else None  # damaged ones set aside before included
        names, had = ranks.broadcast((names, had))

        def verify(path: Path) -> dict:
            if (path / "meta.json").is_file() and sharded.is_sharded(store.read_meta(path)):
                return sharded.verify(path, (rank, world))[0]
            return find.verify_step(path) if main else {}

        found = find.latest_good(
            self.root,
            on_skip if main else None,
            quarantine=main,
            check=lambda path: ranks.together(lambda: verify(path), lambda why: why),
            paths=[self.root / n for n in names],
        )
        if found is None and had:
            raise CheckpointError(
                f"every checkpoint in {self.root} is damaged (set aside as corrupt-step_...); nothing to "
                "resume from. Repair one, or train afresh without --resume"
            )
        return found

    def _full_loader(self, path: Path, meta: dict) -> tuple[dict, Callable[[], None]]:
        """(meta.json, what loads it) for a full checkpoint: every rank reads the whole weights and
        optimizer state and checks them against the model before anything is loaded. `meta`: rank 0's
        verified meta.json ({} on the other ranks: they verify it here)."""
        meta = meta if meta else find.verify(path)  # {}: verified by rank 0 only
        weights = full.load_weights(path)
        own = self.model.state_dict()  # full shapes: a sharded DTensor reports its global shape
        problems = mismatch(own, weights)
        if problems:
            raise CheckpointError(f"{path} does not match the model: {problems}")
        check_finite(weights, str(path))
        optim_state = full.load_optimizer_state(path, meta)
        if optim_state is not None:
            shapes = [own[n].shape for n in full.param_names(self.model, self.optimizer)]
            check_optimizer_state(optim_state, self.optimizer.param_groups, shapes, str(path))
        return meta, lambda: full.load_full_state(self.model, self.optimizer, weights, optim_state)

    def _sharded_loader(self, path: Path) -> tuple[dict, Callable[[], None]]:
        """(meta.json, what loads it) for a sharded checkpoint: meta.json and index.json are read and
        the optimizer's groups checked against this run's on every rank (the ranks agree on the outcome);
        the load (sharded.load_sharded) verifies each rank's share of the files, reads only the rows
        that rank holds and checks them before anything is loaded."""

        def read() -> dict:
            meta = sharded.read_meta(path)
            index = sharded.read_index(path, meta)
            if index.optimizer is not None:
                check_optimizer_groups(index.optimizer["param_groups"], self.optimizer.param_groups, str(path))
            return meta

        meta = ranks.together(read, lambda why: why)
        return meta, lambda: sharded.load_sharded(path, self.model, self.optimizer, verified=True)

    def _restore_carry(self, tensors: dict[str, torch.Tensor], source: str) -> Carry | None:
        """This rank's per-micro-batch carry from the global-batch tensors (None when the checkpoint
        has none, or this run does not use truncated BPTT)."""
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
            return None  # a run resumed without truncated BPTT starts each window from a zero state
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
        return [
            [
                None
                if tmpl is None
                else {
                    name: ranks.local_rows(by_key[i, name], self.dist.rank, self.dist.world_size)[rows].to(self.device)
                    for name in tmpl
                }
                for i, tmpl in enumerate(templates)
            ]
            for rows in self.micro
        ]

    def load_initial(self, weights: dict[str, torch.Tensor], source: str) -> None:
        """Start from weights elsewhere (train.init_from); reports what differs from this model."""
        problems = mismatch(self.model.state_dict(), weights)
        if problems:
            raise CheckpointError(f"{source} does not match the model: {problems}")
        check_finite(weights, source)
        full.load_full_state(self.model, None, weights, None)


# Settings a resume may change freely: they decide where and how often things happen, not what the
# run computes; train.tokens, which lengthens (or shortens) the run (its cosine schedule then
# continues from the tokens trained, over the new total); and model.ffn_key_gain, an init setting
# that a resumed run's weights no longer depend on (checkpoints from before it existed read as 1.0,
# the runs as 2.0). Any other change breaks the exact reproduction of an uninterrupted run.
OPERATIONAL = frozenset(
    {"run_dir", "data.prepared_dir", "train.tokens", "model.ffn_key_gain"}
    | {
        f"train.{k}"
        for k in (
            "eval_interval", "eval_tokens", "ckpt_interval", "keep_last", "log_interval", "loggers", "wandb_project",
            "wandb_name", "profile_steps", "nonfinite", "nonfinite_limit", "device", "distributed", "compile",
            "grad_cp", "init_from", "decay_from", "checkpoint_format", "async_checkpoint",
        )
    }
)


# Settings that decide which optimizer state a tensor has (AdamW's moments or Muon's momentum): a
# checkpoint's state fits only the optimizer that wrote it, so not even --allow-change changes them.
OPTIMIZER_KIND = frozenset({"train.optimizer", "train.muon_lora"})


# What a checkpoint's tensors are: every weight (train.tune=full) or a tuned initial state alone (state,
# with or without token shifts). Not even --allow-change changes them.
TRAINED = frozenset({"train.tune", "train.tune_shifts"})


# Model settings that choose how the model is computed, not what it is: the weights fit either way,
# but the rounding differs, so a change goes through --allow-change as a training setting does.
MODEL_RUNTIME = frozenset({"model.fused"})


def _flat(cfg: Config) -> dict[str, object]:
    return {
        f"{section}.{key}" if isinstance(body, dict) else section: value
        for section, body in config_to_dict(cfg).items()
        for key, value in (body.items() if isinstance(body, dict) else [(None, body)])
    }


def resume_changes(saved: Config, cfg: Config, allowed: Collection[str] = ()) -> dict[str, tuple]:
    """{setting: (checkpoint's value, this run's)} for the settings that differ, other than the
    OPERATIONAL ones. A change not in `allowed` is refused in one line naming the setting and both
    values; a model setting never changes (the weights would not fit it)."""
    then, now = _flat(saved), _flat(cfg)
    for key in allowed:
        if key not in now:
            raise ConfigError(f"--allow-change {key}: not a config setting (e.g. train.micro_batch)")
    changes = {k: (then.get(k), v) for k, v in now.items() if k not in OPERATIONAL and then.get(k) != v}
    for key, (old, new) in changes.items():
        if key.startswith("model.") and key not in MODEL_RUNTIME:
            raise ConfigError(f"--resume: {key} is {old!r} in the run's checkpoints, {new!r} now; the model is fixed")
        if key in TRAINED:
            raise ConfigError(
                f"--resume: {key} is {old!r} in the run's checkpoints, {new!r} now; their tensors are another "
                "kind's (train.tune=state keeps the initial state alone): start a new run"
            )
        if key in OPTIMIZER_KIND:
            raise ConfigError(
                f"--resume: {key} is {old!r} in the run's checkpoints, {new!r} now; their optimizer state cannot "
                f"continue under another optimizer: start a new run with train.init_from={cfg.run_dir} (the "
                "weights, a fresh optimizer)"
            )
        if key not in allowed:
            raise ConfigError(
                f"--resume: {key} is {old!r} in the run's checkpoints, {new!r} now, which breaks the exact "
                f"resume; set it back, or pass --allow-change {key} to continue with {new!r}"
            )
    return changes


def tokens_trained(meta: dict) -> int:
    """Tokens a checkpoint's run had trained: recorded since resumes may change the batch; before
    that, its step times its config's tokens per step."""
    if "tokens" in meta:
        tokens = meta["tokens"]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < 2**62:
            raise CheckpointError(f"meta.json: 'tokens' is {tokens!r}, not a count of tokens trained")
        return tokens
    t = meta["config"]["train"]
    return meta["step"] * t["ctx_len"] * t["micro_batch"] * t["grad_accum"]


def _same_kind(saved, live) -> bool:
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if number(live):
        return number(saved)
    if isinstance(live, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(live) and all(map(_same_kind, saved, live))
    return type(saved) is type(live)


def check_optimizer_groups(groups, live_groups: list[dict], source: str) -> None:
    """The saved optimizer groups (a full checkpoint's, parameters by index; a sharded one's, by name)
    fit this optimizer's: as many, each with as many parameters and settings of the same kinds, and
    the same flags (amsgrad, maximize, ...: they change the algorithm)."""

    def bad(why: str):
        return CheckpointError(f"{source}: the optimizer state does not fit this run: {why}")

    if not isinstance(groups, list) or len(groups) != len(live_groups):
        raise bad(f"expected {len(live_groups)} parameter groups")
    for i, (g, live) in enumerate(zip(groups, live_groups, strict=True)):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) or len(g["params"]) != len(live["params"]):
            raise bad(f"group {i} holds a different number of parameters")
        for key, val in live.items():
            if key == "params" or key in IMPLEMENTATION:  # how the update is computed, not what
                continue
            if not _same_kind(g.get(key), val):
                raise bad(f"group {i} setting {key!r} is {g.get(key)!r}")
            if isinstance(val, bool) and g.get(key) != val:  # a flag (amsgrad, maximize, ...) changes the algorithm
                raise bad(f"group {i} setting {key!r} is {g.get(key)!r}, this run's {val!r}")


def check_optimizer_state(state: dict, live_groups: list[dict], shapes: list[torch.Size], source: str) -> None:
    """The saved optimizer state fits this optimizer: the same groups and settings, and moment
    tensors of the parameters' shapes (`shapes`, in the optimizer's order)."""

    def bad(why: str):
        return CheckpointError(f"{source}: the optimizer state does not fit this run: {why}")

    groups, items = state.get("param_groups"), state.get("state")
    if not isinstance(items, dict):
        raise bad(f"expected {len(live_groups)} parameter groups")
    check_optimizer_groups(groups, live_groups, source)
    ids = [i for g in groups for i in g["params"]]
    if sorted(ids, key=str) != sorted(range(len(shapes)), key=str):
        raise bad("the parameter indices are not 0..n-1")
    for idx, st in items.items():
        if not isinstance(idx, int) or not 0 <= idx < len(shapes) or not isinstance(st, dict):
            raise bad(f"state for unknown parameter {idx!r}")
        for key, val in st.items():
            if not isinstance(val, torch.Tensor):
                raise bad(f"{key} of parameter {idx} is not a tensor")
            if key != "step" and val.shape != shapes[idx]:
                raise bad(f"{key} of parameter {idx} has shape {tuple(val.shape)}, the parameter {tuple(shapes[idx])}")
            if not torch.isfinite(val).all():
                raise bad(f"{key} of parameter {idx} holds non-finite values")
            if key == "step" and not (val.numel() == 1 and 1 <= float(val) < 2**53 and float(val).is_integer()):
                # Adam divides by 1 - beta**step: a step of 0, a fraction or a negative one blows up the update
                raise bad(f"step of parameter {idx} is {val.tolist()}, not a count of steps")
