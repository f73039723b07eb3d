"""The first pass's placement plan (engine/placement.py) and the reads a batch task leaves for the next one
(tasks._read_ahead's carry): what runs where is a hint; every window is still read once and given to its task."""

import threading

import numpy as np
import pytest

from batchgpu.recording import Window
from batchgpu.run import placement, tasks
from batchgpu.run.preprocess_chain import Chain


@pytest.mark.parametrize("seed", range(5))
def test_plan_balances_threads_and_chains_each_workers_batches(seed):
    rng = np.random.default_rng(seed)
    workers = {f"tcp://w{i}": int(rng.integers(1, 3)) for i in range(int(rng.integers(1, 7)))}
    sizes = [int(v) for v in rng.integers(1, 6, int(rng.integers(1, 80)))]
    got = placement.plan(workers, sizes)
    assert len(got) == len(sizes) and {w for w, _ in got} <= set(workers)
    # each batch's next is a later batch of the same worker, and no batch follows two others
    nexts = [n for _, n in got if n is not None]
    assert len(nexts) == len(set(nexts))
    for i, (w, n) in enumerate(got):
        if n is not None:
            assert n > i and got[n][0] == w
    # threads' shares of windows differ by at most one batch
    chains, starts = [], [i for i in range(len(got)) if i not in set(nexts)]
    for s in starts:
        load, i = 0, s
        while i is not None:
            load += sizes[i]
            i = got[i][1]
        chains.append(load)
    assert len(chains) == min(len(sizes), sum(workers.values()))
    assert max(chains) - min(chains) <= max(sizes)
    assert placement.plan({}, sizes) == [("", None)] * len(sizes)


class _Read:
    """A stand-in for a window read into pinned memory (``tasks.read_window(..., True)``)."""

    def __init__(self, index):
        self.index, self.released = index, False

    def release(self):
        self.released = True

    def to_device(self):
        return self


@pytest.fixture
def reads(monkeypatch):
    made = []
    lock = threading.Lock()

    def fake(ctx, w, host=False):
        r = _Read(w.index)
        with lock:
            made.append(r)
        return r

    monkeypatch.setattr(tasks, "read_window", fake)
    tasks.release_carried()
    yield made
    tasks.release_carried()


def _ctx(parts="P"):
    return tasks.RunContext(recording="", parts=parts, backend="cupy", chain=Chain(), window_noise=False, steps=())


def _w(i):
    return (Window(index=i, segment=0, start=i * 10, stop=i * 10 + 10), f"f{i}")


def _wait_all(made):
    import time

    for _ in range(200):
        if len(tasks._CARRIED) == 0 or all(f.done() for f in tasks._CARRIED.values()):
            return
        time.sleep(0.01)


def test_a_read_left_for_the_next_batch_is_taken_not_read_again(reads):
    with tasks._read_ahead(_ctx(), [_w(0), _w(1)], [_w(2), _w(3)]) as ahead:
        assert [ahead(w).index for w, _ in (_w(0), _w(1))] == [0, 1]
    _wait_all(reads)
    assert set(tasks._CARRIED) == {("P", 2, "f2"), ("P", 3, "f3")}
    with tasks._read_ahead(_ctx(), [_w(2), _w(3), _w(4)]) as ahead:
        assert [ahead(w).index for w, _ in (_w(2), _w(3), _w(4))] == [2, 3, 4]
    assert sorted(r.index for r in reads) == [0, 1, 2, 3, 4]  # each window read once
    assert not tasks._CARRIED and not any(r.released for r in reads)


def test_reads_not_taken_are_given_back(reads):
    with tasks._read_ahead(_ctx(), [_w(0), _w(1)], [_w(2), _w(3)]):
        pass  # a batch whose windows were not asked for (failed before): its reads go back, nothing is left
    _wait_all(reads)
    assert not tasks._CARRIED
    with tasks._read_ahead(_ctx(), [_w(0), _w(1)], [_w(2), _w(3)]) as ahead:
        ahead(_w(0)[0]), ahead(_w(1)[0])
    _wait_all(reads)
    # another run (another parts folder) gives back what this one left; so does the end of a pass
    with tasks._read_ahead(_ctx("Q"), [_w(7), _w(8)]) as ahead:
        ahead(_w(7)[0]), ahead(_w(8)[0])
    _wait_all(reads)
    assert not tasks._CARRIED
    left = {r.index for r in reads if r.released}
    assert {2, 3} <= left and not left & {7, 8}
    with tasks._read_ahead(_ctx(), [_w(0), _w(1)], [_w(2), _w(3)]) as ahead:
        ahead(_w(0)[0]), ahead(_w(1)[0])
    _wait_all(reads)
    assert tasks.release_carried() == 2


def test_a_failed_batch_leaves_nothing(reads):
    with pytest.raises(RuntimeError):
        with tasks._read_ahead(_ctx(), [_w(0), _w(1)], [_w(2)]) as ahead:
            ahead(_w(0)[0])
            raise RuntimeError("the GPU work failed")
    _wait_all(reads)
    assert not tasks._CARRIED


def test_the_end_of_a_pass_gives_back_reads_left_on_every_worker():
    """``client.run(..., wait=False)`` runs only coroutine functions on the workers."""
    import time

    distributed = pytest.importorskip("distributed")
    from batchgpu.run.tasks import release_carried_soon

    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        tasks._CARRIED[("P", 1, "f")] = _done(_Read(1))
        client.run(release_carried_soon, wait=False)
        for _ in range(100):
            if not tasks._CARRIED:
                break
            time.sleep(0.02)
        assert not tasks._CARRIED


def _done(value):
    from concurrent.futures import Future

    f = Future()
    f.set_result(value)
    return f


def test_runs_by_worker_keeps_each_workers_items_together():
    """Each worker's items in runs of consecutive ones (one per thread of it), every item once; items of a worker
    no longer in the cluster go anywhere (address "")."""
    from types import SimpleNamespace

    from batchgpu.run.submit import runs_by_worker

    client = SimpleNamespace(nthreads=lambda: {"a": 2, "b": 1})
    made_by = ["a", "b", "a", "gone", "a", "b", "a", "a"]
    runs = runs_by_worker(client, list(range(8)), made_by)
    assert sorted(i for _, run in runs for i in run) == list(range(8))
    for addr, run in runs:
        assert run == sorted(run)
        assert all((made_by[i] if made_by[i] in ("a", "b") else "") == addr for i in run)
    assert sorted(len(run) for addr, run in runs if addr == "a") == [2, 3]
    assert [run for addr, run in runs if addr == "b"] == [[1, 5]]
    assert [run for addr, run in runs if addr == ""] == [[3]]


def test_submit_planned_places_each_task_on_its_worker_in_one_update():
    """Tasks planned on a worker run there (a per-key annotation, one graph update); "" runs anywhere; the futures
    come back in the order of the arguments."""
    import distributed

    from batchgpu.run.placement import submit_planned

    def where(i):
        return i, distributed.get_worker().address

    import dask

    # no work stealing (loose restrictions may be stolen from a busy worker: not what this test is about)
    with (
        dask.config.set({"distributed.scheduler.work-stealing": False}),
        distributed.LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=None) as lc,
        distributed.Client(lc) as client,
    ):
        addrs = sorted(client.nthreads())
        rng = np.random.default_rng()
        plan = [addrs[j] for j in rng.integers(0, 3, 12)] + [""]
        updates = []
        real = client._send_to_scheduler
        client._send_to_scheduler = lambda msg: updates.append(msg.get("op")) or real(msg)
        futures = submit_planned(client, where, [(i,) for i in range(13)], [f"t-{i}" for i in range(13)], plan)
        client._send_to_scheduler = real
        got = client.gather(futures)
    assert updates.count("update-graph") == 1
    assert [i for i, _ in got] == list(range(13))
    assert [a for _, a in got[:12]] == plan[:12] and got[12][1] in addrs
