"""`rwkvx bench --model CFG`: a few training steps of a config on random tokens.

MFU = tokens/s x train FLOPs per token / measured matmul peak, with train FLOPs
per token = 6 x matmul weights + each recurrent layer's op FLOPs for one token
(the op registry's count, e.g. wkv7: 28 N² per head), the count `rwkvx init`
prints (attention FLOPs not included). The time split comes from
torch.profiler: the self time of every event inside a recurrence op (the ops'
autograd functions, forward and backward, with the aten calls they make), of
the other matmul calls, of the fused block ops' kernels (`rwkvx::` ops), and of
everything else.

The step is the trainer's: the config's loss head (train.head, train.l2wrap),
train.grad_cp, train.chunk_len, train.precision and train.compile (the warm-up step compiles).
Memory of one step, gradients freed before it
as the trainer does: on CUDA from the caching allocator's peak, on the CPU from
the profiler's record of every allocation and free (sum in time order, peak of
the running total):

    peak_mb        peak bytes allocated during the step above its start
                   (the weights and optimizer state, allocated before, are not in it)
    grads_mb       the parameters' gradients (part of that peak)
    activation_mb  peak_mb - grads_mb: what the forward keeps for the backward,
                   plus the backward's transient buffers

The steps are timed as one block (mean step time). With `vs_gpt` the config is compared with a
nanoGPT-style transformer of the same shape (models/gpt.py: n_layer, n_embd, vocab_size, one
head per model.head_size channels, train.ctx_len positions, tied head) trained in the same
process on the same tokens: same B, T, device, precision, loss head (no L2Wrap), the trainer's
AdamW (models/optimizer.py) with the same groups, and number of steps. The two models' steps
alternate (round i: RWKV then GPT, or GPT then RWKV on odd rounds), each step timed on its own,
and both step times are medians over the rounds, so that the machine's noise hits both alike;
`rwkv_over_gpt` = RWKV tokens/s / GPT tokens/s; with `vs_unchunked` (a config with
train.chunk_len) the same window's unchunked step is timed the same way, interleaved, and its
memory measured: `chunked_over_unchunked` = chunked step time / unchunked step time; with
`vs_unfused` the same model with model.fused off (the same weights: the same seed), a second
model with its own optimizer, interleaved the same way, its memory measured: `fused_speedup` =
unfused step time / fused step time.

Every run also times one optimizer step of each optimizer (train.optimizer: adamw, muon) on the
gradients of one micro-batch, interleaved over the rounds (medians), and reports each one's share of
a training step of the config with it: train.grad_accum micro-batch steps (forward and backward) and
one optimizer step (`optimizers`; the weights are put back after).

With train.tune=state (or `state`, rwkvx's state file: the steps start from it) the step is state
tuning's: every weight frozen, the loss backpropagated to the initial state (models/state.py) alone,
AdamW over it; the weights are the config's seeded init, not train.init_from's (the time does not depend
on their values), and `trainable` counts the state's parameters. `vs_finetune` also times full
fine-tuning of the same model (every weight trained, train.optimizer's groups) interleaved with it, and
reports what each keeps between steps: the optimizer's state and what a checkpoint holds (the trained
tensors and their optimizer state: a state-tuned checkpoint names its frozen base, never copies it).

Every run also counts the ops a block dispatches in one forward + backward (tools/op_count.py):
`ops_per_block` for this config's model, and with `vs_unfused` / `vs_gpt` for the unfused model
and the GPT.
"""

from __future__ import annotations

import copy
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from rwkvx_cli.config import OPTIMIZERS, load_config
from rwkvx_cli.errors import UsageError
from rwkvx_cli.models import build_model, document_starts, parameter_groups
from rwkvx_cli.models import optimizer as optimizers
from rwkvx_cli.models.gpt import GPT, GPTConfig
from rwkvx_cli.models.losses import micro_batch_loss, uses_l2wrap
from rwkvx_cli.models.model import layer_kinds
from rwkvx_cli.models.optimizer import adamw
from rwkvx_cli.models.state import InitialState
from rwkvx_cli.models.summary import model_summary
from rwkvx_cli.runs import runtime as rt
from rwkvx_cli.runs.runtime import matmul_peak_gflops, profiler_quiet, sync
from rwkvx_cli.runs.tuned import load_state, read_state_file, tuned_shifts
from rwkvx_cli.tools.op_count import ops_per_block

COUNT_T = 64  # tokens of the op-count steps: the count does not depend on T (without chunk_len)
# With data.reset_at_eod, the benched window holds a document every this many tokens (the cost of
# the resets does not depend on how many there are: every op rewrites or reads its flags whole).
DOCUMENT_LEN = 64


def document_len(ctx_len: int) -> int:
    """The benched window's document length: DOCUMENT_LEN, or half a window no longer than that, so that
    a document starts inside it (a start at position 0 changes nothing: every window begins from the
    zero state)."""
    return min(DOCUMENT_LEN, max(ctx_len // 2, 1))

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")
# Names of the recurrence ops' autograd functions (_WKV7CPU, its backward node), torch ops
# (rwkvx::wkv7_cpu_fwd) and op modules, not preceded by a letter: rwkv7_prep is not wkv7.
RECURRENCE_MARKER = re.compile(r"(?<![A-Za-z])(WKV7|WKV4|RWKV8|Delta|Moba|wkv7|wkv4|rwkv8|delta|moba)")


def _inside_fused(event) -> bool:
    """Inside a fused kernel op (`rwkvx::*`: the fused block ops' kernels, outside a recurrence)."""
    while event is not None:
        if event.name.startswith("rwkvx::"):
            return True
        event = event.cpu_parent
    return False


def _inside_recurrence(event) -> bool:
    while event is not None:
        if RECURRENCE_MARKER.search(event.name):
            return True
        event = event.cpu_parent
    return False


def bench_model(
    config: Path,
    steps: int,
    device: torch.device,
    overrides: list[str] = (),
    vs_gpt: bool = False,
    vs_unchunked: bool = False,
    vs_unfused: bool = False,
    vs_packed: bool = False,
    state: Path | None = None,
    vs_finetune: bool = False,
) -> dict:
    cfg = load_config(config, list(overrides))
    tc = cfg.train
    flags = (
        ("--vs-gpt", vs_gpt),
        ("--vs-unchunked", vs_unchunked),
        ("--vs-unfused", vs_unfused),
        ("--vs-packed", vs_packed),
    )
    given = [flag for flag, on in flags if on]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} do not go together; run them separately")
    if vs_unchunked and not 0 < tc.chunk_len < tc.ctx_len:
        raise UsageError(
            f"--vs-unchunked compares chunked BPTT with the whole window: train.chunk_len ({tc.chunk_len}) must be "
            f"set and shorter than train.ctx_len ({tc.ctx_len})"
        )
    if vs_unfused and not cfg.model.fused:
        raise UsageError("--vs-unfused compares the fused blocks with the unfused ones: model.fused must be true")
    if vs_packed and not cfg.data.reset_at_eod:
        raise UsageError("--vs-packed compares document starts with plain packing: data.reset_at_eod must be true")
    if vs_packed and tc.ctx_len < 2:
        raise UsageError(
            f"--vs-packed: train.ctx_len {tc.ctx_len} has no room for a document start after the window's first token"
        )
    model = build_model(cfg.model, tc.seed).to(device)
    model.grad_checkpointing = tc.grad_cp
    runtime = rt.Runtime(device, rt.resolve_precision(tc.precision, device))
    runtime.apply()
    mode = runtime.precision
    l2wrap = uses_l2wrap(tc.l2wrap, model.kinds)
    tuned = None
    if vs_finetune and state is None and tc.tune != "state":
        raise UsageError(
            "--vs-finetune compares state tuning with full fine-tuning: set train.tune=state or give --state"
        )
    if state is not None or tc.tune == "state":
        if given:
            raise UsageError(f"{given[0]} does not go with state tuning (train.tune=state, --state)")
        tuned = _initial_state(model, tc.tune_shifts, state).to(device)
        opt = adamw([{"params": list(tuned.parameters()), "weight_decay": 0.0}], tc.lr, tc.betas, tc.eps)
    else:
        opt = _optimizer(model, tc, tc.optimizer)
    trainable = tuned if tuned is not None else model
    B, T = tc.micro_batch, tc.ctx_len
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen).to(device)
    starts, doc_len = None, document_len(T)
    if cfg.data.reset_at_eod:  # a document every doc_len tokens, each begun by its eod token
        idx[:, ::doc_len] = cfg.data.eod_id
        starts = document_starts(idx[:, :-1], cfg.data.eod_id)

    step = _train_step(model, opt, idx, tc.head, l2wrap, mode, device, tc.compile, tc.chunk_len, starts, tuned)
    step()  # warm-up
    sync(device)
    if vs_gpt:
        gc = GPTConfig.matching(cfg)
        gpt = GPT(gc, tc.seed).to(device)
        gpt_parameters = sum(p.numel() for p in gpt.parameters())
        gpt_flops = gpt.train_flops_per_token(T)
        gpt_opt = adamw(parameter_groups(gpt, tc.lr, tc.weight_decay), tc.lr, tc.betas, tc.eps)
        gpt_step = _train_step(gpt, gpt_opt, idx, tc.head, False, mode, device, tc.compile)  # no L2Wrap: nanoGPT's
        gpt_step()  # warm-up
        step_s, gpt_step_s = _interleaved(step, gpt_step, steps, device)
        del gpt, gpt_opt, gpt_step  # the memory and profile below are the RWKV step's alone
    elif vs_unchunked:
        whole = _train_step(model, opt, idx, tc.head, l2wrap, mode, device, tc.compile)  # the same window, unchunked
        whole()  # warm-up
        step_s, whole_s = _interleaved(step, whole, steps, device)
        whole_memory = step_memory(whole, model, device)
    elif vs_packed:
        packed = _train_step(model, opt, idx, tc.head, l2wrap, mode, device, tc.compile, tc.chunk_len)  # no starts
        packed()  # warm-up
        step_s, packed_s = _interleaved(step, packed, steps, device)
        packed_memory = step_memory(packed, model, device)
        del packed
    elif vs_finetune:
        full = copy.deepcopy(model).requires_grad_(True)  # the same weights, every one trained
        full_opt = _optimizer(full, tc, tc.optimizer)
        full_step = _train_step(full, full_opt, idx, tc.head, l2wrap, mode, device, tc.compile, tc.chunk_len, starts)
        full_step()  # warm-up (and the optimizer's state made)
        step_s, full_s = _interleaved(step, full_step, steps, device)
        full_memory = {**step_memory(full_step, full, device), **kept_mb(full, full_opt)}
        full_trainable = sum(p.numel() for p in full.parameters())
        del full, full_opt, full_step
    elif vs_unfused:
        plain = build_model(replace(cfg.model, fused=False), tc.seed).to(device)  # the same weights
        plain.grad_checkpointing = tc.grad_cp
        plain_opt = adamw(parameter_groups(plain, tc.lr, tc.weight_decay), tc.lr, tc.betas, tc.eps)
        plain_step = _train_step(
            plain, plain_opt, idx, tc.head, l2wrap, mode, device, tc.compile, tc.chunk_len, starts
        )
        plain_step()  # warm-up
        step_s, plain_s = _interleaved(step, plain_step, steps, device)
        plain_memory = step_memory(plain_step, plain, device)
        del plain, plain_opt, plain_step
    else:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        step_s = (time.perf_counter() - start) / steps

    memory = step_memory(step, trainable, device) | kept_mb(trainable, opt)
    compared = given[0] if given else ("--vs-finetune" if vs_finetune else None)
    if tuned is None:
        optimizer_s = optimizer_steps(model, tc, idx, l2wrap, mode, device, steps, starts)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with profiler_quiet(), torch.profiler.profile(activities=activities) as prof:
        step()
        sync(device)
    use_cuda = device.type == "cuda"
    total = recurrence = matmul = fused = 0.0
    for e in prof.events():
        t = e.self_device_time_total if use_cuda else e.self_cpu_time_total
        total += t
        if _inside_recurrence(e):  # the op's own work, including the aten calls it makes
            recurrence += t
        elif e.name in MATMUL_OPS:
            matmul += t
        elif _inside_fused(e):
            fused += t
    total = max(total, 1e-9)
    summary = model_summary(model)
    peak = matmul_peak_gflops(device, torch.bfloat16 if use_cuda else torch.float32)
    tokens_per_s = B * T / step_s
    mfu = tokens_per_s * summary["train_flops_per_token"] / (peak * 1e9) * 100
    result = {
        "config": str(config),
        "overrides": list(overrides),
        "device": str(device),
        "precision": mode,
        "grad_cp": tc.grad_cp,
        "chunk_len": tc.chunk_len,
        "head": tc.head,
        "batch": B,
        "ctx_len": T,
        **memory,
        "tokens_per_s": tokens_per_s,
        "step_ms": step_s * 1e3,
        "recurrence_pct": recurrence / total * 100,
        "matmul_pct": matmul / total * 100,
        "fused_pct": fused / total * 100,
        "other_pct": (total - recurrence - matmul - fused) / total * 100,
        "train_flops_per_token": summary["train_flops_per_token"],
        "matmul_gflops": peak,
        "mfu_pct": mfu,
        "mfu_formula": "MFU = tokens/s x train FLOPs per token / matmul peak; train FLOPs per token = "
        "6 x matmul weights + the recurrence ops' FLOPs per token (wkv7: 28 N^2 x heads per layer)",
        "parameters": summary["parameters"],
        "timing": f"median of {steps} steps, interleaved with the {compared.removeprefix('--vs-')} step's"
        if compared
        else f"mean of {steps} steps",
        "ops_per_block": _count_rwkv(cfg, mode, device, l2wrap),
        "grad_accum": tc.grad_accum,
        "tune": "state" if tuned is not None else "full",
        "trainable": sum(p.numel() for p in trainable.parameters() if p.requires_grad),
    }
    if tuned is None:
        result["optimizer"] = tc.optimizer
        result["optimizers"] = optimizer_shares(optimizer_s, step_s, tc.optimizer, tc.grad_accum)
    else:
        result["optimizer"] = "adamw (the state)"
        result["state"] = str(state) if state is not None else None
    if vs_finetune:
        result["finetune"] = {"tokens_per_s": B * T / full_s, "step_ms": full_s * 1e3, **full_memory}
        result["finetune"]["trainable"] = full_trainable
        result["state_over_finetune"] = {
            "step_time": step_s / full_s,
            "optimizer_memory": result["optimizer_mb"] / full_memory["optimizer_mb"],
            "checkpoint": result["checkpoint_mb"] / full_memory["checkpoint_mb"],
        }
    if vs_unfused:
        plain_tokens_per_s = B * T / plain_s
        result["unfused"] = {
            "tokens_per_s": plain_tokens_per_s,
            "step_ms": plain_s * 1e3,
            **plain_memory,
            "mfu_pct": plain_tokens_per_s * summary["train_flops_per_token"] / (peak * 1e9) * 100,
            "ops_per_block": _count_rwkv(cfg, mode, device, l2wrap, fused=False),
        }
        result["fused_speedup"] = plain_s / step_s
    if vs_packed:
        result["packed"] = {"tokens_per_s": B * T / packed_s, "step_ms": packed_s * 1e3, **packed_memory}
        result["reset_over_packed"] = step_s / packed_s
        result["document_len"] = doc_len
        result["document_starts"] = (T - 1) // doc_len  # per row, after position 0
    if vs_unchunked:
        result["unchunked"] = {"tokens_per_s": B * T / whole_s, "step_ms": whole_s * 1e3, **whole_memory}
        result["chunked_over_unchunked"] = step_s / whole_s
    if vs_gpt:
        gpt_tokens_per_s = B * T / gpt_step_s
        result["gpt"] = {
            "shape": f"{gc.n_layer} layers x {gc.n_embd} wide, {gc.n_head} heads, ctx {gc.ctx_len}, "
            f"vocab {gc.vocab_size}, tied head",
            "n_layer": gc.n_layer,
            "n_embd": gc.n_embd,
            "n_head": gc.n_head,
            "ctx_len": gc.ctx_len,
            "vocab_size": gc.vocab_size,
            "tied_head": True,
            "parameters": gpt_parameters,
            "tokens_per_s": gpt_tokens_per_s,
            "step_ms": gpt_step_s * 1e3,
            "train_flops_per_token": gpt_flops,
            "mfu_pct": gpt_tokens_per_s * gpt_flops / (peak * 1e9) * 100,
            "flops_formula": "6 x matmul weights (the tied head once, no positional table) "
            "+ 12 x n_layer x n_embd x ctx (attention scores and values, the full T x T square)",
            "ops_per_block": _count_gpt(cfg, mode, device),
        }
        result["rwkv_over_gpt"] = tokens_per_s / gpt_tokens_per_s
    return result


def _count_rwkv(cfg, mode: str, device: torch.device, l2wrap: bool, fused: bool | None = None) -> dict:
    """Ops per block (tools/op_count.py) of the config's most common block kind, in the config's
    precision, loss head and grad_cp, unchunked, on 1 x COUNT_T tokens."""
    kinds = layer_kinds(cfg.model)
    kind = max(dict.fromkeys(kinds), key=kinds.count)
    fused = cfg.model.fused if fused is None else fused

    def step_of(n: int):
        model = build_model(replace(cfg.model, layers=[kind] * n, fused=fused), cfg.train.seed).to(device)
        model.grad_checkpointing = cfg.train.grad_cp
        return _loss_step(model, cfg, mode, device, l2wrap)

    total, by_op = ops_per_block(step_of)
    return {"kind": kind, "fused": fused, "ops": total, "by_op": by_op}


def _count_gpt(cfg, mode: str, device: torch.device) -> dict:
    def step_of(n: int):
        gpt = GPT(replace(GPTConfig.matching(cfg), n_layer=n), cfg.train.seed).to(device)
        return _loss_step(gpt, cfg, mode, device, False)

    total, by_op = ops_per_block(step_of)
    return {"kind": "gpt", "ops": total, "by_op": by_op}


def _loss_step(model, cfg, mode: str, device: torch.device, l2wrap: bool):
    """The forward and backward of one training step (no optimizer) on 1 x COUNT_T random tokens."""
    idx = torch.randint(0, cfg.model.vocab_size, (1, min(COUNT_T, cfg.train.ctx_len) + 1)).to(device)

    def step():
        for p in model.parameters():
            p.grad = None
        with rt.autocast(mode, device):
            loss, _ = micro_batch_loss(model, idx[:, :-1], idx[:, 1:], None, cfg.train.head, l2wrap)
        loss.backward()
        sync(device)

    return step


def _train_step(
    model,
    opt,
    idx: torch.Tensor,
    head: str,
    l2wrap: bool,
    mode: str,
    device: torch.device,
    compile: bool = False,
    chunk_len: int = 0,
    starts: torch.Tensor | None = None,
    initial: InitialState | None = None,
):
    """The trainer's step on one micro-batch of `idx` (inputs idx[:, :-1], targets idx[:, 1:]): the
    loss under the precision's autocast, backward, the optimizer step, gradients freed. With
    `compile` (train.compile) the forward runs through torch.compile, as the trainer's does; with
    `chunk_len` (train.chunk_len) the window runs as chunked full BPTT; `starts`: the inputs'
    document starts (data.reset_at_eod); `initial`: the rows start from this tuned state (state tuning)."""
    forward = torch.compile(model) if compile else model

    def step():
        state = None if initial is None else initial.expand(idx.shape[0])
        with rt.autocast(mode, device):
            loss, _ = micro_batch_loss(forward, idx[:, :-1], idx[:, 1:], state, head, l2wrap, chunk_len, starts)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _initial_state(model, shifts: bool, path: Path | None) -> InitialState:
    """State tuning's trainable state: zeros (train.tune_shifts says whether with shifts), or the state file
    at `path` (its own shifts); `model` frozen."""
    model.requires_grad_(False)
    if path is None:
        return InitialState(model, shifts)
    tensors, _ = read_state_file(path)
    initial = InitialState(model, tuned_shifts(tensors))
    load_state(initial, tensors, f"--state {path}")
    return initial


def _optimizer(model, tc, kind: str) -> torch.optim.Optimizer:
    """The trainer's optimizer of `kind` (train.optimizer) over the model's groups."""
    groups = parameter_groups(model, tc.lr, tc.weight_decay, kind == "muon", tc.muon_lora)
    return optimizers.build(groups, replace(tc, optimizer=kind))


def optimizer_steps(model, tc, idx, l2wrap: bool, mode: str, device, rounds: int, starts=None) -> dict[str, float]:
    """Median seconds of one optimizer step of each optimizer (OPTIMIZERS) on the gradients of one
    micro-batch, over `rounds` rounds, interleaved (each round steps every optimizer, in turn order
    rotating), each optimizer warmed up by one step first (its state allocated)."""
    for p in model.parameters():
        p.grad = None
    with rt.autocast(mode, device):
        loss, _ = micro_batch_loss(model, idx[:, :-1], idx[:, 1:], None, tc.head, l2wrap, tc.chunk_len, starts)
    loss.backward()
    with torch.no_grad():
        saved = [p.detach().clone() for p in model.parameters()]  # the steps below must not train the model
    opts = {kind: _optimizer(model, tc, kind) for kind in OPTIMIZERS}
    times: dict[str, list[float]] = {kind: [] for kind in OPTIMIZERS}
    for opt in opts.values():
        opt.step()
    for i in range(rounds):
        kinds = OPTIMIZERS[i % len(OPTIMIZERS) :] + OPTIMIZERS[: i % len(OPTIMIZERS)]
        for kind in kinds:
            sync(device)
            start = time.perf_counter()
            opts[kind].step()
            sync(device)
            times[kind].append(time.perf_counter() - start)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved, strict=True):
            p.copy_(s)
            p.grad = None
    return {kind: statistics.median(t) for kind, t in times.items()}


def optimizer_shares(optimizer_s: dict[str, float], step_s: float, own: str, accum: int = 1) -> dict[str, dict]:
    """Each optimizer's step time and its share of a training step of the config with it: `accum`
    (train.grad_accum) times the benched micro-batch step (which ran `own`) less `own`'s step, plus
    this optimizer's one step."""
    rest = max(step_s - optimizer_s[own], 0.0) * accum
    return {
        kind: {"step_ms": t * 1e3, "share_pct": t / (rest + t) * 100, "train_step_ms": (rest + t) * 1e3}
        for kind, t in optimizer_s.items()
    }


def _interleaved(step_a, step_b, rounds: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of one call of each step over `rounds` rounds; each round runs both, a then b,
    or b then a on odd rounds, so that the machine's noise (and either step's after-effects on
    caches and clocks) falls on both alike."""
    times_a, times_b = [], []
    for i in range(rounds):
        pair = ((step_a, times_a), (step_b, times_b))
        for step, times in pair if i % 2 == 0 else pair[::-1]:
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def step_memory(step, model: torch.nn.Module, device: torch.device) -> dict:
    """Peak memory of one call of `step` (a training step that leaves the gradients freed), in MiB:
    see the module docstring for what each figure holds."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    if device.type == "cuda":
        sync(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - start) / 2**20
    else:
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with profiler_quiet(), torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
            step()
        peak = cpu_peak_bytes(prof.events()) / 2**20
    return {"peak_mb": peak, "grads_mb": grads, "activation_mb": max(peak - grads, 0.0)}


def kept_mb(trainable: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What training keeps between steps, in MiB: the optimizer's state (`opt` has stepped), and what a
    checkpoint holds: the trained tensors and that optimizer state."""
    params = sum(p.numel() * p.element_size() for p in trainable.parameters() if p.requires_grad)
    moments = sum(
        t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
    )
    return {"optimizer_mb": moments / 2**20, "checkpoint_mb": (params + moments) / 2**20}


def cpu_peak_bytes(events) -> int:
    """Peak of the running total of CPU allocations in a memory profile: each op's net allocation
    (its self memory) and each free ("[memory]" events), in time order."""
    current = peak = 0
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.device_type == torch.autograd.DeviceType.CPU:
            current += e.self_cpu_memory_usage
            peak = max(peak, current)
    return peak
