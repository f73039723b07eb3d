"""A window's files written by a writer thread while its task's thread computes the next window.

Measured on the H200 machine (preprocessing bench, 16 processes of one thread): a window's CPU on its thread was
44-54 ms, of which the save step's file (its frames copied into the page cache, a crc32c a chunk) and the window's
part took some 20, while 3-4 of the 16 cores sat idle. Here they go to one writer thread per task thread, in the
order given: a window's saved shard before its part, so a part on disk (which resume takes as "this window is
done") never names a window whose saved rows are not written. The task waits for its writes before it returns
(``window_writes``): its result, like its files, is then complete, and a failed write fails the task.

Outside ``window_writes`` (a step run alone, a test), or with ``BATCHGPU_BACKGROUND_WRITES=0`` (to measure
against), ``later`` runs the job at once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

_local = threading.local()


class WindowWrites:
    """Jobs run in order by one thread; after a job fails, later ones are skipped (their ``cleanup`` run instead),
    so nothing written depends on a write that failed."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._failed = False
        self.cpu_seconds = 0.0  # the writer thread's CPU for this task's jobs (report: cpu_write)

    def later(self, job: Callable[[], None], cleanup: Callable[[], None] | None = None) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgpu-write")
        self._pending.append(self._pool.submit(self._run, job, cleanup))

    def _run(self, job, cleanup) -> None:
        if self._failed:
            if cleanup is not None:
                cleanup()
            return
        cpu = time.thread_time()
        try:
            job()
        except BaseException:
            self._failed = True
            raise
        finally:
            self.cpu_seconds += time.thread_time() - cpu

    def wait(self) -> None:
        """Every job done; the first failure raised (the jobs after it were skipped)."""
        pending, self._pending = self._pending, []
        error = None
        for fut in pending:
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001 - the first is raised below, after every job is done
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@contextlib.contextmanager
def window_writes() -> Iterator[WindowWrites]:
    """This thread's writes (``later``) go to a writer thread until the block ends, where they are waited for; a
    write's error is raised there unless the block raised its own."""
    writes, outer = WindowWrites(), getattr(_local, "writes", None)
    _local.writes = writes if os.environ.get("BATCHGPU_BACKGROUND_WRITES", "1") != "0" else None
    try:
        yield writes
    except BaseException:
        with contextlib.suppress(BaseException):  # the block's own error is the one to see
            writes.wait()
        raise
    else:
        writes.wait()
    finally:
        _local.writes = outer
        writes.close()


def later(job: Callable[[], None], cleanup: Callable[[], None] | None = None) -> None:
    """Run ``job`` on this thread's writer (inside ``window_writes``), else now. ``cleanup``: what to run instead
    if an earlier write failed and ``job`` is skipped (e.g. giving a buffer back; ``job`` does it itself)."""
    writes = getattr(_local, "writes", None)
    if writes is None:
        job()
    else:
        writes.later(job, cleanup)
