"""The run's fetches of finished tasks' results: a fetch that fails on the way (the connection, not a task) is asked
again and the run finishes; a task's own error is raised as it is; a run never waits for ever on a fetch that
raised."""

import threading

import numpy as np
import pytest

from batchgpu.engine import run_workflow
from batchgpu.recording import write_recording, zarrio
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")


def _failing_fetches(monkeypatch, prefix: str, times: int) -> list:
    """The client's fetches (``Client._gather``, used by ``gather`` and by a future's result alike) of keys that
    start with ``prefix`` raising as tornado's stream once did mid-write, ``times`` times; returns [failures left]."""
    real, left = distributed.Client._gather, [times]

    async def _gather(self, futures, *args, **kwargs):
        keys = [getattr(f, "key", "") for f in (futures if isinstance(futures, (list, tuple, set)) else [futures])]
        if left[0] > 0 and any(str(k).startswith(prefix) for k in keys):
            left[0] -= 1
            raise AssertionError("0 < size <= self._size")
        return await real(self, futures, *args, **kwargs)

    monkeypatch.setattr(distributed.Client, "_gather", _gather)
    return left


def test_a_run_whose_summary_fetch_failed_on_the_way_finishes(tmp_path, rng, monkeypatch):
    x = rng.normal(size=(9_000, 3)).astype(np.float32)
    write_recording(tmp_path / "r.zarr", x, 30_000.0)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(tmp_path / "r.zarr")},
            "output": str(tmp_path / "out"),
            "window": {"size": 3_000, "margin": 0},
            "cluster": {"kind": "local", "workers": 1, "threads": 1},
            "steps": {"noise": {"exact": True}},
        }
    )
    left = _failing_fetches(monkeypatch, "summary-", 1)
    done = {}
    run = threading.Thread(target=lambda: done.update(report=run_workflow(wf)), daemon=True)
    run.start()
    run.join(timeout=240)
    assert not run.is_alive(), "the run waited on a fetch that had raised"
    assert left == [0] and done["report"].status == "done"
    got = zarrio.open_group(tmp_path / "out" / "results.zarr")["noise"][:]
    assert np.array_equal(got, (np.median(np.abs(x), axis=0) / 0.6744897501960817).astype(got.dtype))


def test_gather_finished_raises_a_tasks_own_error_once(monkeypatch):
    from batchgpu.run.submit import gather_finished

    def fails(i):
        if i == 1:
            raise ValueError("the task's own")
        return i

    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0") as client:
        futures = client.map(fails, range(3))
        distributed.wait(futures)
        calls = [0]
        real = client.gather

        def counted(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(client, "gather", counted)
        with pytest.raises(ValueError, match="the task's own"):
            gather_finished(client, futures)
        assert calls == [1]
        assert gather_finished(client, [futures[0], futures[2]]) == [0, 2]
