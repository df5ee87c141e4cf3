"""`python -m rwkvx_cli.tools.bench_sharded` on a tiny model, 2 gloo ranks (minutes: `make test-slow`):
every format measured on every rank, and the figures it reports are the ones docs/training.md quotes
(the sharded save's extra memory on rank 0 against the full one's, bytes per rank, the async stall
and the compute rate while the thread writes). And, with the ranks stood in for: it writes and deletes
only inside a directory of its own, whatever WORKDIR holds."""

import json
from pathlib import Path

import pytest

from rwkvx_cli.tools import bench_sharded

# What a user may have in WORKDIR, under the names the benchmark gives its own files.
USER_FILES = {"rows.jsonl": b"mine\n", "full/a": b"mine\n", "sharded/a": b"mine\n", "async/a": b"mine\n"}


def _plant(work: Path) -> None:
    for name, data in USER_FILES.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes(data)


def _args(work, **kw):
    fields = dict(workdir=str(work), ranks=1, layers=1, embd=64, vocab=64, formats=["sharded"], saves=1, no_load=True)
    return bench_sharded.argparse.Namespace(**{**fields, **kw})


def _fake_spawn(seen):
    """mp.spawn's stand-in: one rank's checkpoint in the format's directory beside the rows file it appends to."""

    def spawn(fn, args, nprocs, join):
        fmt, out = args[2], Path(args[-1])
        ckpt = out.parent / fmt / "step_00000001"
        ckpt.mkdir(parents=True)
        (ckpt / "shard-00000-of-00001.safetensors").write_bytes(b"weights")
        seen.append(out.parent)
        with open(out, "a") as f:
            f.write(json.dumps({"format": fmt, "rank": 0, "saves": [], "load": None}) + "\n")

    return spawn


def test_the_benchmark_deletes_nothing_it_did_not_write(tmp_path, monkeypatch):
    work = tmp_path / "work"
    _plant(work)
    seen = []
    monkeypatch.setattr("torch.multiprocessing.spawn", _fake_spawn(seen))
    rows = bench_sharded.run_benchmark(_args(work, formats=["full", "sharded"]))
    assert [r["format"] for r in rows] == ["full", "sharded"]
    assert seen[0] != work and seen[0].parent == work  # a directory of its own, inside WORKDIR
    assert {p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file()} == set(USER_FILES)
    assert all((work / name).read_bytes() == data for name, data in USER_FILES.items())


def test_an_interrupted_benchmark_deletes_only_its_own_directory(tmp_path, monkeypatch):
    work = tmp_path / "work"
    _plant(work)
    seen = []
    spawn = _fake_spawn(seen)

    def interrupted(*args, **kwargs):
        spawn(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr("torch.multiprocessing.spawn", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench_sharded.run_benchmark(_args(work))
    assert not seen[0].exists()
    assert {p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file()} == set(USER_FILES)


@pytest.mark.slow
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
