"""Size checks before allocating: an estimate of the memory a model, a training step, a bench
shape or a gradient check needs, against what the device has free. What cannot fit is refused
with one line giving the estimate, instead of swapping the machine to a halt or dying in the
allocator. The estimates are lower bounds (weights, optimizer moments, the largest activations),
so a refusal is never wrong about "cannot fit"; RWKVX_NO_MEMORY_CHECK=1 skips the check."""

from __future__ import annotations

import math
import os

import torch

from rwkvx_cli.errors import RwkvxError

OVERRIDE = "RWKVX_NO_MEMORY_CHECK"


class TooBigError(RwkvxError):
    """The request cannot fit in the device's memory."""


def available_bytes(device: torch.device | str) -> int | None:
    """Free memory of `device` (CPU: MemAvailable plus free swap), or None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return torch.cuda.mem_get_info(device)[0]
        except (RuntimeError, AssertionError):
            return None
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields["MemAvailable"] + fields.get("SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_fits(need: float, what: str, device: torch.device | str) -> None:
    """Raise TooBigError when `need` bytes cannot fit in `device`'s free memory."""
    if os.environ.get(OVERRIDE, "") not in ("", "0"):
        return
    free = available_bytes(device)
    if free is None or need <= free:
        return
    raise TooBigError(
        f"{what} needs at least {gib(need)}, but {torch.device(device).type} has {gib(free)} free; "
        f"make it smaller, or set {OVERRIDE}=1 to try anyway"
    )


def parameter_count(mcfg) -> int:
    """Parameters of the model `mcfg` describes, counted on the meta device (no memory): one block
    of each kind, times how many the stack has."""
    from rwkvx_cli.models.model import Block, layer_kinds

    kinds = layer_kinds(mcfg)
    total = 0
    with torch.device("meta"):
        for kind in dict.fromkeys(kinds):
            block = Block(kind, mcfg, 1, has_ln0=False)
            total += kinds.count(kind) * sum(p.numel() for p in block.parameters())
    total += 2 * mcfg.vocab_size * mcfg.n_embd + 4 * mcfg.n_embd  # emb, head, ln0, ln_out
    return total


def training_bytes(cfg, precision: str) -> tuple[float, str]:
    """(bytes, how) a training step needs at least: fp32 weights, gradients and AdamW's two moments
    (16 bytes a parameter; 4 under state tuning, whose frozen weights have neither), one micro-batch's
    (under chunked BPTT one chunk's) logits and log-probabilities and block inputs, and the sampled
    batch of token ids. `precision`: the resolved mode (runs/runtime.py)."""
    t, m = cfg.train, cfg.model
    params = parameter_count(m)
    act_bytes = 2 if precision == "bf16-mixed" else 4  # bf16 autocast
    # Chunked BPTT (train.chunk_len) keeps one chunk's activations at a time.
    tokens = t.micro_batch * (min(t.ctx_len, t.chunk_len) if t.chunk_len else t.ctx_len)
    # fp32 logits (or their fp32 copy under autocast) and log-softmax's saved output; each block's input.
    activations = tokens * (2 * m.vocab_size * 4 + len_layers(m) * m.n_embd * act_bytes)
    batch = 2 * t.micro_batch * t.grad_accum * (t.ctx_len + 1) * 8
    need = (4 if t.tune == "state" else 16) * params + activations + batch
    return need, f"training {params:,} parameters with {t.micro_batch} x {t.ctx_len} tokens per micro-batch"


def len_layers(mcfg) -> int:
    from rwkvx_cli.models.model import layer_kinds

    return len(layer_kinds(mcfg))


def check_training(cfg, runtime) -> None:
    need, what = training_bytes(cfg, runtime.precision)
    check_fits(need, what, runtime.device)


def check_model(mcfg, device: torch.device | str = "cpu") -> None:
    """A model's fp32 weights, and their serialized copy when they are saved."""
    params = parameter_count(mcfg)
    check_fits(8 * params, f"a model of {params:,} parameters", device)


def check_op_shape(dims: dict, element_bytes: int, tensors: int, what: str, device) -> None:
    """An op call on `dims` (B, T, H, N...) holds at least `tensors` tensors of B*T*H*N elements."""
    n = math.prod(int(dims.get(k, 1)) for k in "BTHN")
    check_fits(n * element_bytes * tensors, what, device)
