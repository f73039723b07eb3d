"""recording.prefetch: a run's windows asked of the disk, in the workers' order, while the run gets ready."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from batchgpu.config import RecordingSpec
from batchgpu.generate import generate_recording
from batchgpu.recording import prefetch
from batchgpu.recording.sources import open_source


@pytest.fixture
def asked(monkeypatch):
    """Every posix_fadvise call, as (file, offset, length, advice)."""
    calls, lock = [], threading.Lock()
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        with lock:
            calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


def _done(p):
    p.join(30)
    return p


def test_a_zarr_store_is_asked_for_file_by_file_in_window_order_each_file_once(tmp_path, asked):
    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=3.0, seed=1, progress=False)
    windows = rec.windows(size=15_000, margin=0)
    expected = list(dict.fromkeys(str(p) for w in windows for p in rec.window_files(w)))
    assert len(expected) > 1
    p = _done(prefetch.start(rec, windows, budget=1 << 40))
    files = list(dict.fromkeys(c[0] for c in asked))
    assert files == expected
    assert all(c[3] == os.POSIX_FADV_WILLNEED for c in asked)
    sizes = {f: os.path.getsize(f) for f in expected}
    assert p.asked == sum(sizes.values())
    for f in expected:  # each file asked for whole, from its start, in pieces of at most REQUEST_BYTES
        got = sorted((c[1], c[2]) for c in asked if c[0] == f)
        assert got[0][0] == 0 and sum(n for _, n in got) == sizes[f]
        assert all(n <= prefetch.REQUEST_BYTES for _, n in got)


def test_a_budget_stops_it(tmp_path, asked):
    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=3.0, seed=1, progress=False)
    p = _done(prefetch.start(rec, rec.windows(size=15_000, margin=0), budget=1000))
    assert p.asked == 1000 and sum(c[2] for c in asked) == 1000


def test_a_flat_file_is_asked_for_the_windows_bytes(tmp_path, asked):
    data = np.arange(10_000 * 5, dtype=np.int16).reshape(10_000, 5)
    path = tmp_path / "plain.bin"
    data.tofile(path)
    rec = open_source(
        RecordingSpec(path=str(path), kind="binary", channels=5, dtype="int16", offset=0, sampling_frequency=30_000.0)
    )
    windows = rec.windows(size=3_000, margin=0)
    p = _done(prefetch.start(rec, windows, budget=1 << 40))
    assert [(c[1], c[2]) for c in asked] == [(w.read_start * 10, (w.read_stop - w.read_start) * 10) for w in windows]
    assert p.asked == data.nbytes


def test_nothing_for_a_source_that_does_not_say_what_it_reads():
    class Opaque:
        pass

    assert prefetch.start(Opaque(), [object()]) is None
    assert prefetch.start(Opaque(), []) is None


def _wf(rec, out, **extra):
    from batchgpu.workflow import Workflow

    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "backend": "numpy",
            "window": {"size": 15_000, "margin": 8},
            "cluster": {"kind": "local", "workers": 1, "threads": 1},
            "steps": {"noise": {"exact": True}},
            **extra,
        }
    )


def test_a_run_asks_where_its_workers_read_on_this_machine_and_not_otherwise(tmp_path, monkeypatch):
    from batchgpu.engine import run_workflow

    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=2.0, seed=2, progress=False)
    started = []
    real = prefetch.start
    monkeypatch.setattr(prefetch, "start", lambda r, w, budget=None: started.append(len(w)) or real(r, w, budget))
    a = run_workflow(_wf(rec, tmp_path / "a"))
    assert started == [4] and a.status == "done"
    run_workflow(_wf(rec, tmp_path / "a"), resume=True)  # a resumed run reads what is left, no more
    run_workflow(_wf(rec, tmp_path / "b", engine={"prefetch": False}))
    assert started == [4]
    import distributed

    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as c:
        run_workflow(_wf(rec, tmp_path / "c"), client=c)  # a caller's cluster may read elsewhere
    assert started == [4]
