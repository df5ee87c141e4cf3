"""The fla peer row: argument and state-orientation glue (against a stand-in
module that follows fla's documented convention, since fla itself needs CUDA),
and bench's rule that a peer is benched by default only where it can run."""

import sys
import types

import torch

from rwkvx_cli.ops import get_op
from rwkvx_cli.ops.wkv7 import peer
from rwkvx_cli.ops.wkv7.reference import wkv7_reference
from rwkvx_cli.tools.bench import run_bench


def _fake_fla(monkeypatch, calls):
    """fla.ops.rwkv7.chunk_rwkv7 per its docstring: [B,T,H,K] inputs, w = log-decay,
    initial and final state [B,H,K,V] (key-major, the transpose of ours)."""

    def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=True, **_):
        calls.append(scale)
        y, s = wkv7_reference(r, w, k, v, a, b, initial_state.transpose(-1, -2))
        return y, s.transpose(-1, -2)

    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.rwkv7", types.SimpleNamespace(chunk_rwkv7=chunk_rwkv7))


def test_fla_glue_matches_reference_with_state(monkeypatch):
    calls = []
    _fake_fla(monkeypatch, calls)
    assert peer.fla_unavailable() is None
    g = torch.Generator().manual_seed(0)
    B, T, H, N = 2, 9, 2, 8
    r, k, v = (torch.randn(B, T, H, N, generator=g, dtype=torch.float64) for _ in range(3))
    w = -torch.rand(B, T, H, N, generator=g, dtype=torch.float64)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, N, generator=g, dtype=torch.float64), dim=-1)
    a, b = -kk, kk * 0.5
    s0 = torch.randn(B, H, N, N, generator=g, dtype=torch.float64)  # asymmetric: orientation matters
    y, s = peer.wkv7_fla(r, w, k, v, a, b, s0)
    y_ref, s_ref = wkv7_reference(r, w, k, v, a, b, s0)
    assert calls == [1.0]
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(s, s_ref)


def test_fla_reported_missing_and_not_benched_on_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.rwkv7", None)  # import raises ImportError
    assert "not installed" in peer.fla_unavailable()
    spec = get_op("wkv7")
    assert [bk.name for bk in spec.peer_backends()] == ["fla"]
    assert all(not bk.peer for bk in spec.production_backends())
    calls = []
    _fake_fla(monkeypatch, calls)  # installed, but fla runs on CUDA only: no CPU row by default
    report = run_bench(
        [spec], None, [{"B": 1, "T": 8, "H": 1, "N": 16}], "fp32", ["fwd"], "reference", torch.device("cpu")
    )
    assert "fla" not in {r.backend for r in report.rows} and "reference" in {r.backend for r in report.rows}
    assert calls == []
