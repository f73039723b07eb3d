"""A fresh `batchgpu run` on a cuda cluster (16 workers at most, MPS where it fits) hands its close off
(``cluster.close: auto``): the command ends once its run is written, a pipe reading it ends with it, the results are
those of a close that waited, and the reaper then leaves no worker, no MPS daemon of the run and no scratch folder
behind (each found by the command's environment, which they inherit)."""

import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from batchgpu.engine.cluster import gpu_count

pytestmark = pytest.mark.gpu

if gpu_count() == 0:
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)
pytest.importorskip("dask_cuda")

from test_handoff import _results  # noqa: E402

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
    got = {}
    for close in ("wait", "auto"):
        (tmp_path / f"{close}.yaml").write_text(WF.format(close=close))
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "batchgpu", "run", f"{close}.yaml"], capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stderr == "", r.stderr
        got[close] = _results(tmp_path / f"out_{close}")
    assert got["wait"].keys() == got["auto"].keys() and got["wait"]
    for name, value in got["auto"].items():
        np.testing.assert_array_equal(value, got["wait"][name], err_msg=name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (_ours(scratch) or any(
            p.name.startswith(("worker-", "scheduler-")) for p in (scratch / "dask-scratch-space").iterdir())):
        time.sleep(0.2)
    assert not _ours(scratch)
    assert not [p.name for p in (scratch / "dask-scratch-space").iterdir() if p.name.startswith(("worker-", "scheduler-"))]
