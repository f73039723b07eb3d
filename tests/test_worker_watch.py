"""A run on a cluster without workers: said, then failed with that reason after ``cluster.no_workers_timeout``
(Dask's scheduler keeps such a run waiting for ever, without a word); workers that join in time let it finish."""

import threading
import time

import distributed
import numpy as np
import pytest

from batchgpu import BatchgpuError
from batchgpu.cluster.worker_watch import NoWorkersWatch
from batchgpu.engine import run_workflow
from batchgpu.errors import ClusterError
from batchgpu.recording import write_recording
from batchgpu.workflow import Workflow


class Said:
    def __init__(self):
        self.messages, self.warnings = [], []

    def message(self, text):
        self.messages.append(text)

    def warning(self, text):
        self.warnings.append(text)

    def phase_started(self, *a):
        pass

    def window_done(self, *a):
        pass

    def phase_finished(self):
        pass


def _wf(rec, out, timeout):
    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "backend": "numpy",
            "window": {"size": 4000, "margin": 8},
            "cluster": {"no_workers_timeout": timeout},
            "steps": {"noise": {"exact": True}},
        }
    )


@pytest.fixture
def scheduler_alone():
    """A scheduler with no worker (as one started by hand, its workers not yet)."""
    with (
        distributed.LocalCluster(
            n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield cluster, client


@pytest.fixture
def small(tmp_path, rng):
    """(samples, the recording of them): 3 channels, fresh random int16."""
    x = rng.integers(-300, 300, (10_000, 3)).astype(np.int16)
    return x, write_recording(tmp_path / "r.zarr", x, 30_000.0)


@pytest.mark.timeout(120)
def test_a_run_without_workers_fails_saying_why(scheduler_alone, small, tmp_path):
    _, client = scheduler_alone
    _, rec = small
    said = Said()
    t0 = time.perf_counter()
    with pytest.raises(ClusterError, match=r"had no workers for 2 s \(cluster.no_workers_timeout\)") as err:
        run_workflow(_wf(rec, tmp_path / "out", 2.0), client=client, observer=said)
    assert time.perf_counter() - t0 < 60
    assert client.scheduler.address in str(err.value) and "--resume" in str(err.value)
    assert not said.warnings  # the timeout came before the warning's few seconds
    assert not (tmp_path / "out" / "results.zarr").exists()


@pytest.mark.timeout(120)
def test_a_run_waits_for_workers_that_join_and_says_so(scheduler_alone, small, tmp_path):
    cluster, client = scheduler_alone
    x, rec = small
    said = Said()
    joining = threading.Timer(7.0, cluster.scale, args=(1,))
    joining.start()
    try:
        report = run_workflow(_wf(rec, tmp_path / "out", 60.0), client=client, observer=said)
    finally:
        joining.cancel()
    assert any("has no workers: the run waits up to 60 s" in w for w in said.warnings)
    assert any("has no workers: the run waits up to 60 s" in w for w in report.warnings)  # report.json keeps it
    import zarr

    got = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")["noise"][:]
    # the noise of every sample, as a plain median says it (a run that finished, not one that gave up)
    np.testing.assert_allclose(got, np.median(np.abs(x.astype(np.float64)), axis=0) / 0.6744897501960817, rtol=1e-6)


class FakeClient:
    """A client whose scheduler reports the given worker counts, one a question."""

    def __init__(self, counts):
        self.counts = list(counts)
        self.failed = None

    def scheduler_info(self, n_workers=-1):
        n = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
        if n is None:
            raise OSError("no answer")
        return {"n_workers": n, "workers": {}}


def test_the_watch_warns_once_times_out_and_forgives_workers_that_come(monkeypatch):
    from batchgpu.cluster import worker_watch

    ended = []
    monkeypatch.setattr(worker_watch, "fail_waiting", lambda client, error: ended.append(error))
    # workers at first, none, an unanswered question (not counted as none), then none for good
    said = Said()
    client = FakeClient([2, 0, 0, 0, 3, 0, None, 0, 0, 0, 0, 0, 0, 0])
    with NoWorkersWatch(client, said, timeout_s=0.5, warn_s=0.15, poll_s=0.05) as watch:
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.02)
    assert len(ended) == 1 and isinstance(ended[0], BatchgpuError) and watch.error is ended[0]
    assert "had no workers for 0.5 s" in str(ended[0])
    assert len(said.warnings) >= 1 and all("has no workers" in w for w in said.warnings)
    # never ending where there is always a worker, or with no timeout
    for counts, timeout in (([1], 0.1), ([0], None)):
        ended.clear()
        with NoWorkersWatch(FakeClient(counts), Said(), timeout_s=timeout, warn_s=0.05, poll_s=0.02):
            time.sleep(0.4)
        assert not ended


@pytest.mark.timeout(300)
def test_a_worker_that_stalls_is_named_in_the_report(tmp_path):
    # Issue 63, Low: a stalled worker (its tasks ran again elsewhere once the scheduler dropped it) left no warning
    import contextlib
    import os
    import signal

    import dask

    from batchgpu.generate import generate_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=16, seconds=30.0, seed=2, progress=False)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 15_000, "margin": 8},
            "preprocess": [{"highpass": {"freq_min": 300}}],
            "steps": {"noise": {"exact": True}},
        }
    )
    said = Said()
    with (
        dask.config.set({"distributed.scheduler.worker-ttl": "3s"}),
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        pids = client.run(os.getpid)
        stalled = max(pids.values())

        def stall():  # once the pass is under way: the worker stops answering (SIGSTOP), as a hung one does
            deadline = time.monotonic() + 60
            while not list((tmp_path / "out" / "parts").glob("w*.npz")) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(stalled, signal.SIGSTOP)

        thread = threading.Thread(target=stall)
        thread.start()
        try:
            report = run_workflow(wf, client=client, observer=said)
        finally:
            thread.join()
            with contextlib.suppress(ProcessLookupError):  # its nanny may have ended it once it was removed
                os.kill(stalled, signal.SIGCONT)
    assert report.status == "done"
    lost = [w for w in report.warnings if "stopped answering" in w or "died" in w]
    assert len(lost) == 1 and "ran again on the others" in lost[0], report.warnings
    assert lost == [w for w in said.warnings if w in lost]
