"""The gdn registry entry: the delta rule's, with one gate per head (delta/spec.py)."""

from __future__ import annotations

from rwkvx_cli.ops.delta.spec import make_spec
from rwkvx_cli.ops.gdn import gdn
from rwkvx_cli.ops.registry import register

SPEC = register(make_spec("gdn", "gated delta rule, one gate per head (Gated DeltaNet)", gdn, per_channel=False))
