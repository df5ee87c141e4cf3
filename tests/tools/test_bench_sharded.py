"""`python -m rwkvx_cli.tools.bench_sharded` on a tiny model, 2 gloo ranks (minutes: `make test-slow`):
every format measured on every rank, and the figures it reports are the ones docs/training.md quotes
(the sharded save's extra memory on rank 0 against the full one's, bytes per rank, the async stall
and the compute rate while the thread writes)."""

import pytest

from rwkvx_cli.tools import bench_sharded

pytestmark = pytest.mark.slow


def test_every_format_is_measured_on_every_rank(tmp_path):
    work = tmp_path / "work"
    args = bench_sharded.argparse.Namespace(
        workdir=str(work), ranks=2, layers=2, embd=256, vocab=4096, formats=list(bench_sharded.FORMATS),
        saves=2, no_load=False,
    )
    rows = bench_sharded.run_benchmark(args)
    want = [(f, r) for f in sorted(bench_sharded.FORMATS) for r in (0, 1)]
    assert sorted((r["format"], r["rank"]) for r in rows) == want
    by = {(r["format"], r["rank"]): r for r in rows}
    full0, sharded = by["full", 0]["saves"][0], [by["sharded", r]["saves"][0] for r in (0, 1)]
    assert full0["bytes_written_mb"] > 0 and by["full", 1]["saves"][0]["bytes_written_mb"] == 0  # rank 0 writes alone
    total = sum(s["bytes_written_mb"] for s in sharded)
    assert abs(total - full0["bytes_written_mb"]) < 0.01 * full0["bytes_written_mb"]  # the same state, split
    assert all(abs(s["bytes_written_mb"] - total / 2) < 0.1 * total for s in sharded)  # about half each
    for r in (0, 1):
        saves = by["async", r]["saves"]
        assert len(saves) == 2 and by["async", r]["load"] is None
        for s in saves:
            assert s["write_seconds"] >= s["seconds"] > 0 and 0 < s["compute_rate_while_writing"]
            assert s["staged_mb"] == pytest.approx(sharded[r]["bytes_written_mb"], rel=0.05)  # one more copy
        assert by["sharded", r]["load"]["seconds"] > 0
    assert not any(work.iterdir())  # everything written is deleted
