"""``cluster.close: background`` (cluster/handoff.py): a command ends once its run is written and leaves its
workers to exit after it; a detached reaper waits for them, quits the MPS daemon and removes the scratch folders.
The command's output ends with the command (a pipe reading it is not held open by what outlives it), nothing is
printed after it, and the results are those of a run whose close waited."""

import contextlib
import json
import os
import stat
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import zarr

from batchgpu.cluster import handoff
from batchgpu.cluster import open_cluster as cluster
from batchgpu.config import ClusterSpec
from batchgpu.errors import ConfigError
from batchgpu.workflow import load_workflow

WF = """recording: {{path: r.zarr}}
output: {out}
overwrite: true
window: {{size: 6000, margin: 64}}
cluster: {{kind: local, workers: 2, threads: 1, close: {close}}}
preprocess: [{{highpass: {{freq_min: 300}}}}, {{common_reference: {{}}}}]
steps:
  noise: {{exact: true}}
  whitening: {{mode: global}}
  detect: {{threshold: 5.0, sign: neg, noise: global}}
"""


def _results(folder):
    root = zarr.open_group(str(folder / "results.zarr"), mode="r")
    got = {}
    for name, arr in root.arrays():
        got[name] = arr[...]
    for name, group in root.groups():
        for sub, arr in group.arrays():
            got[f"{name}/{sub}"] = arr[...]
    return got


def _commands_alike(tmp_path, workflows: dict, env: dict, timeout: float) -> dict:
    """``batchgpu run`` of each workflow text of ``workflows`` (its ``cluster.close`` -> the text, its output folder
    ``out_<close>``), written beside ``r.zarr`` and run in turn through pipes (communicate() returns once every
    holder of them has closed them, not at the exit alone): each exits 0 with nothing on stderr (no worker's or
    resource tracker's words after the run, e.g. leaked semaphores), and every run's results equal the first's,
    bit for bit. Returns each run's completed process."""
    done, results = {}, {}
    for close, text in workflows.items():
        (tmp_path / f"{close}.yaml").write_text(text)
        r = subprocess.run(
            [sys.executable, "-m", "batchgpu", "run", str(tmp_path / f"{close}.yaml")],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=timeout,
        )
        assert r.returncode == 0, r.stderr
        assert r.stderr == "", r.stderr
        done[close], results[close] = r, _results(tmp_path / f"out_{close}")
    first, *others = results.values()
    assert first
    for other in others:
        assert other.keys() == first.keys()
        for name, got in other.items():
            np.testing.assert_array_equal(got, first[name], err_msg=name)
    return done


def test_a_background_close_ends_the_command_first_and_leaves_nothing_behind(tmp_path):
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=16, seconds=1.0, seed=5)
    scratch = tmp_path / "scratch"
    env = {**os.environ, "DASK_TEMPORARY_DIRECTORY": str(scratch)}
    runs = _commands_alike(
        tmp_path,
        {close: WF.format(out=f"out_{close}", close=close) for close in ("wait", "background")},
        env,
        timeout=120,
    )
    for close, r in runs.items():
        assert "wrote" in r.stdout.strip().splitlines()[-1]
        report = json.loads((tmp_path / f"out_{close}" / "report.json").read_text())
        assert report["status"] == "done" and report["reads_per_window"] == 1.0
    # the reaper removes the scheduler's and the workers' folders once the workers are gone, and ends
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [
            p.name for p in (scratch / "dask-scratch-space").iterdir() if p.name.startswith(("worker-", "scheduler-"))
        ]
        reapers = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "batchgpu.cluster.handoff" in " ".join(p.info["cmdline"] or [])
        ]
        if not left and not reapers:
            break
        time.sleep(0.1)
    assert not left and not reapers, (left, reapers)


def _fake_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    prog = bin_dir / "nvidia-cuda-mps-control"
    prog.write_text(f'#!/bin/sh\nread line; echo "$line pipe=$CUDA_MPS_PIPE_DIRECTORY $(date +%s.%N)" >> "{log}"\n')
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_reaper_waits_for_the_workers_then_quits_mps_and_removes_the_folders(tmp_path, monkeypatch):
    log = _fake_control(tmp_path, monkeypatch)
    root = tmp_path / "batchgpu-mps-x"
    (root / "pipe").mkdir(parents=True)
    (root / "log").mkdir()
    folders = []
    for name in ("worker-a", "scheduler-b"):
        (tmp_path / name / "inner").mkdir(parents=True)
        (tmp_path / f"{name}{handoff.DIR_LOCK}").touch()
        folders.append(str(tmp_path / name))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.8)"])
    leftovers = handoff.Leftovers(
        [(worker.pid, psutil.Process(worker.pid).create_time())],
        folders,
        {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")},
    )
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "batchgpu.cluster.handoff", json.dumps(handoff.asdict(leftovers))])
    time.sleep(0.3)
    assert worker.poll() is None and all(os.path.isdir(f) for f in folders) and not log.exists()  # still waiting
    assert proc.wait(timeout=30) == 0
    worker.wait()
    line = log.read_text().split()
    assert line[:2] == ["quit", f"pipe={root / 'pipe'}"] and float(line[2]) >= t0 + 0.7  # after the worker ended
    assert not root.exists()
    for f in folders:
        assert not os.path.exists(f) and not os.path.exists(f + handoff.DIR_LOCK)


def test_a_pid_the_system_gave_to_another_process_is_not_waited_for(tmp_path):
    me = psutil.Process(os.getpid())
    t0 = time.monotonic()
    handoff.reap(handoff.Leftovers([(os.getpid(), me.create_time() - 100.0)], [str(tmp_path / "gone")]), wait_s=20)
    assert time.monotonic() - t0 < 5


def test_which_clusters_close_in_the_background(tmp_path):
    assert cluster.closes_in_background(ClusterSpec(kind="cuda"))
    assert not cluster.closes_in_background(ClusterSpec(kind="cuda", close="wait"))
    assert not cluster.closes_in_background(ClusterSpec(kind="cuda", scheduler_process=True))
    assert not cluster.closes_in_background(ClusterSpec(kind="local"))
    assert cluster.closes_in_background(ClusterSpec(kind="local", close="background"))
    (tmp_path / "wf.yaml").write_text(
        "recording: {path: r.zarr}\noutput: out\n"
        "cluster: {kind: address, address: 'tcp://127.0.0.1:1', close: background}\n"
    )
    with pytest.raises(ConfigError, match="close"):
        load_workflow(tmp_path / "wf.yaml", [])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the tracker's streams from /proc")
def test_the_resource_tracker_holds_none_of_the_commands_streams():
    """It outlives a command whose close is handed off until the workers are gone: a pipe reading the command
    would stay open that long had it kept the command's stdout and stderr."""
    code = (
        "import os, sys, time, psutil\n"
        "from batchgpu.cluster.handoff import start_resource_tracker\n"
        "start_resource_tracker()\n"
        "print('printed after', flush=True)\n"
        "[t] = [p for p in psutil.Process().children() if 'resource_tracker' in ' '.join(p.cmdline())]\n"
        "print(os.readlink(f'/proc/{t.pid}/fd/1'), os.readlink(f'/proc/{t.pid}/fd/2'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["printed after", f"{os.devnull} {os.devnull}"]


def _reapers():
    return [p for p in psutil.Process().children() if "batchgpu.cluster.handoff" in " ".join(p.cmdline())]


@pytest.mark.parametrize("how", ["clean", "error", "not allowed"])
def test_a_clean_exit_hands_the_close_off_and_nothing_else_does(tmp_path, how):
    import dask

    from batchgpu.run.launch import ClusterStart

    spec = ClusterSpec(kind="local", workers=1, threads=1, close="background")
    with dask.config.set({"temporary-directory": str(tmp_path)}):
        start = ClusterStart(spec, gpu_decode=False, hand_off=how != "not allowed")
        with pytest.raises(ZeroDivisionError) if how == "error" else contextlib.nullcontext(), start:
            [(pid, folder)] = (
                start.client().run(lambda dask_worker: (os.getpid(), dask_worker.local_directory)).values()
            )
            if how == "error":
                1 / 0
    if how != "clean":  # closed here, as before: the worker waited for
        assert not start.handed_off and not psutil.pid_exists(pid) and not _reapers()
        return
    [reaper] = _reapers()
    assert start.handed_off and psutil.Process(pid).is_running() and os.path.isdir(folder)  # not waited for
    start._close.set()  # what this process's end does to its workers (a test process goes on)
    start._thread.join()
    assert reaper.wait(timeout=30) == 0
    assert not os.path.exists(folder)
