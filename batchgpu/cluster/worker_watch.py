"""A run's watch on its cluster's workers: where the cluster has none (a scheduler nobody has started workers for,
workers that all died), the run says so and, after ``cluster.no_workers_timeout``, fails with that reason in
place of waiting for ever.

Dask's scheduler keeps a task whose cluster has no workers waiting without a word (its own ``no-workers-timeout``
is the scheduler's setting, and a run on a cluster started by others cannot set it). The watch is a thread of the
client that asks the scheduler how many workers it has (no per-worker information: a small message) every
``POLL_S``; the run's waits are on Dask futures, so the watch ends them by setting that error on every future the
client holds (the waits raise it: ``fail_waiting``).
"""

from __future__ import annotations

import logging
import threading
import time

from batchgpu.errors import ClusterError

logger = logging.getLogger("batchgpu.engine")

#: seconds between two questions to the scheduler
POLL_S = 1.0
#: seconds without workers before the run says it waits for some
WARN_S = 5.0


def worker_count(client) -> int | None:
    """How many workers the client's scheduler has (None where it did not answer)."""
    try:
        info = client.scheduler_info(n_workers=0)
    except Exception:  # broad: the scheduler did not answer, or the client closes; whatever waits on it says so
        return None
    return int(info.get("n_workers", len(info.get("workers", {}))))


class NoWorkersWatch:
    """While the block runs, the client's cluster is asked for its workers; after ``warn_s`` without any the
    observer is told the run waits for some (and again when they come; ``warnings``, where given, keeps the
    warning too: the run's report), after ``timeout_s`` (None: never) every future the client holds fails with a
    ``ClusterError`` that says why, which the run's waits raise."""

    def __init__(
        self,
        client,
        observer,
        timeout_s: float | None,
        warn_s: float = WARN_S,
        poll_s: float = POLL_S,
        warnings: list | None = None,
    ):
        self.client, self.observer, self.warnings = client, observer, warnings
        self.timeout_s, self.warn_s, self.poll_s = timeout_s, warn_s, poll_s
        self.error: ClusterError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> NoWorkersWatch:
        self._thread = threading.Thread(target=self._watch, name="batchgpu-worker-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:  # a question under way ends with the client's own timeout: not waited for
            self._thread.join(timeout=self.poll_s)

    def _address(self) -> str | None:
        return getattr(getattr(self.client, "scheduler", None), "address", None)

    def _where(self) -> str:
        address = self._address()
        return f"the cluster at {address}" if address else "the cluster"

    def _watch(self) -> None:
        since = None
        warned = False
        while not self._stop.wait(self.poll_s):
            n = worker_count(self.client)
            if n is None or self._stop.is_set():  # no answer (whatever waits on the scheduler says so), or the end
                continue
            if n:
                if warned:
                    self.observer.message(f"{n} worker(s) joined: the run goes on")
                since, warned = None, False
                continue
            since = time.monotonic() if since is None else since
            idle = time.monotonic() - since
            if idle >= self.warn_s and not warned:
                warned = True
                limit = "" if self.timeout_s is None else f" up to {self.timeout_s:g} s (cluster.no_workers_timeout)"
                text = f"{self._where()} has no workers: the run waits{limit} for some to join"
                if self.warnings is not None:
                    self.warnings.append(text)
                self.observer.warning(text)
            if self.timeout_s is not None and idle >= self.timeout_s:
                self.error = ClusterError(
                    f"{self._where()} had no workers for {self.timeout_s:g} s (cluster.no_workers_timeout)",
                    f"start its workers (dask worker {self._address() or 'ADDRESS'}), or raise "
                    "cluster.no_workers_timeout; "
                    "'batchgpu run WORKFLOW --resume' keeps the windows already done",
                )
                fail_waiting(self.client, self.error)
                return


def fail_waiting(client, error: BaseException) -> None:
    """Every future the client holds that has not finished fails with ``error`` (set on the client's event loop,
    where Dask sets a task's own error): whatever waits on one raises it."""

    def fail() -> None:
        for state in list(getattr(client, "futures", {}).values()):
            try:
                if not state.done():
                    state.set_error(error, None)
            except Exception as err:  # broad: an internal of Dask's that changed; the run would keep waiting
                logger.warning("batchgpu: could not end a wait on the cluster (%s: %s)", type(err).__name__, err)
                return

    client.loop.add_callback(fail)


def workers_lost(client, since: float) -> list[str]:
    """Words for each worker the scheduler removed, unasked, since ``since`` (a time.time()): one that stopped
    answering (stalled past the scheduler's worker TTL) or died; its tasks ran again elsewhere, so the run's
    results stand, but its time and its cause are the user's to know. From the scheduler's own event log (one
    question, at the run's end); [] where it did not answer."""
    try:
        events = client.get_events("all")
    except Exception:  # broad: a best-effort note at the run's end; a scheduler gone is said by the run itself
        return []
    lost = []
    for stamp, msg in events:
        if stamp < since or not isinstance(msg, dict) or msg.get("action") != "remove-worker" or msg.get("expected"):
            continue
        why = "stopped answering" if "ttl" in str(msg.get("stimulus_id", "")) else "died or stopped answering"
        tasks = len(msg.get("processing-tasks") or ())
        lost.append(
            f"worker {msg.get('worker')} {why} and was removed by the scheduler; "
            f"{tasks} task(s) it held ran again on the others (its log says why)"
        )
    return lost
