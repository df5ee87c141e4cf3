"""The GPU compile gate: every Triton kernel of every op, forward and backward, compiled ahead of
time for sm_80 and sm_90 at the production head sizes (64, 128) and input dtypes (fp32, bf16),
without a GPU. Each must compile, fit the target's shared memory and stay within its spill budget.

Marked `gpu_compile`: about 100 compile jobs, run by `.ci/run` (`make gpu-compile-test`) after the
main suite rather than inside its time budget."""

import pytest

triton = pytest.importorskip("triton")

from rwkvx_cli.tools.compile_gate import (  # noqa: E402
    SHARED_LIMIT,
    TARGETS,
    Launch,
    compile_all,
    compile_launch,
    record_in_subprocess,
    spill_budget,
)

# One worker runs this module, so its fixture (every launch recorded, ~2 minutes) runs once.
pytestmark = [pytest.mark.gpu_compile, pytest.mark.xdist_group("compile-gate")]


@pytest.fixture(scope="module")
def launches():
    return record_in_subprocess()


def test_every_triton_backend_is_recorded(launches):
    from rwkvx_cli.ops import get_op, op_names

    origins = {launch.origin.split(" ")[0] for launch in launches}
    for name in op_names():
        for bk in get_op(name).backends.values():
            if "triton" in bk.name and bk.production:
                assert f"{name}/{bk.name}" in origins
    assert {launch.constants.get("N") for launch in launches if "N" in launch.constants} >= {64, 128}


def test_no_launch_depends_on_what_a_kernel_writes():
    """The gate records each launch without running its kernel (record_launches): right as long as
    no backend reads a tensor's value to choose a launch's arguments. Every backend, at one head
    size and dtype, with what each launch would write, and each of torch's matmuls (not computed
    either), set to 1 everywhere, then to NaN: the same launches in the same order (a count, a
    maximum or a threshold read from a kernel's or a matmul's output differs between the two, or
    fails on NaN). Recording with every kernel and matmul run, at every size, gave the same
    launches too (2026-12-06), at 3x the time: not repeated here."""
    args = ((64,), ("fp32",))
    assert record_in_subprocess(*args, fill=1.0) == record_in_subprocess(*args, fill=float("nan"))


def test_every_kernel_compiles_fits_and_keeps_its_spill_budget(launches):
    results = compile_all(launches, TARGETS, workers=2)
    assert len(results) == len(launches) * len(TARGETS)
    problems = []
    for r in results:
        where = f"{r.launch.module}.{r.launch.kernel} [{r.launch.origin}] sm_{r.target}"
        if not r.ok:
            problems.append(f"{where}: {r.error}")
        elif r.shared_bytes > SHARED_LIMIT[r.target]:
            problems.append(f"{where}: {r.shared_bytes} B shared > {SHARED_LIMIT[r.target]}")
        elif r.spill_stores + r.spill_loads > spill_budget(r.launch):
            problems.append(f"{where}: spills {r.spill_stores}+{r.spill_loads} B > budget {spill_budget(r.launch)}")
    assert not problems, "\n".join(problems)


def test_a_broken_kernel_is_reported_not_raised():
    bad = Launch("rwkvx_cli.ops.wkv4.fused_triton", "_fwd_kernel", {"nope": "i32"}, {}, 4, 3, "planted")
    [r] = compile_all([bad], (90,), workers=1)
    assert not r.ok and r.error
    assert "TRITON_INTERPRET" not in r.error  # failed in the compiler, not for want of a clean process


def test_compiling_in_an_interpreter_process_says_why():
    # This process imported the kernels under the interpreter (conftest sets it without a GPU).
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter on, as on a machine without a GPU")
    launch = Launch("rwkvx_cli.ops.wkv4.fused_triton", "_fwd_kernel", {}, {}, 4, 3, "planted")
    r = compile_launch(launch, 90)
    assert not r.ok and "TRITON_INTERPRET" in r.error
