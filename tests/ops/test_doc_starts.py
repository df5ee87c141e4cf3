"""Document starts (docs/operators.md#document-starts): a window of packed documents run with
`starts` gives the outputs, final state and every gradient that the documents give run one by one,
each from the zero state (the first from the window's initial state unless the window starts one),
for every op that resets and every backend that runs here. fp64 to 1e-10, fp32 to 1e-5."""

import pytest
import torch

from rwkvx_cli.ops import get_op, op_names
from rwkvx_cli.ops.registry import Case, OpSpec

B, T = 3, 37
# Row 0: a start at the first token, inside a 16-step chunk, on a chunk edge, back to back, at the
# last token. Row 1: its initial state carries to t = 15. Row 2: no start at all.
STARTS = ((0, 5, 16, 17, 36), (15, 32), ())


def _resetting() -> list[OpSpec]:
    return [get_op(n) for n in op_names() if any(get_op(n).resets_with(bk) for bk in get_op(n).backends.values())]


def _params():
    for spec in _resetting():
        for bk in spec.backends.values():
            if spec.resets_with(bk) and bk.unavailable() is None and not bk.peer:
                # A backend that `auto` never picks on the CPU (the Triton kernels, under the
                # interpreter here: 10-25 s a case; wkv7's chunked torch form) is held to its logic
                # by its fp64 case here; its fp32 case runs in make test-slow.
                interpreted = "cpu" not in (bk.auto_devices or bk.devices)
                for dtype in (torch.float64, torch.float32):
                    if dtype == torch.float64 and not bk.supports_fp64:
                        continue
                    slow = interpreted and bk.supports_fp64 and dtype == torch.float32
                    yield pytest.param(
                        spec.name, bk.name, dtype, id=f"{spec.name}-{bk.name}-{str(dtype)[6:]}",
                        marks=[pytest.mark.slow] if slow else [],
                    )


def _case(spec: OpSpec, starts=()) -> Case:
    """The op's first case at [B, T] with two heads and a nonzero initial state."""
    base = spec.cases[0]
    return Case("packed", {**base.dims, "B": B, "T": T, "H": 2}, True, dict(base.options), base.absent, starts)


def _document_case(spec: OpSpec, length: int) -> Case:
    """One document of one row: the op's case at [1, length], no starts."""
    base = _case(spec)
    return Case("document", {**base.dims, "B": 1, "T": length}, True, base.options, base.absent)


def _documents(row: int) -> list[tuple[int, int]]:
    cuts = sorted({0, *STARTS[row], T})
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _fresh(spec: OpSpec, dtype) -> dict:
    """The op's zero state, as its sampler draws it for a case without `nonzero_state` (zeros; for
    wkv4, pp = -1e38)."""
    base = _case(spec)
    case = Case("fresh", base.dims, False, base.options, base.absent)
    return {n: t.to(dtype) for n, t in spec.sample(case, torch.Generator().manual_seed(0)).items() if n in spec.states}


def _slice(spec: OpSpec, tensors: dict, row: int, lo: int, hi: int, grows: bool, fresh: dict) -> dict:
    """Row `row`, times lo..hi of the sequence inputs; the states of the row (the window's initial
    state for the first document unless it is a start, else the zero state: `fresh`'s, or for a
    state that grows with the tokens read, none of them)."""
    out = {}
    for n, t in tensors.items():
        if n in spec.states:
            s = t[row : row + 1]
            out[n] = s if lo == 0 and lo not in STARTS[row] else s[:, :0] if grows else fresh[n][row : row + 1]
        elif t.dim() >= 2 and t.shape[:2] == (B, T):
            out[n] = t[row : row + 1, lo:hi]
        else:
            out[n] = t
    return out


def _grad(t: torch.Tensor) -> torch.Tensor:
    """t's gradient; zeros where nothing reached it: an empty state (moba's cache before any token),
    or an input that only feeds the state after its token (rwkv8's v and d in a one-token document
    that is not its row's last)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


@pytest.mark.parametrize(("name", "backend", "dtype"), list(_params()))
def test_packed_documents_equal_documents_run_apart(name, backend, dtype):
    spec = get_op(name)
    bk = spec.backends[backend]
    gen = torch.Generator().manual_seed(0)
    sample = {n: t.to(dtype) for n, t in spec.sample(_case(spec), gen).items()}
    seq = [n for n in spec.inputs if sample[n].dim() >= 2 and sample[n].shape[:2] == (B, T)]
    with torch.no_grad():
        y0, s0 = spec.call(bk, sample, _case(spec))
    cots = [torch.rand(y.shape, generator=gen, dtype=torch.float64).to(dtype) - 0.5 for y in y0]
    cot_state = [torch.rand(s.shape, generator=gen, dtype=torch.float64).to(dtype) - 0.5 for s in s0]
    # A state that grows with the tokens read (moba's key-value cache) holds every token of the
    # window, [B, P + T, ...]: only the part from the row's last start is the last document's state
    # (the part before is dead, read by no later call), so only that part is compared and given a
    # cotangent.
    grows = any(s.shape != sample[n].shape for n, s in zip(spec.states, s0, strict=True))
    live = torch.ones(B, s0[0].shape[1] if grows else 1, dtype=torch.bool)
    if grows:
        P = sample[spec.states[0]].shape[1]
        for row in range(B):
            live[row, : P + max(STARTS[row], default=-P)] = False
        cot_state = [c * live.view(B, -1, *(1,) * (c.dim() - 2)) for c in cot_state]

    # Packed: one call with starts.
    leaves = {n: t.clone().requires_grad_(True) for n, t in sample.items()}
    y, states = spec.call(bk, leaves, _case(spec, STARTS))
    loss = sum((o * c).sum() for o, c in zip(y, cots, strict=True))
    loss = loss + sum((s * c).sum() for s, c in zip(states, cot_state, strict=True))
    loss.backward()
    states = [s.detach() * live.view(B, -1, *(1,) * (s.dim() - 2)) for s in states]
    packed = ([o.detach() for o in y], states, {n: _grad(t) for n, t in leaves.items()})

    # Apart: each document of each row on its own, no starts.
    fresh = _fresh(spec, dtype)
    ys = [torch.zeros_like(o) for o in y]
    finals = [torch.zeros_like(s) for s in states]
    grads = {n: torch.zeros_like(t) for n, t in sample.items()}
    for row in range(B):
        docs = _documents(row)
        for i, (lo, hi) in enumerate(docs):
            pieces = _slice(spec, sample, row, lo, hi, grows, fresh)
            piece = {n: t.clone().requires_grad_(True) for n, t in pieces.items()}
            py, ps = spec.call(bk, piece, _document_case(spec, hi - lo))
            part = sum((o * c[row : row + 1, lo:hi]).sum() for o, c in zip(py, cots, strict=True))
            if i == len(docs) - 1:
                # (a growing state: the last document's tokens end the row's)
                tail = slice(-ps[0].shape[1], None) if grows else slice(None)
                part = part + sum((s * c[row : row + 1, tail]).sum() for s, c in zip(ps, cot_state, strict=True))
                for f, s in zip(finals, ps, strict=True):
                    f[row : row + 1, tail] = s.detach()
            part.backward()
            for o_all, o in zip(ys, py, strict=True):
                o_all[row : row + 1, lo:hi] = o.detach()
            for n, t in piece.items():
                if n in seq:
                    grads[n][row : row + 1, lo:hi] = _grad(t)
                elif n in spec.states:
                    if lo == 0 and lo not in STARTS[row]:
                        grads[n][row : row + 1] = _grad(t)
                else:
                    grads[n] += _grad(t)
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for a, b in zip(packed[0], ys, strict=True):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(packed[1], finals, strict=True):
        torch.testing.assert_close(a, b, **tol)
    for n in grads:
        torch.testing.assert_close(packed[2][n], grads[n], **tol, msg=lambda m, n=n: f"d{n}: {m}")


def test_every_resetting_op_has_a_gradient_check_case_with_starts():
    """gradcheck (both gates) and the cases iterate document starts like any other option."""
    for spec in _resetting():
        assert any(c.starts for c in spec.cases), spec.name
        assert spec.fd_case.starts, spec.name


@pytest.mark.parametrize("bad", ["float", "shape", "list"])
def test_bad_starts_are_one_line_errors(bad):
    from rwkvx_cli.ops import wkv7

    x = torch.zeros(1, 4, 1, 2)
    starts = {
        "float": torch.zeros(1, 4),
        "shape": torch.zeros(1, 5, dtype=torch.bool),
        "list": [True, False, False, False],
    }[bad]
    with pytest.raises(ValueError, match="starts"):
        wkv7(x, x, x, x, x, x, starts=starts)
