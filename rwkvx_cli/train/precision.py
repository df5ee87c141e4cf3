"""Numeric precision of a run (`train.precision`, docs/training.md#precision).

    fp32        every op in fp32 (matmuls at full fp32 precision)
    bf16-mixed  fp32 master weights and optimizer state; the forward runs under bf16 autocast
                (CUDA or CPU); the recurrent ops keep fp32 state and accumulation
    tf32        fp32 weights and activations, fp32 matmuls on the tensor cores' TF32 (CUDA only)
    auto        bf16-mixed on CUDA, fp32 on the CPU (what rwkvx did before the setting existed)

Training, validation and `rwkvx eval` run under the same mode; FSDP2 gets the matching
MixedPrecisionPolicy (train/distributed.py).
"""

from __future__ import annotations

import contextlib

import torch

from rwkvx_cli.config import PRECISIONS, ConfigError

__all__ = ["PRECISIONS", "autocast", "fsdp_policy", "resolve", "set_matmul_precision"]


def resolve(name: str, device: torch.device, *, fallback: bool = False) -> str:
    """The mode `name` runs as on `device` ("auto" resolved). A mode the device cannot run is a
    one-line ConfigError, or with `fallback` (evaluating a checkpoint elsewhere) fp32."""
    if name not in PRECISIONS:
        raise ConfigError(f"train.precision: {name!r} is not one of {', '.join(PRECISIONS)}")
    cuda = device.type == "cuda"
    if name == "auto":
        return "bf16-mixed" if cuda and _bf16_supported(device) else "fp32"
    why = None
    if name == "bf16-mixed" and cuda and not _bf16_supported(device):
        why = f"bf16-mixed: {_gpu_name(device)} does not support bfloat16; use train.precision=fp32 (or tf32)"
    elif name == "tf32" and not cuda:
        why = "tf32 is a CUDA matmul mode; on the CPU use fp32 or bf16-mixed"
    elif name == "tf32" and torch.cuda.get_device_capability(device) < (8, 0):
        why = f"tf32: {_gpu_name(device)} has no TF32 tensor cores (compute capability 8.0+); use fp32"
    if why is None:
        return name
    if fallback:
        return "fp32"
    raise ConfigError(f"train.precision: {why}")


def _bf16_supported(device: torch.device) -> bool:
    return torch.cuda.is_bf16_supported()  # of the current device (distributed.init sets it to this rank's)


def _gpu_name(device: torch.device) -> str:
    try:
        return f"this GPU ({torch.cuda.get_device_name(device)})"
    except Exception:  # noqa: BLE001 - only for the message
        return "this GPU"


def set_matmul_precision(mode: str) -> None:
    """fp32 matmuls on TF32 under tf32, at full precision otherwise (a process-wide torch setting)."""
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")


def autocast(mode: str, device: torch.device):
    """The context a forward pass (training or validation) runs in under `mode` (a resolved one)."""
    if mode != "bf16-mixed":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def fsdp_policy(mode: str):
    """FSDP2's MixedPrecisionPolicy for `mode`: bf16 parameters in the forward and backward, gradients
    reduced in fp32, the sharded master weights fp32; None (FSDP's default, all fp32) otherwise."""
    if mode != "bf16-mixed":
        return None
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
