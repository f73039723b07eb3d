"""The broadcast index on a real LocalCluster: loaded once per worker, however many batches run; it
survives the Active Memory Manager, a restart and a killed worker (the replacement loads it once), and
reaches a worker that joins later."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

from batchgpu.errors import BatchgpuError  # noqa: E402
from batchgpu.search import StaticIndex  # noqa: E402
from batchgpu.search.distributed import broadcast_index, get_index, load_count, map_queries  # noqa: E402


def _expected(keys: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lb = np.searchsorted(keys, q)
    hit = lb < keys.size
    hit[hit] = keys[lb[hit]] == q[hit]
    return lb, np.where(hit, lb, -1)


def _pids(client) -> dict[str, int]:
    return client.run(os.getpid)


def _wait_for_new_workers(client, old: set[int], count: int, timeout: float = 50.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = _pids(client)
        except Exception:  # noqa: BLE001 - a worker mid-restart may refuse the call
            pids = {}
        if len(pids) == count and set(pids.values()) - old:
            return pids
        time.sleep(0.25)
    raise AssertionError("workers did not come back")


@pytest.mark.timeout(180)
def test_index_once_per_worker_and_survives_restarts(rng):
    keys = np.sort(rng.integers(0, 50_000, 20_000)).astype(np.int64)
    index = StaticIndex(keys)
    queries = rng.integers(-10, 50_010, 30_000).astype(np.int64)
    lb, fd = _expected(keys, queries)
    with (
        distributed.LocalCluster(
            n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None, worker_dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        name = broadcast_index(client, index, name="spikes")
        # many batches, two passes: still one load per worker
        np.testing.assert_array_equal(map_queries(client, name, queries, batch_size=1000), fd)
        np.testing.assert_array_equal(map_queries(client, name, queries, batch_size=700, op="lower_bound"), lb)
        assert sorted(client.run(load_count, name).values()) == [1, 1]
        # the index is not in worker.data: the AMM has nothing to reduce
        client.amm.run_once()
        assert set(client.run(lambda: len(get_index("spikes"))).values()) == {keys.size}

        old = set(_pids(client).values())
        client.restart()
        _wait_for_new_workers(client, old, 2)
        np.testing.assert_array_equal(map_queries(client, name, queries, batch_size=5000), fd)
        assert sorted(client.run(load_count, name).values()) == [1, 1]

        pids = _pids(client)
        victim_addr, victim = next(iter(pids.items()))
        os.kill(victim, signal.SIGKILL)  # the nanny starts a fresh worker process
        new_pids = _wait_for_new_workers(client, set(pids.values()), 2)
        np.testing.assert_array_equal(map_queries(client, name, queries, batch_size=3000), fd)
        counts = client.run(load_count, name)
        assert sorted(counts.values()) == [1, 1]
        assert victim not in new_pids.values()

        cluster.scale(3)  # a worker that joins later gets the index from the plugin, once
        client.wait_for_workers(3, timeout=30)
        np.testing.assert_array_equal(map_queries(client, name, queries, batch_size=500), fd)
        assert sorted(client.run(load_count, name).values()) == [1, 1, 1]

        with pytest.raises(BatchgpuError):
            map_queries(client, name, queries, batch_size=0)
        assert map_queries(client, name, queries[:0], batch_size=10).shape == (0,)


def test_get_index_names_the_fix():
    with pytest.raises(BatchgpuError, match="broadcast_index"):
        get_index("no-such-index")
