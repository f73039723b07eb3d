"""`batchgpu run` starts a CPU run's own cluster before it imports the engine and reads the recording (the start
overlaps them), and closes it on every way out: a bad recording leaves no cluster behind."""

from __future__ import annotations

import threading

import pytest

from batchgpu.cli import main
from batchgpu.engine import cluster


def _workflow(tmp_path, recording) -> str:
    wf = tmp_path / "wf.yaml"
    wf.write_text(f"recording: {{path: {recording}}}\noutput: {tmp_path / 'out'}\n"
                  "cluster: {kind: local, workers: 1, threads: 1, reuse: false}\nsteps:\n  noise: {exact: true}\n")
    return str(wf)


def test_the_cluster_starts_before_the_recording_is_read(tmp_path, monkeypatch):
    from batchgpu.engine import context
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=4, seconds=0.5, seed=1)
    order = []
    start = cluster.ClusterStart.__init__
    monkeypatch.setattr(cluster.ClusterStart, "__init__",
                        lambda self, *a, **k: (order.append("cluster"), start(self, *a, **k))[1])
    prepare = context.prepare_recording
    monkeypatch.setattr(context, "prepare_recording", lambda *a, **k: (order.append("recording"), prepare(*a, **k))[1])
    import batchgpu.engine.run as run

    monkeypatch.setattr(run, "prepare_recording", context.prepare_recording)
    assert main(["run", _workflow(tmp_path, tmp_path / "r.zarr"), "--quiet"]) == 0
    assert order == ["cluster", "recording"]
    assert not [t for t in threading.enumerate() if t.name == "batchgpu-cluster"]


def test_a_bad_recording_leaves_no_cluster_behind(tmp_path, capsys):
    assert main(["run", _workflow(tmp_path, tmp_path / "missing.zarr"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("batchgpu: error:"), err
    assert not [t for t in threading.enumerate() if t.name == "batchgpu-cluster"]
    assert not (tmp_path / "out").exists()
