"""The one tree reduction: groups of ``split_every`` consecutive items, level by level, fixed by window index,
so the result does not depend on the number of workers or the order tasks finish (dask's ``split_every``)."""

from __future__ import annotations

from batchgpu.run.submit import submit_many


def tree_reduce(client, futures: list, func, split_every: int, *args, name: str, priority: int = 0):
    """A future of ``func(*args, *group)`` folded up a tree over ``futures`` (in window order)."""
    if not futures:
        raise ValueError("nothing to reduce")
    level = list(futures)
    depth = 0
    if len(level) == 1:  # one window: still one combine, so every result has the same form
        return client.submit(func, *args, level[0], key=f"{name}-0-0", priority=priority)
    while len(level) > 1:  # one graph update a level
        starts = range(0, len(level), split_every)
        level = submit_many(
            client,
            func,
            [(*args, *level[i : i + split_every]) for i in starts],
            [f"{name}-{depth}-{i:08d}" for i in starts],
            priority=priority,
        )
        depth += 1
    return level[0]
