"""Forged model files for the tests: a safetensors file rewritten with another header (the data
bytes kept), and the tiny models they start from."""

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import build_model

TINY = ModelConfig(vocab_size=257, n_layer=1, n_embd=64, head_size=64)


def tiny_state(cfg: ModelConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    return build_model(cfg, seed).state_dict()


def write_tiny(path: Path, cfg: ModelConfig = TINY) -> Path:
    """A valid rwkvx-layout .safetensors of a tiny RWKV-7 (what the forgeries start from)."""
    save_file({k: v.contiguous() for k, v in tiny_state(cfg).items()}, path)
    return path


def split(path: Path) -> tuple[dict, bytes]:
    """(header, data bytes) of a safetensors file."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict | str | bytes, data: bytes) -> bytes:
    """A safetensors file of `header` (an object, or raw JSON text) and `data`."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    return struct.pack("<Q", len(header)) + header + data


def forge(path: Path, edit, out: Path | None = None) -> Path:
    """Rewrite `path`'s header through `edit(header) -> header` (an object or raw JSON text)."""
    header, data = split(path)
    out = out or path
    out.write_bytes(join(edit(header), data))
    return out
