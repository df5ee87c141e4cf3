"""The kda registry entry: the delta rule's, with one gate per key channel (delta/spec.py)."""

from __future__ import annotations

from rwkvx_cli.ops.delta.spec import make_spec
from rwkvx_cli.ops.kda import kda
from rwkvx_cli.ops.registry import register

SPEC = register(
    make_spec("kda", "gated delta rule, one gate per key channel (Kimi Delta Attention)", kda, per_channel=True)
)
