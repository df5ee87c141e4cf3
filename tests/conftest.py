import os

import torch

# Two cores on CI: keep torch from oversubscribing them. Under pytest-xdist (`make test`: one worker
# per core) the cores are shared out, and the processes a test starts inherit the share.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads = max(1, min(2, torch.get_num_threads()) // _workers)
torch.set_num_threads(_threads)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

# Without a GPU, run the Triton kernels through Triton's interpreter on CPU tensors.
# Must be set before any kernel module is imported (the decorator reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import signal  # noqa: E402

import pytest  # noqa: E402

# A suite started in the background by a shell (`make test &`, nohup) inherits SIGINT ignored, and so
# would every process it starts: the tests that send a Ctrl-C to one would see it ignored. Python's own
# handler (what an interactive start gets) is put back, which the subprocesses inherit as the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _signal_dispositions():
    """Each test gets back the process's SIGINT/SIGTERM handlers and signal mask. Commands run in this process
    (typer's CliRunner) install their own, and one that ends as an interrupted command does ignores further
    stop signals (train/signals.py: ignore_stop_signals); a later test's subprocess would inherit SIG_IGN and
    never see the Ctrl-C it sends itself."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus: 400 short lines."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    lines = [f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 5}." for i in range(400)]
    path.write_text("\n".join(lines) + "\n")
    return path
