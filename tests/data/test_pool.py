"""The worker pool: results in task order whoever ran each task (this process or a worker), errors in their turn."""

import json
import time
from pathlib import Path

import pytest

from rwkvx_cli.data import DataError
from rwkvx_cli.data.encode import Encoder, EncoderSpec, RangeTask, ReadFailure, UnitEnd, ranges
from rwkvx_cli.data.pool import worker_pool

ROOT = Path(__file__).resolve().parents[2]


def _spec(kind: str = "byte") -> EncoderSpec:
    return EncoderSpec(
        kind=kind, tokenizer_json=None, world_engine=None, eod_id=0, dtype="uint16", text_field="text",
        skip_bad=False, rule="any" if kind == "byte" else "line+space", piece_chars=8192, max_chars=1 << 24,
    )


def _tasks(tmp_path: Path, n: int = 40) -> list[RangeTask]:
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": text[i * 997 : i * 997 + 2000]}) + "\n" for i in range(400)))
    size = path.stat().st_size
    step = -(-size // n)
    return [RangeTask(str(path), a, min(size, a + step)) for a in range(0, size, step)]


@pytest.mark.parametrize("kind", ["byte", "world"])
def test_results_in_order_whoever_ran_them(tmp_path, kind):
    tasks = _tasks(tmp_path)
    encoder = Encoder(_spec(kind))
    expected = [encoder.run(t).tokens for t in tasks]
    here = []

    def local(task):  # slow here, so that the workers, once started, take tasks too
        time.sleep(0.03)
        here.append(task)
        return encoder.run(task)

    items = [(t, i) for i, t in enumerate(tasks)]
    items.insert(5, (UnitEnd(), "end"))  # a marker keeps its place
    with worker_pool(2, _spec(kind)) as pool:
        out = list(pool.imap(items, local=local))
    assert [tag for _, tag in out] == [tag for _, tag in items]
    assert [r.tokens for r, tag in out if tag != "end"] == expected
    assert 0 < len(here) < len(tasks)  # both sides tokenized
    with worker_pool(2, _spec(kind)) as pool:  # without `local` every task goes to a worker
        assert [r.tokens for r, _ in pool.imap([(t, i) for i, t in enumerate(tasks)])] == expected


def test_an_error_is_raised_in_its_turn(tmp_path):
    """A task that fails (here or in a worker) raises after every earlier result, before anything later."""
    tasks = _tasks(tmp_path, 10)
    tasks[6] = RangeTask(str(tmp_path / "missing.jsonl"), 0, 100)
    items = [(t, i) for i, t in enumerate(tasks)]
    items.insert(8, (ReadFailure("read failed after task 7"), "failure"))
    encoder = Encoder(_spec())
    for local in (encoder.run, None):
        seen = []
        with pytest.raises(DataError, match="cannot read input .*missing.jsonl"):
            with worker_pool(1, _spec()) as pool:
                for _, tag in pool.imap(items, local=local):
                    seen.append(tag)
        assert seen == list(range(6))


def test_the_forkserver_and_its_workers_never_take_ctrl_c():
    """Ctrl-C reaches the whole process group; a forkserver importing its preloads, or a worker starting, while it
    arrives must not print a traceback: both run with SIGINT blocked from their first instruction. A worker that
    raises SIGINT at once exits cleanly, and this process keeps its own handler and mask."""
    import signal
    from multiprocessing import forkserver

    from rwkvx_cli.data.pool import _forkserver

    p = _forkserver().Process(target=signal.raise_signal, args=(signal.SIGINT,))
    p.start()
    p.join(timeout=30)
    assert p.exitcode == 0
    server = Path(f"/proc/{forkserver._forkserver._forkserver_pid}/status")
    if server.exists():  # Linux
        mask = next(line for line in server.read_text().splitlines() if line.startswith("SigBlk:")).split()[1]
        blocked = int(mask, 16)
        assert blocked & (1 << (signal.SIGINT - 1))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


@pytest.mark.parametrize(("processes", "first", "last"), [(1, True, True), (2, False, False), (2, True, False),
                                                          (2, False, True), (3, True, True)])
def test_ranges_cover_the_unit_once_and_grow_and_shrink_only_with_workers(processes, first, last):
    batch, start, end = 4096, 1000, 1000 + 50 * 4096 + 123
    got = list(ranges(start, end, batch, processes, first, last))
    assert got[0][0] == start and got[-1][1] == end and all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))
    sizes = [b - a for a, b in got]
    assert max(sizes) == batch and min(sizes[:-1]) >= batch // 64
    if processes == 1 or not (first or last):
        assert sizes[:-1] == [batch] * (len(sizes) - 1)  # plain batches
    if processes > 1 and first:
        assert sizes[:7] == [64, 128, 256, 512, 1024, 2048, 4096]  # this process runs these while workers start
    if processes > 1 and last:
        tail = sizes[sizes.index(batch) : -1]
        assert tail == sorted(tail, reverse=True) and tail[-1] == batch // 64  # they shrink to the end
