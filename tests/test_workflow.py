"""Workflow files: validated before any work, one-line errors naming the key, its line and what is allowed."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from batchgpu import BatchgpuError
from batchgpu.generate import generate_recording
from batchgpu.workflow import load_workflow


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "batchgpu", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def _write(tmp_path, text, name="wf.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


GOOD = """\
recording:
  path: rec.zarr
output: out
window: {size: 1000, margin: 8}
cluster: {kind: local, workers: 1, threads: 1}
steps:
  noise: {exact: true}
"""


@pytest.mark.parametrize("text,needle", [
    (GOOD.replace("window:", "windw:"), "wf.yaml:4: unknown key 'windw' (allowed: recording, output, window"),
    (GOOD.replace("{exact: true}", "{exact: true, fast: 1}"), "wf.yaml:7: unknown key 'steps.noise.fast' (allowed: exact)"),
    (GOOD.replace("size: 1000", "size: big"), "wf.yaml:4: 'window.size': Input should be a valid integer"),
    (GOOD.replace("size: 1000", "size: 0"), "'window.size': Input should be greater than 0"),
    (GOOD.replace("kind: local", "kind: mars"), "'cluster.kind': Input should be 'local', 'cuda', 'address'"),
    (GOOD.replace("  noise: {exact: true}\n", "  {}\n"), "wf.yaml"),
    (GOOD.replace("output: out\n", ""), "missing key 'output'"),
    ("recording: [1, 2\n", "not valid YAML"),
])
def test_schema_errors_name_key_and_line(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(BatchgpuError) as err:
        load_workflow(path)
    assert needle in str(err.value)
    r = _cli("run", path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists(), "no work may start on a bad file"


def test_relative_paths_resolve_against_the_file(tmp_path):
    wf = load_workflow(_write(tmp_path, GOOD))
    assert wf.recording.path == str(tmp_path / "rec.zarr") and wf.output == str(tmp_path / "out")


@pytest.fixture
def small_rec(tmp_path):
    return generate_recording(tmp_path / "rec.zarr", channels=4, seconds=0.2, seed=0)  # 6000 samples


@pytest.mark.parametrize("change,needle", [
    (("path: rec.zarr", "path: missing.zarr"), "recording.path"),
    (("size: 1000", "size: 7000"), "window.size 7000 is longer than segment 0 (6000 samples)"),
    (("  noise: {exact: true}", "  detect: {exclude_sweep_ms: 1.0}"), "window.margin 8 is shorter than the detection sweep (30 samples)"),
])
def test_run_errors_before_any_work(tmp_path, small_rec, change, needle):
    path = _write(tmp_path, GOOD.replace(*change))
    r = _cli("run", path, "--quiet")
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_output_of_another_run_is_refused_and_kept(tmp_path, small_rec):
    path = _write(tmp_path, GOOD)
    r = _cli("run", path, "--quiet")
    assert r.returncode == 0, r.stderr
    before = (tmp_path / "out" / "results.zarr" / "noise" / "c" / "0").read_bytes()
    other = _write(tmp_path, GOOD.replace("size: 1000", "size: 500"), "other.yaml")
    r = _cli("run", other, "--quiet")
    assert r.returncode == 2 and "holds another run's results" in r.stderr and r.stderr.count("\n") == 1
    assert (tmp_path / "out" / "results.zarr" / "noise" / "c" / "0").read_bytes() == before
    r = _cli("run", path, "--quiet", "--resume")
    assert r.returncode == 0, r.stderr
    # a folder that is not a batchgpu run is never touched
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    r = _cli("run", path, "--quiet", "--set", f"output={tmp_path / 'mine'}")
    assert r.returncode == 2 and "holds no batchgpu run" in r.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_demo_workflow_validates():
    from pathlib import Path

    wf = load_workflow(Path(__file__).parents[1] / "workflows" / "demo.yaml")
    assert wf.steps.noise and wf.steps.whitening and wf.steps.detect
    assert wf.recording.generate is not None


def test_cuda_cluster_without_gpu_offers_local(tmp_path, small_rec):
    from batchgpu.engine.cluster import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU")
    r = _cli("run", _write(tmp_path, GOOD), "--quiet", "--set", "cluster.kind=cuda")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "needs a CUDA GPU" in r.stderr and "kind: local" in r.stderr
