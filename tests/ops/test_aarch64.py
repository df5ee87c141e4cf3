"""Every op's `cpu` kernel in its aarch64 build (NEON: 16-byte vectors, blocks for 32
registers), run under qemu-user on this x86 machine (tests/ops/cross/qemu.py): both
gradient-check gates, and the model's head size over several snapshot chunks.

Needs Debian's g++-aarch64-linux-gnu and qemu-user. Without them the tests skip, unless
RWKVX_REQUIRE_CROSS=1 (set by .ci/run, which installs both), where they fail instead."""

import os
import platform

import pytest

from rwkvx_cli.ops import get_op
from rwkvx_cli.tools.gradcheck import run_gradcheck
from tests.ops.cross.qemu import NEON_BYTES, CrossBuild, tools_missing, use_cross_build
from tests.ops.test_cpu_isa import CPU_OPS, _check_model_head_size

MISSING = tools_missing() if platform.machine().lower() in ("x86_64", "amd64") else "an x86 host"
REQUIRED = os.environ.get("RWKVX_REQUIRE_CROSS") == "1"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("aarch64"),  # one worker builds the cross library (~33 s), not each
    pytest.mark.skipif(MISSING is not None and not REQUIRED, reason=f"aarch64 under qemu: {MISSING}"),
]


@pytest.fixture(scope="module")
def aarch64(tmp_path_factory):
    if MISSING is not None:
        pytest.fail(f"RWKVX_REQUIRE_CROSS=1, but {MISSING}")
    return CrossBuild(tmp_path_factory.mktemp("aarch64"))


@pytest.mark.parametrize("op", CPU_OPS)
def test_both_gates_and_the_model_head_size_on_aarch64(monkeypatch, aarch64, op):
    use_cross_build(monkeypatch, aarch64)
    first = len(aarch64.calls)
    spec = get_op(op)
    report = run_gradcheck(spec, [spec.backends["cpu"]])
    failing = [(r.gate, r.case, [c.name for c in r.columns if not c.passed]) for r in report.results if not r.passed]
    assert not failing, f"{op} cpu, aarch64 build: {failing}"
    _check_model_head_size(op)
    calls = aarch64.calls[first:]
    # the kernels really ran in the aarch64 build: forward and backward, fp32 and fp64, NEON-wide
    assert {s.rsplit("_", 1)[1] for s, _ in calls} == {"f32", "f64"}
    assert any("backward" in s for s, _ in calls) and any("forward" in s for s, _ in calls)
    assert {w for _, w in calls} == {NEON_BYTES}
