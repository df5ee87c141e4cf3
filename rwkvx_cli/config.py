"""Typed run configuration: dataclasses per section, loaded from YAML, with
dotted command-line overrides (`train.lr=3e-4`). Unknown keys, wrong types and
inconsistent values are rejected with the field's dotted name."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rwkvx_cli.errors import UsageError


class ConfigError(UsageError):
    """A bad configuration (exit code 2)."""


# Seeds feed torch.manual_seed and numpy generators: a signed 64-bit range keeps every one valid.
MAX_SEED = 2**63 - 1


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key written twice in one mapping (YAML's last-wins hides typos)."""


def _unique_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: let the base constructor report it
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


# More blocks than any model trains: a larger count is a typo, not a model to build.
MAX_LAYERS = 10_000
# Token ids are stored as int32 (binidx): no vocabulary is larger.
MAX_VOCAB = 2**31 - 1
MIN_BPE_VOCAB = 257  # a trained BPE's 256 bytes and its end-of-document token

# Block kinds a layer pattern may use: the time mix of each (the channel mix is RWKV's).
LAYER_KINDS = ("rwkv7", "moba", "rwkv4", "gdn", "kda", "rwkv8")

# train.precision (train/precision.py): auto = bf16-mixed on CUDA, fp32 on the CPU.
PRECISIONS = ("auto", "fp32", "bf16-mixed", "tf32")
# train.optimizer (models/optimizer.py), train.lr_schedule and train.decay_shape (train/schedule.py).
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt", "cosine")
# train.sampler (data/sampler.py) and train.tune (models/state.py; docs/training.md#state-tuning).
SAMPLERS = ("epoch", "random", "documents")
TUNES = ("full", "state")
# The layer kinds state tuning takes: RWKV-7 blocks get a trainable initial state, MoBA blocks (whose
# state is the keys and values read, nothing of fixed size) stay frozen and start empty.
STATE_TUNED_KINDS = ("rwkv7", "moba")

# RWKV-LM's ln_x (GroupNorm) eps: model.ln_x_eps's default.
LN_X_EPS = 64e-5

# The smallest model.head_size of the blocks that need more than the kernels' 1 (every kind runs at
# N = 1), and why; tested at the floor in tests/test_config.py. A group norm over one channel per head
# outputs its bias whatever the input.
MIN_HEAD_SIZE = {
    "rwkv7 blocks": (2, "their init spreads a head's channels over (N - 1) / 2, and ln_x normalises each head"),
    "rwkv8 blocks with model.rwkv8_shared_value false": (2, "ln_x normalises each value head"),
}


@dataclass
class ModelConfig:
    vocab_size: int = 257
    n_layer: int = 4
    n_embd: int = 128
    head_size: int = 64
    # RWKV-X: n_attn MoBA attention blocks, one after every n_layer // n_attn RWKV blocks.
    n_attn: int = 0
    moba_chunk: int = 64
    # Earlier chunks each query attends besides its own (seed 000's convention; <= 0: all).
    moba_top_k: int = 2
    # The stack, bottom to top, as a list of kinds (LAYER_KINDS) or a compact string such
    # as "rwkv7*2,moba,gdn*2"; empty = RWKV-X's rule on n_layer and n_attn. When given,
    # n_layer and n_attn follow from it (n_attn = the moba blocks, n_layer = the rest).
    layers: list[str] = field(default_factory=list)
    # rwkv8 blocks: one value head (the block input) shared by every head, or one per head.
    rwkv8_shared_value: bool = True
    # RWKV-7's low-rank sizes of the decay (w), in-context learning rate (a), value residual (v) and
    # gate (g); 0 = RWKV-LM's rule from n_embd. Released checkpoints above 0.1B use other ranks
    # (0.4B: 64, 64, 32, 128); `train.init_from` reads them from the weights.
    lora_w: int = 0
    lora_a: int = 0
    lora_v: int = 0
    lora_g: int = 0
    # Run the blocks through the fused block ops (ops/shift_mix, rwkv7_prep, rwkv7_out, channel_mix:
    # docs/model.md#fused-blocks): the same parameters and math in fewer, fused kernels. False: the
    # plain torch composition, which the fused ops' references are (and `rwkvx explain` reads).
    fused: bool = True
    # The eps of the per-head group norm (`ln_x`) of RWKV-7 and rwkv8 blocks: RWKV-LM's 64e-5 by default;
    # a model imported from HF (fla) gets its head_dim x norm_eps (docs/formats.md: the eps rule).
    ln_x_eps: float = LN_X_EPS
    # The orthogonal gain of the channel mix's key [4C, C] at init, in every block kind but RWKV-4 (whose
    # v4neo init gives sqrt(4C / C) = 2): RWKV-LM train_temp's 1.0 by default. Runs started before
    # 2026-12-04 used 2 (docs/model.md#the-channel-mix-key-gain: what each does at the sizes measured).
    ffn_key_gain: float = 1.0


def expand_layers(spec: list[str]) -> list[str]:
    """["rwkv7*2,moba", "gdn"] -> ["rwkv7", "rwkv7", "moba", "gdn"]; bad kinds or counts raise."""
    kinds = []
    for item in spec:
        for token in str(item).split(","):
            name, _, count = token.strip().partition("*")
            name = name.strip()
            if name not in LAYER_KINDS:
                raise ConfigError(f"model.layers: unknown layer kind {name!r}{_nearest(name, list(LAYER_KINDS))}")
            if count and not (count.strip().isdigit() and 1 <= int(count) <= MAX_LAYERS):
                raise ConfigError(
                    f"model.layers: {token.strip()!r}: the repeat count must be an integer from 1 to {MAX_LAYERS:,}"
                )
            kinds += [name] * (int(count) if count else 1)
    return kinds


@dataclass
class MixSource:
    # A prepared directory (with meta.json: its train split) or a bare binidx prefix (all of it).
    path: str = ""
    weight: float = 1.0


@dataclass
class DataConfig:
    # Files, directories or globs to prepare (.txt, .jsonl, .jsonl.gz/.zst, .parquet), or one
    # directory already prepared (holding meta.json).
    corpus: list[str] = field(default_factory=lambda: ["data/tinyshakespeare.txt"])
    tokenizer: str = "byte"  # "byte", "bpe", "world", or a path to a tokenizer.json
    # The end-of-document id of a HuggingFace tokenizer.json (GPT-NeoX 20B's <|endoftext|> is 0).
    eod_id: int = 0
    # Start every document from a zero state: the model resets its token shifts, recurrences and
    # convolutions at each end-of-document token, which then begins the next document (its state
    # carries nothing of the one before). Off: RWKV-LM's packing, the state runs across documents.
    reset_at_eod: bool = False
    # The chat template that renders JSONL conversations ({"messages": ...}) and {"prompt",
    # "response"} pairs when training prepares data.corpus: a shipped name (g1) or a template file
    # (data/template.py); their loss masks say which tokens train (docs/data.md).
    template: str = "g1"
    bpe_vocab_size: int = 2048
    val_fraction: float = 0.05
    # The seed that chooses which documents validation holds out when training prepares data.corpus;
    # None (the default) = train.seed. Set it to compare seeds on one held-out split.
    split_seed: int | None = None
    # Where prepared tokens go; "" = <run dir>/data.
    prepared_dir: str = ""
    # Train on a bare binidx prefix as is (RWKV-LM's make_data.py output), instead of data.corpus;
    # data.tokenizer names its tokenizer (for decoding). Validation: a second prefix (val_binidx)
    # or the prefix's last val_tokens tokens, held out.
    binidx: str = ""
    val_binidx: str = ""
    val_tokens: int = 0
    # Train on a weighted mixture of prepared directories and/or prefixes, instead of data.corpus
    # (None: no mixture; an empty list is refused).
    mix: list[MixSource] | None = None


@dataclass
class TrainConfig:
    ctx_len: int = 256
    micro_batch: int = 8
    grad_accum: int = 1
    tokens: int = 2_000_000  # total training tokens (sets the step count)
    lr: float = 6e-4
    lr_final: float = 6e-5
    warmup_tokens: int = 100_000
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-18
    # "adamw": RWKV-LM's recipe. "muon": Muon for the blocks' hidden matrices (linear layers; the LoRA
    # factors too with muon_lora), AdamW for the rest, one lr / schedule / weight decay for both
    # (Moonshot's update scale; models/optimizer.py, docs/training.md#muon).
    optimizer: str = "adamw"
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5  # Newton-Schulz iterations per update
    muon_lora: bool = False
    # The learning rate after warmup: "cosine" decays to lr_final over the whole run; "wsd"
    # (warmup-stable-decay) holds train.lr and decays to lr_final over the last decay_tokens
    # (0: a fifth of the run), shaped by decay_shape: linear, 1-sqrt or cosine (train/schedule.py).
    lr_schedule: str = "cosine"
    decay_tokens: int = 0
    decay_shape: str = "1-sqrt"
    grad_clip: float = 1.0
    seed: int = 0
    eval_interval: int = 100  # steps
    eval_tokens: int = 65_536
    ckpt_interval: int = 200  # steps
    keep_last: int = 3
    # How a checkpoint is written: "full" gathers the whole weights and optimizer state and rank 0
    # writes them (model.safetensors, optimizer.safetensors); "sharded" has every rank write its own
    # rows in parallel (checkpoints/sharded.py), nothing gathered. Either resumes on any number of ranks,
    # and a run resumes from either whatever this says.
    checkpoint_format: str = "full"
    # Write each checkpoint in the background: the step loop waits only while the state is copied
    # (into CPU buffers kept for the run: one more copy of each rank's share), and a writer thread
    # writes the copy while training goes on. At most one is in flight; the run's end and a stop
    # request wait for it, and a failed write stops the run (the earlier checkpoints intact).
    async_checkpoint: bool = False
    # Truncated BPTT: each batch row reads consecutive windows of one stream and the
    # recurrent state (WKV state and token shifts) carries over, detached, between steps.
    tbptt: bool = False
    # Training windows: "epoch" visits every window once per epoch in a seeded order; "random"
    # draws windows uniformly with replacement; "documents" starts every row at a document's start
    # (the token after an end-of-document id), each document once per epoch in a seeded order, the
    # targets past its end carrying no loss (RWKV-PEFT's `pad` rows). (TBPTT reads consecutive streams;
    # data.mix is per epoch.)
    sampler: str = "epoch"
    device: str = "auto"  # auto, cpu, cuda
    # Numeric precision (PRECISIONS): fp32; bf16-mixed (bf16 autocast over fp32 master weights, CUDA
    # or CPU); tf32 (fp32 with TF32 matmuls, CUDA only); auto = bf16-mixed on CUDA, fp32 on the CPU.
    precision: str = "auto"
    compile: bool = False
    # The loss head: "chunked" computes the head's matmul and cross-entropy in chunks of rows, so
    # the [B, T, vocab] fp32 logits never exist whole; "full" materialises them (the plain path).
    head: str = "chunked"
    # RWKV-LM's L2Wrap (a small gradient on each position's largest logit): true, false, or null
    # (the default) = on for stacks with RWKV-7 blocks, as RWKV-LM trains them.
    l2wrap: bool | None = None
    # Recompute each block's activations in the backward pass instead of keeping them (RWKV-LM's
    # --grad_cp): less memory, about one more forward of compute.
    grad_cp: bool = False
    # Chunked full BPTT (0 = off): a window runs as consecutive chunks of chunk_len tokens, each from
    # the previous chunk's final state with its gradient, each recomputed in the backward; the loss and
    # gradients are the whole window's, the memory one chunk's (models/chunked.py, docs/training.md).
    chunk_len: int = 0
    # Under torchrun: "ddp" replicates the model on every rank; "fsdp" shards parameters,
    # gradients and optimizer state across ranks (FSDP2 `fully_shard`) for models that do not fit one device.
    distributed: str = "ddp"
    # A step whose loss or gradient norm is not finite: "stop" with an error, or "skip" it
    # (no update, counted in metrics.jsonl) and stop anyway after `nonfinite_limit` in a row.
    nonfinite: str = "stop"
    nonfinite_limit: int = 20
    # Start from these weights instead of the seeded init: a checkpoint or run directory,
    # a .safetensors file, or an RWKV-LM .pth state dict (loaded with weights_only=True).
    init_from: str = ""
    # What trains: "full", every weight; "state", state tuning: the weights of train.init_from frozen,
    # and a trainable initial state per RWKV-7 block ([H, N, N], from zeros, RWKV-PEFT's time_state)
    # from which every row starts, at a document start (train.sampler=documents); AdamW without weight
    # decay over the state alone (docs/training.md#state-tuning).
    tune: str = "full"
    # train.tune=state: also tune each RWKV-7 block's two token-shift states ([C] each). RWKV-PEFT's
    # state file cannot carry them (runtimes start them at zero), so off by default.
    tune_shifts: bool = False
    # Branch a decay: continue another run's checkpoint (a checkpoint directory, or a run directory: its
    # newest good one) from its stable phase (train.lr_schedule=wsd) in this run directory, with its
    # weights, optimizer state, data position and RNG, decaying over train.decay_tokens from there
    # (train.tokens becomes the checkpoint's tokens + decay_tokens, whatever is given, also when the
    # branch resumes). The source run is only read.
    decay_from: str = ""
    # Without a terminal (nohup, SLURM, a pipe): one plain progress line every log_interval steps
    # (and the last); on a terminal the live view shows every step.
    log_interval: int = 10  # steps
    # Where each step's metrics go (rank 0): "jsonl" (<run>/metrics.jsonl), "tensorboard"
    # (<run>/tensorboard/), "wandb" (<run>/wandb/; WANDB_MODE=offline works without a network).
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    wandb_project: str = "rwkvx"
    wandb_name: str = ""  # "" = the run directory's name
    # [a, b]: a torch.profiler Chrome trace of steps a..b in <run>/profile/ ([] = off).
    profile_steps: list[int] = field(default_factory=list)


# The sinks train.loggers may name (train/loggers.py).
LOGGERS = ("jsonl", "tensorboard", "wandb")


@dataclass
class Config:
    """The run's settings. `written` (not a field: never saved) holds the `section.key` names the YAML
    and the overrides set, for rules that treat a value written from one left at its default
    (e.g. sizes read from train.init_from's weights)."""

    run_dir: str = "runs/tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    written = frozenset()  # no annotation: not a dataclass field, so never in config_to_dict

    def validate(self, written: Collection[str] = ()) -> None:
        """Check every value and derive model.n_layer / model.n_attn from model.layers. `written`:
        the dotted keys the YAML and overrides set (a count written beside model.layers must agree
        with it even when it equals the default; a config built in code is judged by its values)."""
        m, t, d = self.model, self.train, self.data
        if m.layers:
            m.layers = expand_layers(m.layers)
            n_attn, n_rest = m.layers.count("moba"), len(m.layers) - m.layers.count("moba")
            defaults = ModelConfig()
            for name, derived in (("n_layer", n_rest), ("n_attn", n_attn)):
                given = getattr(m, name)
                explicit = f"model.{name}" in written or given != getattr(defaults, name)
                if explicit and given != derived:
                    raise ConfigError(
                        f"model.{name}: {given} disagrees with model.layers ({derived}); set one of the two"
                    )
                setattr(m, name, derived)
            if n_rest == 0:
                raise ConfigError("model.layers: needs at least one recurrent layer besides moba")
        checks = [
            (m.n_embd >= 1, "model.n_embd", "must be >= 1"),
            (m.head_size >= 1, "model.head_size", "must be >= 1"),
            (m.n_embd % max(m.head_size, 1) == 0, "model.n_embd", f"{m.n_embd} is not divisible by model.head_size"),
            (1 <= m.n_layer <= MAX_LAYERS, "model.n_layer", f"must be from 1 to {MAX_LAYERS:,}"),
            (2 <= m.vocab_size <= MAX_VOCAB, "model.vocab_size", f"must be from 2 to {MAX_VOCAB:,}"),
            (bool(m.layers) or 0 <= m.n_attn <= m.n_layer, "model.n_attn", "must be between 0 and model.n_layer"),
            (m.moba_chunk >= 1, "model.moba_chunk", "must be >= 1"),
            (math.isfinite(m.ln_x_eps) and m.ln_x_eps > 0, "model.ln_x_eps", "must be a finite number > 0"),
            (0 < m.ffn_key_gain <= 100, "model.ffn_key_gain", "must be > 0 and <= 100"),
            *((getattr(m, f"lora_{k}") >= 0, f"model.lora_{k}", "must be >= 0 (0: RWKV-LM's rule)") for k in "wavg"),
            (t.ctx_len >= 1, "train.ctx_len", "must be >= 1"),
            (t.micro_batch >= 1, "train.micro_batch", "must be >= 1"),
            (t.grad_accum >= 1, "train.grad_accum", "must be >= 1"),
            (t.tokens >= 1, "train.tokens", "must be >= 1"),
            (t.lr > 0, "train.lr", "must be > 0"),
            (t.lr_final >= 0, "train.lr_final", "must be >= 0"),
            (t.lr_final <= t.lr, "train.lr_final", f"{t.lr_final} is above train.lr ({t.lr}); the schedule decays"),
            (0 <= t.seed <= MAX_SEED, "train.seed", f"must be between 0 and {MAX_SEED}"),
            (t.warmup_tokens >= 0, "train.warmup_tokens", "must be >= 0"),
            (t.weight_decay >= 0, "train.weight_decay", "must be >= 0"),
            (all(0 <= b < 1 for b in t.betas), "train.betas", "must be in [0, 1)"),
            (t.eps >= 0, "train.eps", "must be >= 0"),
            (t.grad_clip > 0, "train.grad_clip", "must be > 0"),
            (t.optimizer in OPTIMIZERS, "train.optimizer", f"{t.optimizer!r} is not one of {', '.join(OPTIMIZERS)}"),
            (0 <= t.muon_momentum < 1, "train.muon_momentum", "must be in [0, 1)"),
            (1 <= t.muon_ns_steps <= 20, "train.muon_ns_steps", "must be from 1 to 20"),
            (t.lr_schedule in SCHEDULES, "train.lr_schedule",
             f"{t.lr_schedule!r} is not one of {', '.join(SCHEDULES)}"),
            (t.decay_shape in DECAY_SHAPES, "train.decay_shape",
             f"{t.decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}"),
            (t.decay_tokens >= 0, "train.decay_tokens", "must be >= 0 (0: the last fifth of the run)"),
            (t.eval_tokens >= 1, "train.eval_tokens", "must be >= 1"),
            (t.keep_last >= 1, "train.keep_last", "must be >= 1"),
            (t.eval_interval >= 1, "train.eval_interval", "must be >= 1"),
            (t.ckpt_interval >= 1, "train.ckpt_interval", "must be >= 1"),
            (t.checkpoint_format in ("full", "sharded"), "train.checkpoint_format", "must be full or sharded"),
            (t.device in ("auto", "cpu", "cuda"), "train.device", "must be auto, cpu or cuda"),
            (t.precision in PRECISIONS, "train.precision", f"{t.precision!r} is not one of {', '.join(PRECISIONS)}"),
            (t.distributed in ("ddp", "fsdp"), "train.distributed", "must be ddp or fsdp"),
            (t.nonfinite in ("stop", "skip"), "train.nonfinite", "must be stop or skip"),
            (t.nonfinite_limit >= 1, "train.nonfinite_limit", "must be >= 1"),
            (0 < d.val_fraction < 1, "data.val_fraction", "must be between 0 and 1"),
            (d.split_seed is None or 0 <= d.split_seed <= MAX_SEED, "data.split_seed",
             f"must be between 0 and {MAX_SEED}"),
            (len(d.corpus) >= 1, "data.corpus", "must name at least one file"),
            (t.sampler in SAMPLERS, "train.sampler", f"{t.sampler!r} is not one of {', '.join(SAMPLERS)}"),
            (t.tune in TUNES, "train.tune", f"{t.tune!r} is not one of {', '.join(TUNES)}"),
            (t.head in ("chunked", "full"), "train.head", "must be chunked or full"),
            (0 <= d.eod_id < MAX_VOCAB, "data.eod_id", f"must be from 0 to {MAX_VOCAB - 1:,}"),
            (MIN_BPE_VOCAB <= d.bpe_vocab_size <= MAX_VOCAB, "data.bpe_vocab_size",
             f"must be from {MIN_BPE_VOCAB} to {MAX_VOCAB:,}"),
            (d.val_tokens >= 0, "data.val_tokens", "must be >= 0"),
            (bool(d.template), "data.template", "must name a template (g1) or a template file"),
            *self._vocabulary_checks(written),
            (t.log_interval >= 1, "train.log_interval", "must be >= 1"),
            (t.chunk_len >= 0, "train.chunk_len", "must be >= 0 (0: off)"),
        ]
        checks += [
            (not t.decay_from or t.lr_schedule == "wsd", "train.decay_from",
             "branches a warmup-stable-decay run's decay: set train.lr_schedule=wsd"),
            (not t.decay_from or t.decay_tokens > 0, "train.decay_from",
             "set train.decay_tokens, the decay's length in tokens from the checkpoint"),
            (not (t.decay_from and t.init_from), "train.decay_from",
             "continues a checkpoint's whole training state; train.init_from starts from weights alone: set one"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ConfigError(f"{name}: {why}")
        self._validate_head_size()
        self._validate_logging()
        self._validate_sources(written)
        self._validate_tuning()

    def _vocabulary_checks(self, written: Collection[str]) -> list[tuple[bool, str, str]]:
        """data.eod_id against the vocabulary it is resolved with: an id of the model's vocabulary, and
        0 for a named tokenizer (as `data prepare --eod-id` refuses another). A vocabulary that
        train.init_from's weights will give (model.vocab_size not written) is checked when they have
        given it (runs/initial.py validates again)."""
        m, d = self.model, self.data
        known = not self.train.init_from or "model.vocab_size" in written
        named = d.tokenizer in TOKENIZER_NAMES
        return [
            (not known or d.eod_id < m.vocab_size, "data.eod_id",
             f"{d.eod_id} is outside the vocabulary: must be below model.vocab_size ({m.vocab_size:,})"),
            (not named or d.eod_id == 0, "data.eod_id",
             f"the {d.tokenizer} tokenizer's end-of-document id is 0, not {d.eod_id} (data.eod_id is for a "
             "tokenizer.json)"),
        ]  # fmt: skip

    def _validate_head_size(self) -> None:
        m = self.model
        kinds = set(m.layers) if m.layers else {"rwkv7"}  # RWKV-X's rule stacks RWKV-7 blocks (and MoBA)
        blocks = {f"{k} blocks" for k in kinds}
        if "rwkv8" in kinds and not m.rwkv8_shared_value:
            blocks.add("rwkv8 blocks with model.rwkv8_shared_value false")
        for what, (floor, why) in MIN_HEAD_SIZE.items():
            if what in blocks and m.head_size < floor:
                raise ConfigError(f"model.head_size: {m.head_size} is below the {floor} that {what} need ({why})")

    def _validate_logging(self) -> None:
        t = self.train
        for name in t.loggers:
            if name not in LOGGERS:
                raise ConfigError(f"train.loggers: unknown logger {name!r}{_nearest(name, list(LOGGERS))}")
        if len(set(t.loggers)) != len(t.loggers):
            raise ConfigError(f"train.loggers: {t.loggers} names a logger twice")
        p = t.profile_steps
        if p and (len(p) != 2 or not 1 <= p[0] <= p[1]):
            raise ConfigError(f"train.profile_steps: {p} must be [a, b], two steps with 1 <= a <= b (or [] for off)")
        if p and p[1] > self.total_steps:
            raise ConfigError(f"train.profile_steps: step {p[1]} is past the run's last step ({self.total_steps})")

    def _validate_tuning(self) -> None:
        """train.tune=state and train.sampler=documents against the settings they cannot go with."""
        m, d, t = self.model, self.data, self.train
        if t.sampler == "documents" and t.tbptt:  # (data.mix takes the epoch sampler: _validate_sources)
            raise ConfigError("train.tbptt: truncated BPTT reads one stream; train.sampler=documents starts every "
                              "row at a document")
        if t.tune_shifts and t.tune != "state":
            raise ConfigError("train.tune_shifts: tunes the token shifts of state tuning; set train.tune=state")
        if t.tune != "state":
            return
        other = sorted(set(expand_layers(m.layers) if m.layers else ["rwkv7"]) - set(STATE_TUNED_KINDS))
        refusals = [
            (not t.init_from, "train.init_from",
             "state tuning trains an initial state for trained weights, which stay frozen: name them"),
            (t.sampler != "documents", "train.sampler",
             f"{t.sampler}: state tuning starts every row from the tuned state at a document's start, as a "
             "runtime starts a conversation: set train.sampler=documents"),
            (d.reset_at_eod, "data.reset_at_eod",
             "with state tuning every document starts from the tuned state, not a zero one; set it false"),
            (t.optimizer != "adamw", "train.optimizer",
             f"{t.optimizer}: state tuning trains the states alone, with AdamW (no matrix for Muon)"),
            (bool(t.decay_from), "train.decay_from",
             "branches a full run's decay; state tuning starts from train.init_from"),
            (bool(other), "train.tune",
             f"state tuning tunes RWKV-7 blocks' state (MoBA blocks stay frozen); not {', '.join(other)} blocks"),
        ]  # fmt: skip
        for bad, name, why in refusals:
            if bad:
                raise ConfigError(f"{name}: {why}")

    def _validate_sources(self, written: Collection[str]) -> None:
        """data.corpus, data.binidx and data.mix are three ways to give the training data: one at a time."""
        d, t = self.data, self.train
        given = [k for k, on in (("data.binidx", bool(d.binidx)), ("data.mix", d.mix is not None)) if on]
        if given and "data.corpus" in written and d.corpus != DataConfig().corpus:  # a saved config has the default
            given.insert(0, "data.corpus")
        if len(given) > 1:
            raise ConfigError(f"{given[0]} and {given[1]} both give the training data; set one of them")
        if "data.mix" in given:
            if not d.mix:
                raise ConfigError("data.mix: the mixture is empty; list at least one {path, weight}")
            for i, src in enumerate(d.mix):
                if not src.path:
                    raise ConfigError(f"data.mix[{i}].path: must name a prepared directory or a binidx prefix")
                if src.weight < 0:
                    raise ConfigError(f"data.mix[{i}].weight: must be >= 0")
            if sum(s.weight for s in d.mix) <= 0:
                raise ConfigError("data.mix: every weight is 0; at least one source must have a weight above 0")
            if t.tbptt:
                raise ConfigError("train.tbptt: truncated BPTT reads one stream; it does not take data.mix")
            if t.sampler != "epoch":
                raise ConfigError("train.sampler: data.mix reads each source one pass per epoch; use epoch")
        if d.val_binidx and d.val_tokens:
            raise ConfigError("data.val_binidx and data.val_tokens both set the validation split; set one of them")
        if d.binidx and not (d.val_binidx or d.val_tokens):
            raise ConfigError(
                "data.binidx: needs a validation split: data.val_binidx (a second prefix) or data.val_tokens "
                "(the prefix's last N tokens, held out)"
            )
        if d.val_binidx and not (d.binidx or d.mix is not None):
            raise ConfigError("data.val_binidx: validates data.binidx or data.mix; it needs one of them")
        if d.val_tokens and not d.binidx:
            raise ConfigError("data.val_tokens: holds out the end of data.binidx; it needs data.binidx")
        if (d.binidx or d.mix is not None) and d.tokenizer == "bpe":
            raise ConfigError(
                "data.tokenizer: bpe is trained on a corpus; with data.binidx or data.mix name the tokenizer "
                "(byte, world, or a tokenizer.json path)"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.train.ctx_len * self.train.micro_batch * self.train.grad_accum

    @property
    def total_steps(self) -> int:
        return max(1, self.train.tokens // self.tokens_per_step)


def _nearest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else f" (valid: {', '.join(options)})"


def _coerce(value, tp, where: str):
    """Check `value` against the annotation `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            if origin is list and isinstance(value, str):
                return _coerce([value], tp, where)  # a single path where a list is expected
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads 6e-4 (no dot) as a string
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 2e6 written for a token count
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key {where!r}{_nearest(str(key), names)}")
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


def _set_dotted(data: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, RecursionError):
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def config_to_dict(cfg: Config) -> dict:
    def plain(x):
        if isinstance(x, tuple):
            return list(x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))


def _written_keys(data: dict) -> set[str]:
    """The `section.key` names a raw config mapping sets."""
    return {f"{section}.{key}" for section, body in data.items() if isinstance(body, dict) for key in body}


def _expand_home(cfg: Config) -> None:
    """`~` in the config's paths means the home directory, as in a shell (not a directory named ~)."""
    d = cfg.data

    def home(p: str) -> str:
        return os.path.expanduser(p) if p.startswith("~") else p

    cfg.run_dir, d.prepared_dir = home(cfg.run_dir), home(d.prepared_dir)
    d.binidx, d.val_binidx = home(d.binidx), home(d.val_binidx)
    d.corpus, d.tokenizer, d.template = [home(p) for p in d.corpus], home(d.tokenizer), home(d.template)
    cfg.train.init_from = home(cfg.train.init_from)
    for src in d.mix or []:
        src.path = home(src.path)


# data.tokenizer's names (data/tokenizer.py); any other value is a tokenizer.json path.
TOKENIZER_NAMES = ("byte", "bpe", "world")


def _names_a_file(tokenizer: str) -> bool:
    """data.tokenizer is a tokenizer.json path, not a name: a file, or spelt as a path."""
    if tokenizer in TOKENIZER_NAMES or not tokenizer:
        return False
    return "/" in tokenizer or os.sep in tokenizer or tokenizer.endswith(".json") or os.path.exists(tokenizer)


def _template_names_a_file(template: str) -> bool:
    """data.template is a template file's path, not the name of a template rwkvx ships (a YAML file in
    rwkvx_cli/data/templates/, read by data/template.py). The folder is listed here rather than asked
    through data/, which builds on this module."""
    shipped = {p.stem for p in (Path(__file__).parent / "data" / "templates").glob("*.yaml")}
    spelt_as_path = "/" in template or os.sep in template or template.endswith((".yaml", ".yml", ".json"))
    return template not in shipped and (spelt_as_path or os.path.exists(template))


def resolve_paths(cfg: Config) -> Config:
    """Every path-valued setting made absolute (in place, against the current directory; `..` folded,
    links kept as named, so the run directory's own checks see a link as given), so that a run's saved
    config.yaml and checkpoints name the same files from any directory: run_dir, data.corpus,
    data.tokenizer (a tokenizer.json), data.template (a template file), data.prepared_dir,
    data.binidx, data.val_binidx, data.mix[].path and train.init_from. These stay: empty values ("": the
    default place), tokenizer and template names (and a bare word that names no file: a misspelt name,
    which its error then shows as written),
    an unused data.corpus (beside data.binidx or data.mix it stays the default, which validation reads
    as not given); globs keep their pattern."""
    d, t = cfg.data, cfg.train

    def full(p: str) -> str:
        return os.path.abspath(os.path.expanduser(p)) if p else p

    cfg.run_dir = full(cfg.run_dir)
    if not (d.binidx or d.mix is not None):
        d.corpus = [full(p) for p in d.corpus]
    if _names_a_file(d.tokenizer):
        d.tokenizer = full(d.tokenizer)
    if _template_names_a_file(d.template):
        d.template = full(d.template)
    d.prepared_dir, d.binidx, d.val_binidx = full(d.prepared_dir), full(d.binidx), full(d.val_binidx)
    for src in d.mix or []:
        src.path = full(src.path)
    t.init_from = full(t.init_from)
    return cfg


def config_from_dict(data: dict) -> Config:
    cfg = _build(Config, data)
    _expand_home(cfg)
    cfg.written = frozenset(_written_keys(data))
    cfg.validate(cfg.written)
    return cfg


def load_config(path: Path | str | None, overrides: list[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark else ""
            what = f" ({e.problem})" if str(getattr(e, "problem", "")).startswith("duplicate key") else ""
            raise ConfigError(f"{path}: invalid YAML{at}{what}") from None
        except RecursionError:
            raise ConfigError(f"{path}: invalid YAML (nested too deeply)") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    given = {o.split("=", 1)[0].strip() for o in overrides}
    if given & {"data.mix", "data.binidx"} and "data.corpus" not in given and isinstance(data.get("data"), dict):
        data["data"].pop("corpus", None)  # a source given on the command line replaces the file's
    for override in overrides:
        _set_dotted(data, override)
    return config_from_dict(data)
