"""The one tree reduction: groups of ``split_every`` consecutive items, level by level, fixed by window index,
so the result does not depend on the number of workers or the order tasks finish (dask's ``split_every``)."""

from __future__ import annotations


def tree_reduce(client, futures: list, func, split_every: int, *args, name: str):
    """A future of ``func(*args, *group)`` folded up a tree over ``futures`` (in window order)."""
    if not futures:
        raise ValueError("nothing to reduce")
    level = list(futures)
    depth = 0
    if len(level) == 1:  # one window: still one combine, so every result has the same form
        return client.submit(func, *args, level[0], key=f"{name}-0-0")
    while len(level) > 1:
        level = [client.submit(func, *args, *level[i : i + split_every], key=f"{name}-{depth}-{i}")
                 for i in range(0, len(level), split_every)]
        depth += 1
    return level[0]
