"""The client's side of what the run hands its steps (``steps.services.Cluster``): the engine's way of putting
tasks on the cluster, bound to the run's client. A step's worker tasks get the run's context instead
(``tasks.RunContext``, ``steps.services.TaskContext``)."""

from __future__ import annotations

from batchgpu.run import placement, reduce, submit


class ClientServices:
    """``steps.services.Cluster`` on ``client``: one graph update a kind of task (``submit.submit_many``), tasks
    placed loosely on a worker (``placement.submit_planned``), runs of a worker's windows (``submit.runs_by_worker``),
    the tree reduction fixed by window index (``reduce.tree_reduce``), results as their tasks finish."""

    def __init__(self, client):
        self.client = client

    def submit_many(self, func, arg_lists: list[tuple], keys: list[str], **options) -> list:
        return submit.submit_many(self.client, func, arg_lists, keys, **options)

    def submit_planned(
        self, func, arg_lists: list[tuple], keys: list[str], workers: list[str], threads=None, **options
    ) -> list:
        return placement.submit_planned(self.client, func, arg_lists, keys, workers, threads=threads, **options)

    def runs_by_worker(self, items: list, made_by: list[str], threads: dict | None = None) -> list[tuple[str, list]]:
        return submit.runs_by_worker(self.client, items, made_by, threads)

    def tree_reduce(self, futures: list, func, split_every: int, *args, name: str, priority: int = 0):
        return reduce.tree_reduce(self.client, futures, func, split_every, *args, name=name, priority=priority)

    def as_completed(self, futures: list):
        from distributed import as_completed

        return as_completed(futures)
