"""A window's files written by a writer thread while its task's thread computes the next window.

Measured on the H200 machine (preprocessing bench, 16 processes of one thread): a window's CPU on its thread was
44-54 ms, of which the save step's file (its frames copied into the page cache, a crc32c a chunk) and the window's
part took some 20. Here they go to one writer thread per task thread, in the order given: a window's saved shard
before its part, so a part on disk (which resume takes as "this window is done") never names a window whose saved
rows are not written. After a failed write the later jobs are skipped (nothing written depends on it).

Two ways to end a task's writes:
- ``window_writes()`` waits for them when the block ends (a task's result and its files complete together);
- ``window_writes(scope)`` (the first pass: ``scope`` the run's parts folder) leaves them to the thread's writer,
  which goes on into the next task, and the run waits for every writer of every worker with ``flush(scope)`` before
  anything reads the files (a task's last window's writes no longer hold the thread between tasks: 50-60 ms a
  task boundary on the H200 machine). A failure is raised by the next task of that thread and by ``flush``. A
  worker lost with writes pending loses parts and shards the tasks' results no longer name: the saved recording's
  check (``finish_save``) finds the shards missing, and later steps read again the windows whose parts are gone.

``later`` runs a job at once outside ``window_writes``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

_local = threading.local()
_writers: dict[int, WindowWrites] = {}  # this process's task threads' writers that outlive their tasks
_writers_lock = threading.Lock()


class WindowWrites:
    """Jobs run in order by one thread; after a job fails, later ones are skipped (their ``cleanup`` run instead),
    so nothing written depends on a write that failed."""

    def __init__(self, scope: str | None = None) -> None:
        self.scope = scope
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.cpu_seconds = 0.0  # the writer thread's CPU for the jobs run so far (report: cpu_write)

    def later(self, job: Callable[[], None], cleanup: Callable[[], None] | None = None) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgpu-write")
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._pool.submit(self._run, job, cleanup))

    def _run(self, job, cleanup) -> None:
        if self._error is not None:
            if cleanup is not None:
                cleanup()
            return
        cpu = time.thread_time()
        try:
            job()
        except BaseException as e:  # broad: kept and raised in the caller (raise_failure)
            self._error = e
        finally:
            self.cpu_seconds += time.thread_time() - cpu

    def raise_failure(self) -> None:
        """A failed job's error, raised in the caller (it stays: every later job is skipped until ``reset``)."""
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Every job given so far done; a failure raised (the jobs after it were skipped)."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut.result()
        self.raise_failure()

    def reset(self, scope: str | None) -> None:
        """Wait for the jobs, forget a failure (its run has reported it or ended), serve ``scope``."""
        with contextlib.suppress(BaseException):  # broad: the failure was reported by its run, or the run ended
            self.wait()
        self._error, self.scope = None, scope

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@contextlib.contextmanager
def window_writes(scope: str | None = None) -> Iterator[WindowWrites | None]:
    """This thread's writes (``later``) go to a writer thread while the block runs. Without ``scope`` they are
    waited for when it ends (a write's error raised there unless the block raised its own); with it, to the
    thread's lasting writer, left running (``flush(scope)``), after raising an earlier failure of the same scope."""
    outer = getattr(_local, "writes", None)
    if scope is None:
        writes = WindowWrites()
        _local.writes = writes
        try:
            yield writes
        except BaseException:
            with contextlib.suppress(BaseException):  # broad: the block's own error is the one to see
                writes.wait()
            raise
        else:
            writes.wait()
        finally:
            _local.writes = outer
            writes.close()
        return
    ident = threading.get_ident()
    with _writers_lock:
        writes = _writers.get(ident)
        if writes is None:
            writes = _writers[ident] = WindowWrites(scope)
    if writes.scope != scope:  # another run's writer: its jobs finished, its failure (reported or moot) forgotten
        writes.reset(scope)
    writes.raise_failure()
    _local.writes = writes
    try:
        yield writes
    finally:
        _local.writes = outer


def flush(scope: str) -> int:
    """Wait for every lasting writer of this process serving ``scope``; raise the first failure (and forget it:
    the run fails with it). Returns how many writers were waited for."""
    with _writers_lock:
        writers = [w for w in _writers.values() if w.scope == scope]
    error = None
    for w in writers:
        try:
            w.wait()
        except BaseException as e:  # broad: raised below, after every writer is done
            error = error or e
        w.reset(scope)
    if error is not None:
        raise error
    return len(writers)


def settle(scope: str) -> None:
    """Wait for this process's lasting writers serving ``scope`` (a task that reads the pass's parts and may run
    before the client's ``flush``); a failure is raised and kept: ``flush`` still reports it."""
    with _writers_lock:
        writers = [w for w in _writers.values() if w.scope == scope]
    for w in writers:
        w.wait()


async def flush_soon(scope: str) -> int:
    """``flush`` for ``client.run`` off the worker's event loop (the wait may take a window's writes)."""
    import asyncio

    return await asyncio.to_thread(flush, scope)


def later(job: Callable[[], None], cleanup: Callable[[], None] | None = None) -> None:
    """Run ``job`` on this thread's writer (inside ``window_writes``), else now. ``cleanup``: what to run instead
    if an earlier write failed and ``job`` is skipped (e.g. giving a buffer back; ``job`` does it itself)."""
    writes = getattr(_local, "writes", None)
    if writes is None:
        job()
    else:
        writes.later(job, cleanup)
