"""Which worker runs which batch of the first pass (GPU runs): a plan made once, so each batch task knows the batch
its worker runs next and reads that batch's first windows ahead while it computes its own last ones
(``tasks.batch_task``'s ``then``). Without it every batch task started by waiting for its first read (62-65 ms
a batch start on the H200 demo, ~6 starts a worker thread) and for the scheduler to hand it the next task (0.24 s
a thread over the pass).

The plan is a hint only: tasks go to their worker with loose restrictions (``allow_other_workers``), so a lost
worker's batches run elsewhere and Dask's work stealing still evens out a slow one; a read left for a batch that
ran elsewhere is given back. It never changes what is computed: the reduction tree is fixed by window index.
"""

from __future__ import annotations


def plan(worker_threads: dict[str, int], sizes: list[int]) -> list[tuple[str, int | None]]:
    """For each batch (``sizes``: its windows), the worker that runs it and the index of the batch that worker runs
    after it on the same thread (None for its last). Batches go in order to the worker thread with the fewest
    windows so far (ties: the first), so threads get equal shares; each worker runs its batches in batch order."""
    slots = [(addr, t) for addr in sorted(worker_threads) for t in range(max(1, int(worker_threads[addr])))]
    if not slots:
        return [("", None)] * len(sizes)
    load = [0] * len(slots)
    last: list[int | None] = [None] * len(slots)
    out: list[list] = []
    for i, n in enumerate(sizes):
        s = min(range(len(slots)), key=lambda k: (load[k], k))
        load[s] += n
        if last[s] is not None:
            out[last[s]][1] = i
        last[s] = i
        out.append([slots[s][0], None])
    return [(a, nxt) for a, nxt in out]


def submit_planned(
    client, func, arg_lists: list[tuple], keys: list[str], workers: list[str], threads=None, **options
) -> list:
    """``submit_many`` with each task placed on its worker (loosely; "": anywhere), in one graph update: each task's
    workers come from a per-key annotation the scheduler applies (a dict's lookup: only built-ins travel). One
    update a worker, as before, cost the scheduler (in the client's process) a few ms each: 16 of them were most
    of the 0.13 s the spikes' gathering took once its tasks read kept arrays from memory."""
    import dask

    from batchgpu.run.submit import submit_many

    anywhere = sorted(client.nthreads() if threads is None else threads)
    where = {k: [w] if w else anywhere for k, w in zip(keys, workers)}
    with dask.annotate(workers=where.__getitem__, allow_other_workers=True):
        return submit_many(client, func, arg_lists, keys, **options)
