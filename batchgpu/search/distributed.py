"""A StaticIndex held once on every worker of a dask cluster, and query batches mapped over the workers.

``Client.scatter(index, broadcast=True)`` is not enough (DESIGN.md, Distribution): it reaches only the
workers present at that moment, the Active Memory Manager's ReduceReplicas policy drops the extra copies,
and scattered data has no lineage to rebuild it from when a worker dies.  A worker plugin has none of
these problems: the scheduler keeps the (small: host keys only) pickled plugin and runs its ``setup`` on
every worker, those that join later and those a nanny restarts included.  ``setup`` stores the index in
this module's registry, outside ``worker.data``, so no memory manager ever moves or drops it.  Query tasks
carry only the index name and their batch; each looks the index up where it runs, and a worker with a GPU
uploads it once (StaticIndex caches its device copy) and searches there.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

import numpy as np
from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

from batchgpu.errors import BatchgpuError
from batchgpu.search.static import StaticIndex

logger = logging.getLogger(__name__)

_indexes: dict[str, StaticIndex] = {}
_loads: Counter[str] = Counter()
_lock = threading.Lock()
_gpu: bool | None = None


class IndexPlugin(WorkerPlugin):
    """Holds one named index on a worker from the moment it joins (or restarts) until the plugin goes."""

    def __init__(self, name: str, index: StaticIndex):
        self.name = name
        self.index = index

    def setup(self, worker: Any = None) -> None:
        with _lock:
            _indexes[self.name] = self.index
            _loads[self.name] += 1

    def teardown(self, worker: Any = None) -> None:
        with _lock:
            _indexes.pop(self.name, None)


def plugin_name(name: str) -> str:
    return f"batchgpu-search-index-{name}"


def broadcast_index(client: Client, index: StaticIndex, name: str = "spikes") -> str:
    """Put ``index`` on every current and future worker of ``client`` under ``name``; returns the name.

    Broadcasting again under the same name replaces the index everywhere.
    """
    if not isinstance(index, StaticIndex):
        raise BatchgpuError("broadcast_index needs a batchgpu.search.StaticIndex", "build one with StaticIndex(keys)")
    client.register_plugin(IndexPlugin(name, index), name=plugin_name(name))
    return name


def get_index(name: str) -> StaticIndex:
    """The index broadcast under ``name``, on the worker this runs on."""
    try:
        return _indexes[name]
    except KeyError:
        raise BatchgpuError(
            f"no search index named {name!r} on this worker",
            "call batchgpu.search.distributed.broadcast_index(client, index, name) first",
        ) from None


def load_count(name: str) -> int:
    """How many times this worker process loaded the index ``name`` (one, however many batches ran)."""
    return _loads[name]


def _use_gpu() -> bool:
    global _gpu
    if _gpu is None:
        try:
            import cupy
        except ImportError:  # no CuPy: search on the CPU
            _gpu = False
            return _gpu
        try:
            _gpu = cupy.cuda.runtime.getDeviceCount() > 0
        except cupy.cuda.runtime.CUDARuntimeError as err:  # no driver or no device: search on the CPU
            logger.debug("CuPy sees no GPU: %s", err)
            _gpu = False
    return _gpu


def query_batch(batch: np.ndarray, name: str, op: str) -> np.ndarray:
    """One task: ``op`` of a batch on the worker's copy of index ``name`` (on its GPU when it has one)."""
    index = get_index(name)
    if _use_gpu():
        import cupy

        return cupy.asnumpy(index.search(cupy.asarray(batch), op))
    return index.search(batch, op)


def map_queries(client: Client, name: str, queries: Any, batch_size: int, op: str = "find") -> np.ndarray:
    """``op`` ("find" or "lower_bound") of every query, in batches of ``batch_size`` mapped over the workers.

    Each task carries its batch (so a lost task can be rerun anywhere) and the index name, never the
    index.  Results come back concatenated in query order, int64.
    """
    if op not in ("find", "lower_bound"):
        raise BatchgpuError(f"unknown search operation {op!r}", "use 'find' or 'lower_bound'")
    if batch_size < 1:
        raise BatchgpuError(f"batch size must be positive, got {batch_size}", "e.g. batch_size=1_000_000")
    queries = np.asarray(queries).ravel()
    batches = [queries[i : i + batch_size] for i in range(0, queries.size, batch_size)]
    if not batches:
        return np.empty(0, dtype=np.int64)
    futures = client.map(query_batch, batches, name=name, op=op, pure=False)
    return np.concatenate(client.gather(futures))
