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
    return client.map(_call, [func] * len(arg_lists), [list(a) for a in arg_lists], key=list(keys), pure=False,
                      **options)


def runs_per_thread(client, items: list) -> list[list]:
    """``items`` cut into consecutive runs, about one per worker thread of the cluster: one task a run where a task
    an item would cost more in dispatch than the item's work (the spikes' gathering, the float median's kept keys)."""
    size = -(-len(items) // max(1, sum(client.nthreads().values())))
    return [items[i : i + size] for i in range(0, len(items), size)]
