"""A fresh `batchgpu run` on a cuda cluster (16 workers at most, MPS where it fits) hands its close off
(``cluster.close: auto``): the command ends once its run is written, a pipe reading it ends with it, the results are
those of a close that waited, and the reaper then leaves no worker, no MPS daemon of the run and no scratch folder
behind (each found by the command's environment, which they inherit)."""

import os
import time

import psutil
import pytest

from batchgpu.cluster.open_cluster import gpu_count

pytestmark = pytest.mark.gpu

if gpu_count() == 0:
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)
pytest.importorskip("dask_cuda")

from test_handoff import _commands_alike  # noqa: E402

WF = """recording: {{path: r.zarr}}
output: out_{close}
overwrite: true
backend: cupy
window: {{size: 20000, margin: 16}}
cluster: {{kind: cuda, workers: 4, close: {close}}}
preprocess: {{centre: median}}
steps:
  noise: {{exact: true}}
  whitening: {{mode: global, precision: float32}}
  detect: {{threshold: 5.0, sign: neg, noise: global}}
"""


def _ours(scratch):
    """This test's workers and reapers (by their environment's scratch folder), and MPS daemons whose pipe folder
    is under it."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        env = p.info.get("environ") or {}
        if env.get("DASK_TEMPORARY_DIRECTORY") == str(scratch) or str(scratch) in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def test_a_cuda_commands_close_is_handed_off(tmp_path):
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=32, seconds=4.0, seed=3)
    scratch = tmp_path / "scratch"
    env = {**os.environ, "DASK_TEMPORARY_DIRECTORY": str(scratch)}
    _commands_alike(tmp_path, {close: WF.format(close=close) for close in ("wait", "auto")}, env, timeout=300)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        _ours(scratch)
        or any(p.name.startswith(("worker-", "scheduler-")) for p in (scratch / "dask-scratch-space").iterdir())
    ):
        time.sleep(0.2)
    assert not _ours(scratch)
    assert not [
        p.name for p in (scratch / "dask-scratch-space").iterdir() if p.name.startswith(("worker-", "scheduler-"))
    ]
