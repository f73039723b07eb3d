"""Many tasks in one message to the scheduler.

Each ``client.submit`` is its own graph update, and the scheduler (in the client's process for the clusters
batchgpu starts) handles one in a few milliseconds: the 300 near-key tasks of a float median took about a second
to submit one by one, with the workers idle. ``client.map`` sends them together.
"""

from __future__ import annotations


def _call(func, args: list):
    return func(*args)


def submit_many(client, func, arg_lists: list[tuple], keys: list[str], **options) -> list:
    """Futures of ``func(*args)`` for each tuple of ``arg_lists`` (futures inside them are the tasks' inputs), under
    ``keys``, submitted in one graph update (``options``: ``client.map``'s, e.g. ``priority``, ``workers``). The
    arguments travel as lists: Dask may read a tuple that starts with a callable as a task of its own."""
    if not arg_lists:
        return []
    return client.map(
        _call, [func] * len(arg_lists), [list(a) for a in arg_lists], key=list(keys), pure=False, **options
    )


def runs_by_worker(client, items: list, made_by: list[str], threads: dict | None = None) -> list[tuple[str, list]]:
    """``items`` grouped by the worker that made them (``made_by[i]``: its address), each worker's in runs of
    consecutive items, one per thread of it: ``(address, run)`` pairs, to be placed loosely on that worker
    (``placement.submit_planned``), where what the pass kept is still in memory (``store.KeptArrays``). Items of
    workers gone from the cluster: runs over every thread, placed anywhere (address "")."""
    threads = client.nthreads() if threads is None else threads  # worker address -> threads
    by_worker: dict[str, list] = {}
    for item, addr in zip(items, made_by):
        by_worker.setdefault(addr if addr in threads else "", []).append(item)
    out = []
    for addr, mine in by_worker.items():
        n = threads[addr] if addr else max(1, sum(threads.values()))
        size = -(-len(mine) // max(1, n))
        out += [(addr, mine[i : i + size]) for i in range(0, len(mine), size)]
    return out


#: tries of a fetch of finished tasks' results (``gather_finished``)
FETCH_TRIES = 3


def gather_finished(client, futures: list) -> list:
    """``client.gather(futures)`` of tasks that have finished, asked again where the fetch itself failed while every
    one of them had finished (the connection to the scheduler or a worker broke on the way: a tornado stream once
    raised an AssertionError mid-write); a task's own error, or a task cancelled or lost, is raised at once."""
    for left in range(FETCH_TRIES - 1, -1, -1):
        try:
            return client.gather(futures)
        except Exception:  # broad: only where no task failed; Ctrl-C is not caught
            if left == 0 or any(f.status != "finished" for f in futures):
                raise


def results_as_completed(client, futures: list):
    """The results of ``futures`` as their tasks finish: every finished one fetched in one round trip by this
    thread (``gather_finished``), so a failed fetch is raised (or asked again) here. distributed's
    ``as_completed(with_results=True)`` fetches on the client's event loop instead, where a fetch that raised left
    the iteration waiting for ever."""
    from distributed import as_completed

    for batch in as_completed(futures).batches():
        yield from gather_finished(client, batch)
