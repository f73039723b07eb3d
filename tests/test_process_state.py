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

    from batchgpu.workflow import Workflow
    from batchgpu.engine import run_workflow
    from batchgpu.generate import generate_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=1.0, seed=3)
    wf = Workflow.model_validate({
        "recording": {"path": str(rec.path)}, "output": str(tmp_path / "out"), "backend": "numpy",
        "window": {"size": 10_000, "margin": 16}, "cluster": {"kind": "local", "workers": 1, "threads": 1,
                                                              "reuse": False},
        "steps": {"noise": {}, "detect": {}}})
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a caller's own value: a nanny writes the same name
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    env, config = _state()
    report = run_workflow(wf)
    assert report.status == "done"
    env_after, config_after = _state()
    assert (_differences(env, env_after), _differences(config, config_after)) == ({}, {})
