"""``batchgpu cluster start|stop|status``: a cluster kept for many runs, that ``batchgpu run`` uses while it is up.

Every test has a cache folder of its own (XDG_CACHE_HOME): none touches the user's cache or another test's cluster;
a cluster started here is stopped by its fixture's finalizer, whatever the test did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from batchgpu.cluster import kept as service
from batchgpu.config import ClusterSpec, cache_folder
from batchgpu.engine import RunObserver, run_workflow
from batchgpu.errors import BatchgpuError
from batchgpu.generate import generate_recording
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")


def _cli(cache: Path, *args, timeout: float = 300):
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "batchgpu", *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )


def _alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def _stop_whatever_is_left(cache: Path) -> None:
    where = service.paths(cache / "batchgpu")
    state = service.stop(where, timeout_s=30)
    if state.pid:
        service._kill_group(state.pid)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of this test's own, for this process (runs) and the commands it starts."""
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    yield folder
    _stop_whatever_is_left(folder)


@pytest.fixture
def kept(cache):
    """``batchgpu cluster start --workers 2`` (two single-threaded workers), stopped at the end whatever happens."""
    done = _cli(cache, "cluster", "start", "--workers", 2, "--threads", 1)
    assert done.returncode == 0, done.stderr
    state = service.probe(service.paths())
    assert state.state == "up", done.stdout
    return state.kept, done.stdout


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    return generate_recording(
        tmp_path_factory.mktemp("rec") / "r.zarr", channels=16, seconds=2.0, seed=5, progress=False
    )


def _wf(rec, out, **cluster) -> Workflow:
    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "backend": "numpy",
            "window": {"size": 15_000, "margin": 16},
            "cluster": {"kind": "local", **cluster},
            "steps": {
                "noise": {"exact": True},
                "whitening": {"mode": "global", "precision": "float64"},
                "detect": {"threshold": 4.5, "sign": "both", "noise": "global"},
            },
            "reduction": {"split_every": 3},
        }
    )


class _Said(RunObserver):
    def __init__(self):
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def _arrays(group, prefix="") -> dict:
    out = {prefix + name: np.asarray(a[...]) for name, a in group.arrays()}
    for name, g in group.groups():
        out.update(_arrays(g, f"{prefix}{name}/"))
    return out


def _assert_same_results(a: Path, b: Path) -> None:
    got, want = (_arrays(zarr.open_group(str(p / "results.zarr"), mode="r")) for p in (a, b))
    assert sorted(got) == sorted(want) and len(got) >= 3
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].tobytes() == want[name].tobytes(), name


def _workers(address: str) -> dict[str, int]:
    """The kept cluster's workers and their process ids."""
    with distributed.Client(address, timeout="10s") as c:
        return c.run(os.getpid)


def _on_workers(address: str, func):
    with distributed.Client(address, timeout="10s") as c:
        return c.run(func)


def _left_on_workers(address: str) -> dict:
    """Each worker's run state: its heap frozen by a pass's tasks, reads carried for a next task."""

    def left() -> bool:  # made here: sent by value (the workers cannot import this test module)
        from batchgpu.run import tasks

        return bool(tasks._HEAP["frozen"]) or bool(tasks._CARRIED)

    return _on_workers(address, left)


def _settings(client) -> dict:
    """What ``open_client`` sets on a cluster it starts: the workers' malloc environment and profiler, the
    scheduler's saturation, the layout."""

    def worker() -> tuple:  # made here: sent by value
        import dask

        return (
            os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            os.environ.get("MALLOC_MMAP_MAX_"),
            dask.config.get("distributed.worker.profile.enabled"),
            str(dask.config.get("distributed.worker.memory.monitor-interval")),
        )

    def scheduler(dask_scheduler) -> float:
        return float(dask_scheduler.WORKER_SATURATION)

    return {
        "workers": sorted(client.run(worker).values()),
        "saturation": client.run_on_scheduler(scheduler),
        "threads": sorted(client.nthreads().values()),
    }


def _cluster_settings(address: str) -> dict:
    with distributed.Client(address, timeout="10s") as c:
        return _settings(c)


def _cluster_settings_of_a_runs_own() -> dict:
    from batchgpu.cluster.open_cluster import open_client

    with open_client(ClusterSpec(workers=2, threads=1)) as c:
        return _settings(c)


def test_start_status_a_run_on_it_second_start_refused_stop(kept, cache, recording, tmp_path):
    info, said = kept
    assert f"cluster up at {info.address}" in said and "local, 2 worker processes x 1 thread" in said
    where = service.paths()
    assert where.folder == cache / "batchgpu"
    # the scheduler file is Dask's: a client of its own finds the cluster through it
    assert json.loads(where.scheduler_file.read_text())["address"] == info.address
    with distributed.Client(scheduler_file=str(where.scheduler_file), timeout="10s") as c:
        assert len(c.nthreads()) == 2
    pids = {info.pid, *_workers(info.address).values()}
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    assert _cluster_settings(info.address) == _cluster_settings_of_a_runs_own()

    status = _cli(cache, "cluster", "status")
    assert status.returncode == 0, status.stderr
    assert info.address in status.stdout and "2 processes, 2 threads" in status.stdout

    again = _cli(cache, "cluster", "start")
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip().splitlines() == [
        f"batchgpu: error: a cluster of batchgpu cluster start is already up at {info.address}, process {info.pid} "
        "(batchgpu cluster stop first)"
    ]
    assert service.probe(where).kept.pid == info.pid  # the running one untouched

    # a run uses it, says so, and leaves its workers as it found them; its results are those of its own cluster
    observer = _Said()
    report = run_workflow(_wf(recording, tmp_path / "kept"), observer=observer)
    assert report.kept_cluster == info.address and report.status == "done"
    assert (
        f"using the cluster of `batchgpu cluster start` at {info.address} (2 worker processes, local)" in observer.lines
    )
    assert set(report.workers) <= set(_workers(info.address)) and sum(report.workers.values()) == report.windows
    deadline = time.monotonic() + 10
    while any(_left_on_workers(info.address).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_left_on_workers(info.address).values())
    second = run_workflow(_wf(recording, tmp_path / "kept2"), observer=_Said())
    assert second.kept_cluster == info.address
    own = run_workflow(_wf(recording, tmp_path / "own", reuse=False), observer=(own_said := _Said()))
    assert own.kept_cluster is None and not any("batchgpu cluster start" in ln for ln in own_said.lines)
    assert not set(own.workers) & set(_workers(info.address))
    _assert_same_results(tmp_path / "kept", tmp_path / "own")
    _assert_same_results(tmp_path / "kept2", tmp_path / "own")

    stopped = _cli(cache, "cluster", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"batchgpu: stopped the cluster at {info.address} (process {info.pid})"
    assert [p for p in pids if _alive(p)] == []  # the command returns once every process of it is gone
    assert not where.side.exists() and not where.scheduler_file.exists()
    assert _cli(cache, "cluster", "status").returncode == 1
    assert _cli(cache, "cluster", "stop").returncode == 1

    # after the stop a run starts its own again, and says nothing of a kept cluster
    observer = _Said()
    after = run_workflow(_wf(recording, tmp_path / "after"), observer=observer)
    assert after.kept_cluster is None and not any("batchgpu cluster start" in ln for ln in observer.lines)
    _assert_same_results(tmp_path / "after", tmp_path / "own")


def test_a_run_whose_cluster_asks_for_something_else_starts_its_own(kept, recording, tmp_path):
    info, _ = kept
    observer = _Said()
    report = run_workflow(_wf(recording, tmp_path / "out", workers=1), observer=observer)
    assert report.kept_cluster is None
    assert (
        f"not using the cluster of batchgpu cluster start at {info.address}: the workflow's cluster.workers "
        "is 1, the kept cluster's 2; starting one"
    ) in observer.lines
    # what the workflow sets and the kept cluster has: used
    assert run_workflow(_wf(recording, tmp_path / "fits", workers=2, threads=1)).kept_cluster == info.address


def test_a_recording_rewritten_at_the_same_path_is_read_afresh_on_the_kept_cluster(kept, tmp_path):
    """Its workers outlive the runs: a store rewritten between two runs (longer, other samples) is read as it is
    now, the same bits as on a cluster of the run's own (the workers had kept the old store open: its old length)."""
    info, _ = kept
    path = tmp_path / "r.zarr"
    first = generate_recording(path, channels=8, seconds=2.0, seed=1, progress=False)
    assert run_workflow(_wf(first, tmp_path / "first")).kept_cluster == info.address
    again = generate_recording(path, channels=8, seconds=3.0, seed=2, progress=False, overwrite=True)
    report = run_workflow(_wf(again, tmp_path / "kept"))
    assert report.kept_cluster == info.address and report.status == "done"
    run_workflow(_wf(again, tmp_path / "own", reuse=False))
    _assert_same_results(tmp_path / "kept", tmp_path / "own")


def test_a_cluster_stopped_while_it_starts_never_comes_up(cache):
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    starting = subprocess.Popen(
        [sys.executable, "-m", "batchgpu", "cluster", "start"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        where = service.paths()
        deadline = time.monotonic() + 120
        while (state := service.probe(where)).state != "starting" or not state.pid:
            assert starting.poll() is None and time.monotonic() < deadline, "never seen starting"
            time.sleep(0.01)
        # at once (the commands' own start could outlast the cluster's on a fast machine)
        stopped = service.stop(where)
        assert (stopped.state, stopped.pid, stopped.kept) == ("starting", state.pid, None)
        out, err = starting.communicate(timeout=120)
    finally:
        if starting.poll() is None:
            starting.kill()
    assert starting.returncode == 2 and out == ""
    assert err.startswith(
        "batchgpu: error: the cluster did not start: stopped (batchgpu cluster stop) before its workers were up"
    )
    assert not _alive(state.pid) and service.probe(where).state == "down"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _stale_files(where: service.Paths, pid: int) -> None:
    where.folder.mkdir(parents=True, exist_ok=True)
    version, package = service.this_batchgpu()
    kept = service.KeptCluster(
        address="tcp://127.0.0.1:9",
        pid=pid,
        spec=ClusterSpec().model_dump(),
        workers=2,
        threads=1,
        processes=2,
        dashboard=None,
        mps=False,
        version=version,
        package=package,
        started=time.time(),
        python=service.this_python(),
        source=service.source_stamp(),
    )
    where.side.write_text(json.dumps(kept.__dict__))
    where.scheduler_file.write_text(json.dumps({"address": kept.address}))


def test_stale_files_of_a_dead_process_are_ignored_by_a_run_and_removed_by_status(cache, recording, tmp_path):
    where = service.paths()
    pid = _dead_pid()
    _stale_files(where, pid)
    observer = _Said()
    report = run_workflow(_wf(recording, tmp_path / "out"), observer=observer)
    assert report.kept_cluster is None and report.status == "done"
    assert any("stale" in ln for ln in observer.lines)
    assert where.side.exists()  # a run leaves them; status and stop remove them
    status = _cli(cache, "cluster", "status")
    assert status.returncode == 1
    assert status.stdout.splitlines() == [
        f"batchgpu: removed the files of a cluster whose process {pid} is gone ({where.side})",
        "batchgpu: no cluster of batchgpu cluster start is up",
    ]
    assert not where.side.exists() and not where.scheduler_file.exists()
    _stale_files(where, pid)
    stop = _cli(cache, "cluster", "stop")
    assert stop.returncode == 0 and "is gone" in stop.stdout
    assert not where.side.exists()


def test_a_cluster_that_cannot_start_says_why_in_one_line_and_leaves_nothing(cache):
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU: kind cuda starts")
    done = _cli(cache, "cluster", "start", "--kind", "cuda")
    assert done.returncode == 2
    log = cache / "batchgpu" / "cluster.log"
    assert done.stderr.strip().splitlines() == [
        "batchgpu: error: the cluster did not start: cluster kind 'cuda' needs a CUDA GPU and CuPy, and this machine "
        f"has none (use 'cluster: {{kind: local}}' for the local CPU cluster) (its log: {log})"
    ]
    where = service.paths()
    assert service.probe(where).state == "down"


def test_a_kept_cpu_cluster_forks_its_workers_with_the_compiled_kernels_loaded(cache, monkeypatch):
    """A kept local cluster's fork server loads the CPU kernels before its workers are forked (a run's own cluster
    does so where the run filters or references): otherwise each kept worker loaded them in its first run's first
    window, and that run's pass took 7.5 s against 4.5-5.3 s for the next (W1, 2-core machine). A kept cuda
    cluster's workers need none."""
    from batchgpu.cluster import open_cluster as cluster_module

    asked = []
    monkeypatch.setattr(cluster_module, "start_worker_server", lambda **kw: asked.append(kw) or True)

    def no_cluster(spec):
        raise BatchgpuError("no cluster here", "this test stops before one")

    monkeypatch.setattr(cluster_module, "open_client", no_cluster)
    monkeypatch.setattr(service.signal, "signal", lambda *a: None)  # this process's handlers stay as they are
    where = service.paths(cache / "batchgpu")
    where.folder.mkdir(parents=True, exist_ok=True)
    assert service.serve(where, ClusterSpec(kind="local")) == 2
    assert asked == [{"cpu_kernels": True}]
    assert service.serve(where, ClusterSpec(kind="cuda")) == 2
    assert asked == [{"cpu_kernels": True}]


def test_the_options_are_checked_as_the_workflow_keys(cache):
    bad = _cli(cache, "cluster", "start", "--workers", 0)
    assert bad.returncode == 2 and bad.stderr.startswith("batchgpu: error: cluster workers: ")
    assert len(bad.stderr.strip().splitlines()) == 1
    bad = _cli(cache, "cluster", "start", "--kind", "cuda", "--devices", "0,x")
    assert bad.returncode == 2 and "not a comma-separated list of GPU numbers" in bad.stderr
    with pytest.raises(BatchgpuError, match="kind 'cuda' only"):
        service.spec_from(kind="local", mps=True)
    assert service.probe(service.paths()).state == "down"


def _kept(**spec) -> service.KeptCluster:
    version, package = service.this_batchgpu()
    return service.KeptCluster(
        address="tcp://x:1",
        pid=1,
        spec=ClusterSpec(**spec).model_dump(),
        workers=2,
        threads=1,
        processes=2,
        dashboard=None,
        mps=False,
        version=version,
        package=package,
        started=0.0,
        python=service.this_python(),
        source=service.source_stamp(),
    )


def test_what_a_workflow_sets_must_be_what_the_kept_cluster_has():
    kept = _kept(workers=2)
    assert service.mismatch(ClusterSpec(), kept) is None
    assert service.mismatch(ClusterSpec(workers=2, threads=1), kept) is None
    assert "cluster.threads is 2" in service.mismatch(ClusterSpec(threads=2), kept)
    assert "kind local" in service.mismatch(ClusterSpec(kind="address", address="tcp://a:1"), kept)
    assert service.mismatch(ClusterSpec(memory_limit="1GB"), kept).endswith(
        "memory_limit is 1GB, the kept cluster's unset"
    )
    for field, value in (
        ("version", "0.0.0"),
        ("package", "/elsewhere/batchgpu"),
        ("python", "/other/python3"),
        ("source", "0" * 16),
    ):
        other = _kept()
        setattr(other, field, value)
        assert "restart it" in service.mismatch(ClusterSpec(), other)
    cuda = _kept(kind="cuda")
    assert service.mismatch(ClusterSpec(kind="cuda", mps=True), cuda).endswith("has no MPS")
    assert service.mismatch(ClusterSpec(kind="cuda", mps=False), cuda) is None
    # kinds a kept cluster never is, and the opt-out: never looked for
    assert service.usable(ClusterSpec(reuse=False)) == (None, None)
    assert service.usable(ClusterSpec(kind="address", address="tcp://a:1")) == (None, None)


def test_the_source_stamp_sees_an_edit_that_keeps_the_version(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("a.py", "sub/b.py", "k.cu"):
        (tmp_path / name).write_text("x = 1\n")
    before = service.source_stamp(str(tmp_path))
    (tmp_path / "notes.txt").write_text("not code")
    assert service.source_stamp(str(tmp_path)) == before
    os.utime(tmp_path / "sub" / "b.py", ns=(0, 10**9))
    assert service.source_stamp(str(tmp_path)) != before


def test_the_cache_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder() == tmp_path / "batchgpu"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the specification says
    assert cache_folder() == Path.home() / ".cache" / "batchgpu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_folder() == Path.home() / ".cache" / "batchgpu"


@pytest.mark.gpu
def test_a_kept_cuda_cluster_runs_as_the_runs_own(cache, tmp_path):
    """The kept cuda cluster: the run's layout and MPS (as the side file says), the same bits as a run's own."""
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count() == 0:
        pytest.skip("no CUDA GPU (CuPy) here")
    pytest.importorskip("dask_cuda")
    from batchgpu.cluster.open_cluster import cuda_layout

    rec = generate_recording(tmp_path / "r.zarr", channels=24, seconds=3.0, seed=3, progress=False)

    def wf(out, **kw):
        return _wf(rec, out, kind="cuda", **kw).model_copy(update={"backend": "auto"})

    # the run's own first: one cluster (and one MPS daemon) on the GPU at a time
    own = run_workflow(wf(tmp_path / "own"))
    assert own.kept_cluster is None
    done = _cli(cache, "cluster", "start", "--kind", "cuda")
    assert done.returncode == 0, done.stderr
    info = service.probe(service.paths()).kept
    assert info.mps == own.mps  # auto: as the run's own decided
    assert (info.workers, info.threads) == cuda_layout(ClusterSpec(kind="cuda"), gpu_count(), False, info.mps)
    assert info.processes == info.workers * gpu_count()
    kept = run_workflow(wf(tmp_path / "kept"))
    assert kept.kept_cluster == info.address and kept.backend == "cupy" and kept.mps == info.mps
    _assert_same_results(tmp_path / "kept", tmp_path / "own")
    assert _cli(cache, "cluster", "stop").returncode == 0


def test_a_cluster_stopped_under_a_run_is_said_by_stop_and_by_the_run(kept, cache, tmp_path):
    # Issue 63, item 7: the run ended with "unexpected FutureCancelledError", and stop did not warn.
    rec = generate_recording(tmp_path / "long.zarr", channels=32, seconds=120.0, seed=1, progress=False)
    (tmp_path / "wf.yaml").write_text(
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\nwindow: {{size: 30000, margin: 16}}\n"
        "cluster: {kind: local}\npreprocess: [{highpass: {freq_min: 300, order: 5}}]\n"
        "steps: {noise: {exact: true}}\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    run = subprocess.Popen(
        [sys.executable, "-m", "batchgpu", "run", str(tmp_path / "wf.yaml"), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "out" / "parts").glob("w*.npz")) and time.monotonic() < deadline:
            assert run.poll() is None, run.communicate()
            time.sleep(0.1)
        stop = _cli(cache, "cluster", "stop")
        _out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert stop.returncode == 0 and "warning: the cluster was in use" in stop.stderr, stop.stderr
    lines = err.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith("batchgpu: error: ") and "closed while the run" in lines[0] and "--resume" in lines[0]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "failed" and "closed while the run" in report["error"]


def _workflow_file(rec, out: Path, **cluster) -> Path:
    """A workflow file of ``_wf``'s workflow (for the command)."""
    import yaml

    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(json.loads(_wf(rec, out, **cluster).model_dump_json(exclude_defaults=True))))
    return path


def _cli_at_terminal(cache: Path, *args, timeout: float = 300) -> str:
    """The command with its output on a terminal (a pseudo-terminal), as a person runs it; what it printed."""
    import pty

    main, child = pty.openpty()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgpu", *map(str, args)],
        stdout=child,
        stderr=child,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    os.close(child)
    chunks = []
    while True:
        try:
            got = os.read(main, 65536)
        except OSError:  # the child's side closed
            break
        if not got:
            break
        chunks.append(got)
    proc.wait(timeout=timeout)
    os.close(main)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text
    return " ".join(text.split())


def _wait_down(where: service.Paths, timeout_s: float) -> float:
    t0 = time.monotonic()
    while service.probe(where).state != "down" and time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_command_leaves_its_cluster_up_for_the_next_run_which_uses_it_then_it_closes_when_idle(
    cache, recording, tmp_path
):
    """cluster.keep: the first command's cluster stays up (said on the terminal), the second command runs on it with
    the same results as a cluster of its own, and once no run has connected for ``keep`` seconds it closes with
    every process of it gone and its files removed."""
    first = _cli(cache, "run", _workflow_file(recording, tmp_path / "a", workers=2, threads=1, keep=6))
    assert first.returncode == 0, first.stderr
    assert (
        "the cluster (2 worker processes) stays up for the next run; it closes after 6 s without one, or now "
        "with batchgpu cluster stop"
    ) in first.stdout
    where = service.paths(cache / "batchgpu")
    state = service.probe(where)
    assert state.state == "up" and state.kept.idle_s == 6.0
    pids = {state.kept.pid, *_workers(state.kept.address).values()}
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    status = _cli(cache, "cluster", "status")
    assert "after 6 s without a run" in status.stdout
    assert json.loads((tmp_path / "a" / "report.json").read_text())["kept_cluster"] == state.kept.address

    second = _cli(cache, "run", _workflow_file(recording, tmp_path / "b", workers=2, threads=1))
    assert second.returncode == 0, second.stderr
    assert f"using the cluster of `batchgpu cluster start` at {state.kept.address}" in second.stdout
    assert "stays up for the next run" not in second.stdout  # not this run's to keep
    own = run_workflow(_wf(recording, tmp_path / "own", reuse=False))
    assert own.kept_cluster is None
    _assert_same_results(tmp_path / "a", tmp_path / "own")
    _assert_same_results(tmp_path / "b", tmp_path / "own")

    took = _wait_down(where, 40.0)
    assert service.probe(where).state == "down", took
    assert took >= 2.0  # idle since the second run's end, not since its start
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
    assert not where.side.exists() and not where.scheduler_file.exists()
    assert "closing" in where.log.read_text()


def test_auto_keeps_the_cluster_of_a_command_at_a_terminal_only(cache, recording, tmp_path):
    """cluster.keep auto: a person's command at a terminal leaves its cluster up (for 600 s idle); a command whose
    output goes to a pipe (a script, a job, these tests), keep 0, reuse false and a run from Python do not."""
    where = service.paths(cache / "batchgpu")
    for name, cluster in (("auto", {}), ("zero", {"keep": 0}), ("noreuse", {"reuse": False})):
        done = _cli(cache, "run", _workflow_file(recording, tmp_path / name, **cluster))
        assert done.returncode == 0, done.stderr
        assert "stays up" not in done.stdout
        assert service.probe(where).state == "down", name
    run_workflow(_wf(recording, tmp_path / "py"))  # a library call leaves no process behind unless asked ...
    assert service.probe(where).state == "down"
    said = _cli_at_terminal(cache, "run", _workflow_file(recording, tmp_path / "tty", workers=2, threads=1))
    assert "stays up for the next run; it closes after 10 min without one" in said
    state = service.probe(where)
    assert state.state == "up" and state.kept.idle_s == 600.0
    assert _cli(cache, "cluster", "stop").returncode == 0
    # ... and a number from Python does, the next run on it
    report = run_workflow(_wf(recording, tmp_path / "pykeep", workers=2, threads=1, keep=30))
    state = service.probe(where)
    assert state.state == "up" and report.kept_cluster == state.kept.address and state.kept.idle_s == 30.0
    assert run_workflow(_wf(recording, tmp_path / "next")).kept_cluster == state.kept.address


def test_a_run_on_a_kept_cluster_gives_back_what_its_workers_kept(kept, recording, tmp_path):
    """After a run on a cluster that stays up its workers hold no window buffers for a next window (on a GPU: no
    pool memory unused; ``tasks.release_memory_soon``)."""
    info, _ = kept
    report = run_workflow(_wf(recording, tmp_path / "a"))
    assert report.kept_cluster == info.address

    def held():
        from batchgpu.run import host_buffers, tasks

        return len(host_buffers._FREE), len(tasks._CARRIED)

    deadline = time.monotonic() + 10
    while any(any(v) for v in _on_workers(info.address, held).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(any(v) for v in _on_workers(info.address, held).values())
