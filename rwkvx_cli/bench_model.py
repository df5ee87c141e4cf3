"""`rwkvx bench --model CFG`: a few training steps of a config on random tokens.

MFU = tokens/s x train FLOPs per token / measured matmul peak, with train FLOPs
per token = 6 x matmul weights + each recurrent layer's op FLOPs for one token
(the op registry's count, e.g. wkv7: 28 N² per head), the count `rwkvx init`
prints (attention FLOPs not included). The time split comes from
torch.profiler: the self time of every event inside a recurrence op (the ops'
autograd functions, forward and backward, with the aten calls they make), of
the other matmul calls, and of everything else.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rwkvx_cli.bench import matmul_peak_gflops, sync
from rwkvx_cli.config import load_config
from rwkvx_cli.models import build_model, parameter_groups
from rwkvx_cli.train.run import model_summary

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")
# Names of the ops' autograd functions (and their backward nodes) and op modules.
RECURRENCE_MARKERS = ("WKV7", "WKV4", "RWKV8", "Delta", "Moba", "wkv7", "wkv4", "rwkv8", "delta", "moba")


def _inside_recurrence(event) -> bool:
    while event is not None:
        if any(m in event.name for m in RECURRENCE_MARKERS):
            return True
        event = event.cpu_parent
    return False


def bench_model(config: Path, steps: int, device: torch.device) -> dict:
    cfg = load_config(config)
    model = build_model(cfg.model, cfg.train.seed).to(device)
    opt = torch.optim.AdamW(parameter_groups(model, cfg.train.lr, cfg.train.weight_decay), lr=cfg.train.lr)
    B, T = cfg.train.micro_batch, cfg.train.ctx_len
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen).to(device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = model.loss(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    step_s = (time.perf_counter() - start) / steps

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync(device)
    use_cuda = device.type == "cuda"
    total = recurrence = matmul = 0.0
    for e in prof.events():
        t = e.self_device_time_total if use_cuda else e.self_cpu_time_total
        total += t
        if _inside_recurrence(e):  # the op's own work, including the aten calls it makes
            recurrence += t
        elif e.name in MATMUL_OPS:
            matmul += t
    total = max(total, 1e-9)
    summary = model_summary(model)
    peak = matmul_peak_gflops(device, torch.bfloat16 if use_cuda else torch.float32)
    tokens_per_s = B * T / step_s
    mfu = tokens_per_s * summary["train_flops_per_token"] / (peak * 1e9) * 100
    return {
        "config": str(config),
        "device": str(device),
        "tokens_per_s": tokens_per_s,
        "step_ms": step_s * 1e3,
        "recurrence_pct": recurrence / total * 100,
        "matmul_pct": matmul / total * 100,
        "other_pct": (total - recurrence - matmul) / total * 100,
        "train_flops_per_token": summary["train_flops_per_token"],
        "matmul_gflops": peak,
        "mfu_pct": mfu,
        "mfu_formula": "MFU = tokens/s x train FLOPs per token / matmul peak; train FLOPs per token = "
        "6 x matmul weights + the recurrence ops' FLOPs per token (wkv7: 28 N^2 x heads per layer)",
    }
