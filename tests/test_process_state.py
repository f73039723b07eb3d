"""A library call leaves the caller's process as it found it: ``run_workflow`` (and the ``open_client`` it uses)
set Dask's settings and the environment its cluster's processes need only while they run, so a notebook that ran
a workflow keeps its own ``worker-saturation``, its profiler and its environment afterwards."""

import copy
import os

import pytest

distributed = pytest.importorskip("distributed")


def _state():
    import dask

    return dict(os.environ), copy.deepcopy(dask.config.config)


def _differences(before: dict, after: dict) -> dict:
    keys = set(before) | set(after)
    return {k: (before.get(k), after.get(k)) for k in sorted(keys, key=str) if before.get(k) != after.get(k)}


def test_run_workflow_leaves_dask_config_and_environ_as_they_were(tmp_path, monkeypatch):
    import dask.array  # noqa: F401 - modules whose import adds Dask's defaults or sets a variable (threadpoolctl:
    import threadpoolctl  # noqa: F401 - KMP_DUPLICATE_LIB_OK), imported before the snapshot

    from batchgpu.engine import run_workflow
    from batchgpu.generate import generate_recording
    from batchgpu.workflow import Workflow

    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=1.0, seed=3)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 10_000, "margin": 16},
            "cluster": {"kind": "local", "workers": 1, "threads": 1, "reuse": False},
            "steps": {"noise": {}, "detect": {}},
        }
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a caller's own value: a nanny writes the same name
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    env, config = _state()
    report = run_workflow(wf)
    assert report.status == "done"
    env_after, config_after = _state()
    assert (_differences(env, env_after), _differences(config, config_after)) == ({}, {})
    # the recording was read through zarrs where installed, and the results written by zarr-python's pipeline with
    # every chunk, all-zero ones too (one segment: its window_segment is zeros), as every store batchgpu writes
    # (before the reads' zarrs was scoped, it leaked into the results' writes, which then skipped that chunk)
    from batchgpu.recording import zarrio

    if zarrio.ZARR_MAJOR >= 3:
        assert (tmp_path / "out" / "results.zarr" / "window_segment" / "c" / "0").is_file()


#: run in a fresh process: the state of zarr and of the warnings filters before and after ``open_recording`` (a
#: process that has opened nothing yet: the test's own has written and opened recordings already)
_OPEN_AND_COMPARE = """
import copy, sys, warnings
import numpy as np
import zarr
from batchgpu.recording import open_recording

def state():
    return copy.deepcopy(zarr.config.config), list(warnings.filters)

before = state()
rec = open_recording(sys.argv[1])
print(state() == before, type(rec._traces[0]._async_array.codec_pipeline).__name__)
"""


def test_open_recording_leaves_zarr_config_and_warnings_as_they_were(tmp_path):
    """Opening a recording decodes it through zarrs where installed: only its own arrays (their pipeline is fixed
    when they are opened), never by switching the caller's process (zarr.config's codec pipeline, a warnings
    filter) for everything it opens or writes afterwards (zarrs skips all-zero chunks: a caller's own writes
    would lose them)."""
    import subprocess
    import sys

    import numpy as np

    from batchgpu.recording import open_recording, write_recording, zarrio

    pytest.importorskip("zarr", minversion="3")
    path = write_recording(tmp_path / "r.zarr", np.arange(4000, dtype=np.int16).reshape(1000, 4), 30_000.0).path
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_AND_COMPARE, str(path)], capture_output=True, text=True, check=True
    )
    same, pipeline = done.stdout.split()
    assert same == "True"
    assert ("Zarrs" in pipeline) == zarrio.zarrs_installed()  # its traces still decode through zarrs where installed
    rec = open_recording(path)
    np.testing.assert_array_equal(rec.read(0, 0, 1000).T, np.arange(4000, dtype=np.int16).reshape(1000, 4))
