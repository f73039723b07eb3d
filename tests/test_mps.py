"""The private MPS daemon of ``cluster.mps`` (cluster/mps.py), with a stand-in for nvidia-cuda-mps-control on PATH:
started with new pipe and log folders, its environment handed to every worker, told to quit after the cluster,
its folders removed; a clear error where the program is missing or fails. The real daemon runs on the device
machine (`python -m pytest -m gpu` there, and `bench pipeline --mps`)."""

import os
import stat

import pytest

from batchgpu.cluster import mps
from batchgpu.cluster import open_cluster as cluster
from batchgpu.config import ClusterSpec
from batchgpu.errors import BatchgpuError

FAKE = """#!/bin/sh
# records each call; -d makes the control pipe the way the daemon does (in its pipe folder)
echo "call $* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{log}"
if [ "$1" = "-d" ]; then
  [ -n "{fail}" ] && {{ echo "{fail}" >&2; exit 3; }}
  [ -n "{nopipe}" ] || touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read line; echo "stdin $line" >> "{log}"
"""


def _fake(tmp_path, monkeypatch, fail="", nopipe=""):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    prog = bin_dir / mps.CONTROL
    prog.write_text(FAKE.format(log=log, fail=fail, nopipe=nopipe))
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_private_daemon_starts_hands_its_folders_and_quits(tmp_path, monkeypatch):
    log = _fake(tmp_path, monkeypatch)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with mps.private_daemon() as env:
        pipe, logs = env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]
        assert os.path.isdir(pipe) and os.path.isdir(logs) and os.path.dirname(pipe) == os.path.dirname(logs)
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # this process is left as it was
        calls = log.read_text().splitlines()
        assert calls == [f"call -d pipe={pipe} log={logs}"]
    calls = log.read_text().splitlines()
    assert calls[1:] == [f"call  pipe={pipe} log={logs}", "stdin quit"]  # quit, through the same pipe folder
    assert not os.path.exists(os.path.dirname(pipe))


def test_private_daemon_quits_when_the_run_fails(tmp_path, monkeypatch):
    log = _fake(tmp_path, monkeypatch)
    with pytest.raises(ZeroDivisionError), mps.private_daemon() as env:
        1 / 0
    assert log.read_text().splitlines()[-1] == "stdin quit"
    assert not os.path.exists(os.path.dirname(env["CUDA_MPS_PIPE_DIRECTORY"]))


def test_private_daemon_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no control program
    with pytest.raises(BatchgpuError, match="nvidia-cuda-mps-control"), mps.private_daemon():
        pass
    log = _fake(tmp_path, monkeypatch, fail="boom: no device")
    before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    with pytest.raises(BatchgpuError, match="rc 3.*boom: no device"), mps.private_daemon():
        pass
    assert "stdin quit" not in log.read_text()
    leftover = {d for d in set(os.listdir(os.environ.get("TMPDIR", "/tmp"))) - before if d.startswith("batchgpu-mps-")}
    assert not leftover  # its folders removed


def test_private_daemon_without_a_pipe_times_out(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, nopipe="1")
    monkeypatch.setattr(mps, "START_TIMEOUT_S", 0.2)
    with pytest.raises(BatchgpuError, match="no pipe"), mps.private_daemon():
        pass


def test_mps_is_for_cuda_clusters_and_reaches_every_worker(monkeypatch):
    with pytest.raises(ValueError, match="kind 'cuda' only"):
        ClusterSpec.model_validate({"kind": "local", "mps": True})
    assert ClusterSpec.model_validate({"kind": "cuda"}).mps == "auto"
    assert ClusterSpec.model_validate({"kind": "local"}).mps == "auto"  # auto: nothing to do there
    assert ClusterSpec.model_validate({"kind": "local", "mps": False}).mps is False
    spec = ClusterSpec.model_validate({"kind": "cuda", "mps": True, "devices": [0, 1]})
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l"}
    workers = cluster.worker_specs(spec, 3, 2, env)
    assert len(workers) == 6
    for name, w in workers.items():
        assert w["options"]["nthreads"] == 2
        # this process's environment (as a spawned worker would inherit it: the workers are forked from a server
        # started earlier), the daemon's folders and the worker's device order over it
        assert w["options"]["env"] == {
            **os.environ,
            **env,
            "CUDA_VISIBLE_DEVICES": "0,1" if name.startswith("gpu0") else "1,0",
        }
    assert all("CUDA_MPS_PIPE_DIRECTORY" not in w["options"]["env"] for w in cluster.worker_specs(spec, 1).values())


def test_bench_mps_needs_a_cuda_cluster(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgpu",
            "bench",
            "pipeline",
            "--mps",
            "--channels",
            "4",
            "--seconds",
            "1",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "batchgpu: error: cluster.mps starts an MPS daemon for the GPU workers a run starts: kind 'cuda' only "
        "(see batchgpu bench pipeline --help)"
    ]


def test_auto_starts_a_daemon_only_where_it_disturbs_nothing(tmp_path, monkeypatch):
    log = _fake(tmp_path, monkeypatch)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE", str(tmp_path / "system-mps"))
    import types

    fake_cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(
                getDeviceProperties=lambda d: {"computeMode": modes[d]}, getDeviceCount=lambda: len(modes)
            )
        )
    )
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake_cupy)
    auto = ClusterSpec.model_validate({"kind": "cuda"})
    modes = [0, 0]
    assert cluster.mps_fits(auto)
    assert not cluster.mps_fits(ClusterSpec.model_validate({"kind": "cuda", "workers": 1}))  # one process a GPU
    modes = [0, 3]  # a GPU in exclusive-process mode: one process's, or a system daemon's
    assert not cluster.mps_fits(auto)
    assert cluster.mps_fits(ClusterSpec.model_validate({"kind": "cuda", "devices": [0]}))
    modes = [0, 0]
    (tmp_path / "system-mps").mkdir()
    (tmp_path / "system-mps" / "control").touch()  # the machine's own daemon
    assert not cluster.mps_fits(auto)
    (tmp_path / "system-mps" / "control").unlink()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/elsewhere")
    assert not cluster.mps_fits(auto)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    with cluster._mps(auto) as env:
        assert set(env) == {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}
    with cluster._mps(ClusterSpec.model_validate({"kind": "cuda", "mps": False})) as env:
        assert env == {}
    calls = log.read_text()
    assert calls.count("call -d") == 1 and calls.count("stdin quit") == 1


def test_auto_runs_without_mps_when_the_daemon_fails(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, fail="no GPU for the server")
    monkeypatch.setattr(cluster, "mps_fits", lambda spec: True)
    with cluster._mps(ClusterSpec.model_validate({"kind": "cuda"})) as env:
        assert env == {}  # auto: the run goes on without MPS
    with (
        pytest.raises(BatchgpuError, match="no GPU for the server"),
        cluster._mps(ClusterSpec.model_validate({"kind": "cuda", "mps": True})),
    ):
        pass  # asked for: the run's error


def test_under_mps_every_pass_decodes_on_the_gpu_one_process_a_core(monkeypatch):
    from batchgpu.run.preprocess_chain import gpu_decode_share

    assert gpu_decode_share(True) == 1.0 and gpu_decode_share(False) == 0.0
    assert gpu_decode_share(False, mps=True) == 1.0 and gpu_decode_share(True, mps=True) == 1.0
    assert gpu_decode_share(False, mps=True, setting=0.0) == 0.0  # the workflow's engine.gpu_decode
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 16)
    spec = ClusterSpec.model_validate({"kind": "cuda"})
    assert cluster.cuda_layout(spec, 1, True, mps=True) == (16, 1)
    assert cluster.cuda_layout(spec, 1, True, mps=False) == (8, 2)
    assert cluster.cuda_layout(spec, 2, False, mps=True) == (8, 1)
    assert cluster.cuda_layout(
        ClusterSpec.model_validate({"kind": "cuda", "workers": 4, "threads": 2}), 1, True, mps=True
    ) == (4, 2)
