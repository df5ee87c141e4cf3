"""Worker processes that run `Encoder` tasks beside this process, results in task order, with a bounded number of
tasks in flight.

Each task goes to the worker with the fewest in flight (at most `depth` each), and each worker runs its tasks in the
order received, so results come back in task order by reading, for each task, the worker it went to: no reordering
buffer, and which worker finishes first does not matter. When the result due next is not ready (the workers are
starting, or busy), this process runs the next task itself (`local`) instead of waiting: with N - 1 workers, N
processes tokenize and none waits for the workers to start. At most `depth` tasks wait per worker and as many run
here ahead of their turn, so memory is bounded by the workers, not the corpus (a plain `multiprocessing.Pool.imap`
reads its whole input ahead).

Workers come from the forkserver (a fresh single-threaded process, not a fork of this one, whose other threads could
hold locks: rich's refresh thread, the tokenizers' thread pools), started by a thread here, so that the forkserver's
start (~0.3 s) is not spent waiting. They talk over plain pipes, one each way per worker; a thread in the worker
receives tasks and another sends results, so neither side ever waits on the other's pipe. Each worker ignores SIGINT
(this process stops them) and ends when this process ends: after a Ctrl-C, a SIGTERM or a kill -9 of it no worker is
left running.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from rwkvx_cli.data.errors import DataError


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
        self.depth = depth
        self._send, self._recv, self._procs = [], [], []
        self._lock = threading.Lock()  # the three lists grow together in the starting thread
        self._stopping = False
        self._start_error: BaseException | None = None
        self._starter = threading.Thread(target=self._start, args=(n, spec), name="start-workers", daemon=True)
        self._starter.start()

    def _start(self, n: int, spec) -> None:
        try:
            ctx = _forkserver()
            with _main_not_imported():
                for _ in range(n):
                    task_r, task_w = ctx.Pipe(duplex=False)
                    result_r, result_w = ctx.Pipe(duplex=False)
                    _widen(result_r)
                    p = ctx.Process(target=_worker, args=(task_r, result_w, spec, os.getpid()), daemon=True)
                    if self._stopping:  # kill() waits for this thread, then stops every worker started
                        return
                    p.start()
                    with self._lock:
                        self._send.append(task_w)
                        self._recv.append(result_r)
                        self._procs.append(p)
                    task_r.close()  # the worker's ends: closed here, so that its death reads as EOF
                    result_w.close()
        except BaseException as e:  # raised in the caller's thread by imap
            self._start_error = e

    def _workers(self) -> int:
        if self._start_error is not None:
            raise self._start_error
        with self._lock:
            return len(self._procs)

    def imap(self, items: Iterable[tuple], local: Callable | None = None) -> Iterator[tuple]:
        """(result, tag) for each (task, tag), in order. A `Local` task is not sent: it is its own result, in its
        place; nothing after a ReadFailure is read. `local(task)` runs a task in this process, when the result due
        next is not ready yet (without it, this process waits for the workers)."""
        from rwkvx_cli.data.encode import Local, ReadFailure

        pending: deque = deque()  # (worker, None, tag) for a task sent; (None, result, tag) for one known here
        busy: list[int] = []  # tasks in flight per worker
        it = iter(items)
        exhausted = False
        held = 0  # results computed here ahead of their turn

        def read() -> tuple | None:
            nonlocal exhausted
            item = None if exhausted else next(it, None)
            if item is None or isinstance(item[0], ReadFailure):
                exhausted = True
            return item

        def run_here(item: tuple) -> None:
            nonlocal held
            task, tag = item
            if not isinstance(task, Local):
                try:
                    task = local(task)
                except DataError as e:  # raised in its turn, as a worker's would be
                    task = _Crash(str(e))
                held += 1
            pending.append((None, task, tag))

        while True:
            busy += [0] * (self._workers() - len(busy))
            while busy and min(busy) < self.depth and (item := read()) is not None:
                task, tag = item
                if isinstance(task, Local):
                    pending.append((None, task, tag))
                    continue
                w = busy.index(min(busy))
                self._put(w, task)
                busy[w] += 1
                pending.append((w, None, tag))
            due = pending[0][0] if pending else None
            # Nothing due yet (no worker has started), or the result due is not ready: run the next task here.
            idle = not pending or (due is not None and not self._recv[due].poll(0))
            if idle and local is not None and held < self.depth * (len(busy) + 1) and (item := read()) is not None:
                run_here(item)
                continue
            if not pending:
                if exhausted:
                    return
                self._starter.join(0.05)  # no worker yet, and nothing to run here
                continue
            w, result, tag = pending.popleft()
            if w is None:
                held -= not isinstance(result, Local)
            else:
                busy[w] -= 1
                result = self._get(w)
            if isinstance(result, _Crash):
                raise DataError(result.message)
            yield result, tag

    def _put(self, w: int, task) -> None:
        try:
            self._send[w].send(task)
        except (BrokenPipeError, ConnectionResetError):
            raise self._death(w) from None

    def _get(self, w: int):
        try:
            return self._recv[w].recv()
        except (EOFError, ConnectionResetError):
            raise self._death(w) from None

    def _death(self, w: int) -> BaseException:
        """What to raise for a worker that ended without being told to."""
        p = self._procs[w]
        p.join(timeout=5)
        code = p.exitcode
        if code is not None and -code in (signal.SIGINT, signal.SIGTERM):
            return KeyboardInterrupt()  # the process group is being stopped
        how = f"was killed by signal {-code}" if code and code < 0 else f"exited with status {code}"
        hint = " (out of memory?)" if code == -signal.SIGKILL else ""
        return DataError(f"tokenizer worker {w} {how}{hint}")

    def close(self) -> None:
        """Stop the workers after their last task (a worker not started yet is not started: nothing is left)."""
        self._stopping = True
        self._starter.join()
        for conn in self._send:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        """Stop every worker now (SIGKILL: they hold nothing that needs saving) and close the pipes."""
        self._stopping = True  # no more starts
        self._starter.join()
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for conn in self._send + self._recv:
            conn.close()


def _forkserver():
    """The forkserver context, its server started (a no-op when it runs). The server imports the encoder once; each
    worker is a fork of it (milliseconds, no re-import).

    Ctrl-C reaches the whole process group and this process stops the workers, so neither the server nor a worker
    may take it: the server starts with SIGINT blocked (a signal mask survives exec and fork), so that no Ctrl-C
    while it imports, or while a worker starts, prints a traceback from them. The resource tracker is started first:
    its own start unblocks SIGINT in the calling thread."""
    from multiprocessing import forkserver, resource_tracker

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["rwkvx_cli.data.encode"])
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with _main_not_imported():
            forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return ctx


def _widen(conn) -> None:
    """A results pipe of 1 MiB where Linux allows it (default 64 KiB): a task's tokens (megabytes) then cross in a
    few writes, each waking the other side, instead of dozens."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size: the default stays
        pass


def start_forkserver() -> None:
    """Start the forkserver in a thread, for a pool made later: its start (~0.3 s: a Python process importing the
    encoder) then overlaps what this process does meanwhile (loading the tokenizer) instead of delaying the workers."""

    def start() -> None:
        with contextlib.suppress(Exception):  # the pool's own start reports what went wrong
            _forkserver()

    threading.Thread(target=start, name="start-forkserver", daemon=True).start()


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """Start workers without importing the caller's __main__ in them (as forkserver and spawn children do, to
    unpickle what it defines): they need nothing from it, and a script that calls `prepare` outside an
    `if __name__ == "__main__":` block would run again in every worker. One thread at a time: two overlapping
    would restore each other's changes."""
    with _MAIN_LOCK:
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


_MAIN_LOCK = threading.RLock()


class _Crash:
    """A worker's exception, sent back as the result of its task (pickles whatever the exception was)."""

    def __init__(self, message: str):
        self.message = message


def _die_with(owner: int) -> None:
    """End this worker when the process that started the pool ends, however it ends (kill -9 included).

    The forkserver, our parent, does not end with it: each worker holds the pipe end whose closing would tell the
    forkserver to go. So a thread waits for the owner itself (a pidfd; polling where there is none)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: and if the forkserver goes
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        try:
            fd = os.pidfd_open(owner)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])  # readable when the owner has exited
        else:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(owner, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    continue
        os._exit(1)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()
    try:
        os.kill(owner, 0)
    except ProcessLookupError:  # gone before the watch began
        os._exit(1)


def _worker(tasks, results, spec, owner: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # and blocked since the fork (_forkserver): the owner stops us
    _die_with(owner)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        try:
            while True:
                task = tasks.recv()
                inbox.put(task)
                if task is None:
                    return
        except (EOFError, OSError):  # the owner closed its end
            inbox.put(None)

    def send() -> None:
        while (result := outbox.get()) is not None:
            try:
                results.send(result)
            except OSError:  # the owner is gone
                os._exit(1)

    threading.Thread(target=receive, name="tasks", daemon=True).start()
    sender = threading.Thread(target=send, name="results")
    sender.start()
    from rwkvx_cli.data.encode import Encoder

    try:
        encoder = Encoder(spec)
    except Exception as e:
        encoder = None
        failure = _Crash(f"cannot start a tokenizer worker: {e}")
    while (task := inbox.get()) is not None:
        if encoder is None:
            result = failure
        else:
            try:
                result = encoder.run(task)
            except DataError as e:
                result = _Crash(str(e))
            except Exception as e:  # a bug: say what, in order, instead of a hang
                result = _Crash(f"tokenizer worker failed: {type(e).__name__}: {e}")
        outbox.put(result)
    outbox.put(None)
    sender.join()
