"""Worker processes that run `Encoder` tasks, results in task order, with a bounded number of tasks in flight.

Task k goes to worker k % N, and each worker runs its tasks in the order received, so results come back in task order
by reading the workers in turn: no reordering, and which worker finishes first does not matter. At most `depth` tasks
wait per worker, so memory is bounded by N * depth tasks and their results, not by the corpus (a plain
`multiprocessing.Pool.imap` reads its whole input ahead).

Workers come from the forkserver (a fresh single-threaded process, not a fork of this one, whose other threads could
hold locks: rich's refresh thread, the tokenizers' thread pools). Each worker ignores SIGINT (this process stops them),
and dies with its parent (PR_SET_PDEATHSIG on Linux): after a Ctrl-C, a SIGTERM or a kill -9 of this process no
worker is left running.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import sys
from collections import deque
from collections.abc import Iterable, Iterator

from rwkvx_cli.data.errors import DataError

_POLL_SECONDS = 0.5  # how often a wait for a result checks that its worker is alive


@contextlib.contextmanager
def worker_pool(n: int, spec, depth: int = 2) -> Iterator[WorkerPool]:
    pool = WorkerPool(n, spec, depth)
    try:
        yield pool
    except BaseException:
        pool.kill()
        raise
    pool.close()


class WorkerPool:
    def __init__(self, n: int, spec, depth: int = 2):
        ctx = multiprocessing.get_context("forkserver")
        # The forkserver imports the encoder once; each worker is a fork of it (milliseconds, no re-import).
        ctx.set_forkserver_preload(["rwkvx_cli.data.encode"])
        self.depth = depth
        self._tasks = [ctx.Queue() for _ in range(n)]
        self._results = [ctx.Queue() for _ in range(n)]
        self._procs = []
        try:
            with _main_not_imported():
                for i in range(n):
                    p = ctx.Process(target=_worker, args=(self._tasks[i], self._results[i], spec), daemon=True)
                    p.start()
                    self._procs.append(p)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def imap(self, items: Iterable[tuple]) -> Iterator[tuple]:
        """(result, tag) for each (task, tag), in order. A `Local` task is not sent: it is its own result, in its
        place; nothing after a ReadFailure is read."""
        from rwkvx_cli.data.encode import Local, ReadFailure

        n = len(self._procs)
        pending: deque = deque()  # (worker or None for a failure, tag or the failure)
        it = iter(items)
        sent = in_flight = 0
        exhausted = False
        while True:
            while not exhausted and in_flight < n * self.depth:
                item = next(it, None)
                if item is None:
                    exhausted = True
                    break
                task, tag = item
                if isinstance(task, Local):
                    pending.append((None, task, tag))
                    if isinstance(task, ReadFailure):
                        exhausted = True
                        break
                    continue
                w = sent % n
                self._tasks[w].put(task)
                pending.append((w, None, tag))
                sent += 1
                in_flight += 1
            if not pending:
                return
            w, failure, tag = pending.popleft()
            if w is None:
                yield failure, tag
            else:
                in_flight -= 1
                yield self._get(w), tag

    def _get(self, w: int):
        while True:
            try:
                result = self._results[w].get(timeout=_POLL_SECONDS)
            except queue.Empty:
                p = self._procs[w]
                if p.is_alive():
                    continue
                code = p.exitcode
                if code is not None and -code in (signal.SIGINT, signal.SIGTERM):
                    raise KeyboardInterrupt from None  # the process group is being stopped
                how = f"was killed by signal {-code}" if code and code < 0 else f"exited with status {code}"
                hint = " (out of memory?)" if code == -signal.SIGKILL else ""
                raise DataError(f"tokenizer worker {w} {how}{hint}") from None
            if isinstance(result, _Crash):
                raise DataError(result.message)
            return result

    def close(self) -> None:
        """Stop the workers after their last task."""
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        """Stop every worker now (SIGKILL: they hold nothing that needs saving) and release the queues."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for q in self._tasks + self._results:
            q.cancel_join_thread()  # exiting must not wait to flush tasks to a dead worker
            q.close()


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """Start workers without importing the caller's __main__ in them (as forkserver and spawn children do, to
    unpickle what it defines): they need nothing from it, and a script that calls `prepare` outside an
    `if __name__ == "__main__":` block would run again in every worker."""
    main = sys.modules.get("__main__")
    saved = {k: v for k, v in vars(main).items() if k in ("__spec__", "__file__")} if main is not None else {}
    try:
        if main is not None:
            main.__spec__ = None
            if "__file__" in saved:
                del main.__file__
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


class _Crash:
    """A worker's exception, sent back as the result of its task (pickles whatever the exception was)."""

    def __init__(self, message: str):
        self.message = message


def _die_with_parent() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us when the forkserver goes
    except (OSError, AttributeError):  # not Linux: the forkserver's end still closes our queue
        pass


def _worker(tasks, results, spec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent went before the line above took effect
        os._exit(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    from rwkvx_cli.data.encode import Encoder

    try:
        encoder = Encoder(spec)
    except Exception as e:
        results.put(_Crash(f"cannot start a tokenizer worker: {e}"))
        return
    while (task := tasks.get()) is not None:
        try:
            result = encoder.run(task)
        except DataError as e:
            result = _Crash(str(e))
        except Exception as e:  # a bug: say what, in order, instead of a hang
            result = _Crash(f"tokenizer worker failed: {type(e).__name__}: {e}")
        results.put(result)
