"""The rows most backend tables share (see docs/operators.md#backends), so an op's
spec lists each backend once, in the order "auto" tries them: fastest first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from rwkvx_cli.ops.registry import Backend

ORACLE = "plain sequential torch, autograd backward (the fp64 oracle)"


def standard_backends(
    *,
    cpu: Callable,
    cpu_summary: str,
    cpu_unavailable: Callable[[], str | None],
    triton: Callable,
    triton_summary: str,
    triton_unavailable: Callable[[], str | None],
    chunked: Callable,
    chunked_summary: str,
    reference: Callable,
    reference_resets: bool = False,
    resets: bool = False,
) -> dict[str, Backend]:
    """The table of an op with a fused C++ kernel, fused Triton kernels, a pure-torch
    chunked form and a plain reference: cpu, triton, chunked, reference. Document starts
    (Backend.resets): `resets`, every backend takes them itself; `reference_resets`, the
    reference alone does (the others reset through the op's reset_inputs)."""
    rows = (
        cpu_backend(cpu, cpu_summary, cpu_unavailable),
        triton_backend("triton", triton, triton_summary, triton_unavailable),
        Backend("chunked", chunked, chunked_summary),
        reference_backend(reference, resets=reference_resets),
    )
    return backend_table(*(replace(bk, resets=True) if resets else bk for bk in rows))


def backend_table(*backends: Backend) -> dict[str, Backend]:
    """Backends by name, in the order given."""
    return {bk.name: bk for bk in backends}


def cpu_backend(
    fn: Callable, summary: str, unavailable: Callable[[], str | None], optional_state: bool = False
) -> Backend:
    """A fused C++ kernel: CPU tensors only, where it builds."""
    return Backend("cpu", fn, summary, devices=("cpu",), unavailable=unavailable, optional_state=optional_state)


def triton_backend(name: str, fn: Callable, summary: str, unavailable: Callable[[], str | None]) -> Backend:
    """Triton kernels: "auto" picks them on CUDA only; on CPU tensors they run under
    Triton's interpreter (the tests), far slower than the cpu backend."""
    return Backend(name, fn, summary, auto_devices=("cuda",), unavailable=unavailable)


def reference_backend(fn: Callable, summary: str = ORACLE, resets: bool = False) -> Backend:
    """The op's oracle: gradcheck's gate A compares against it; never picked by "auto". `resets`:
    it takes document starts itself (Backend.resets), the plain definition the others are checked on."""
    return Backend("reference", fn, summary, production=False, resets=resets)


def block_backends(
    op: str, reference: Callable, cpu=None, triton=None, cpu_optional_state: bool = False, resets: bool = False
) -> dict[str, Backend]:
    """The table of a fused block op (docs/operators.md#fused-block-ops): its fused C++ kernel
    (`cpu`) and Triton kernels (`triton`), each a (fn, summary, unavailable) triple, then the
    reference, the torch composition the unfused model runs: fp64, the gradient-check oracle; in
    fp32 and bf16, the in-run baseline of `rwkvx bench` (and what "auto" falls back to).
    `cpu_optional_state`: the C++ backend takes state=None as the zero state (Backend.optional_state).
    `resets`: every backend takes document starts (Backend.resets)."""
    rows = []
    if cpu is not None:
        rows.append(cpu_backend(*cpu, optional_state=cpu_optional_state))
    if triton is not None:
        rows.append(triton_backend("triton", *triton))
    summary = f"the unfused torch composition, autograd backward (the fp64 oracle of {op})"
    rows.append(reference_backend(reference, summary))
    return backend_table(*(replace(bk, resets=resets) for bk in rows))
