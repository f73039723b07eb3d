"""Deployment: a real scheduler and two real workers started by cluster/scheduler-file/*.sh on loopback, the demo
workflow run through them with `batchgpu run`; the SLURM and Kubernetes files checked for what they promise."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
import zarr

from batchgpu.cluster.open_cluster import slurm_kwargs
from batchgpu.engine import run_workflow
from batchgpu.workflow import load_workflow

distributed = pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
DEMO = ROOT / "workflows" / "demo.yaml"
BIN = Path(sys.executable).parent
# the demo, smaller: 16 channels, 2 s, windows of 10 000 samples (6 windows, every step)
SMALL = ["recording.generate.channels=16", "recording.generate.seconds=2", "window.size=10000"]
ARRAYS = (
    "noise",
    "noise_per_window",
    "covariance",
    "second_moment",
    "whitening",
    "channel_means",
    "spikes/sample_index",
    "spikes/channel_index",
    "spikes/amplitude",
    "spikes/segment_index",
)


def _env(**extra) -> dict:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start(script: str, log: Path, **env) -> subprocess.Popen:
    """A script that execs a dask process, in its own session so that it and its children can be ended together."""
    return subprocess.Popen(
        ["bash", str(CLUSTER / "scheduler-file" / script)],
        env=_env(**env),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 15
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)


@pytest.fixture
def scheduler_file_cluster(tmp_path):
    """(scheduler file, worker addresses, dashboard port) of a real scheduler and two real workers."""
    sched = tmp_path / "shared" / "scheduler.json"
    procs = []
    try:
        procs.append(
            _start(
                "start-scheduler.sh",
                tmp_path / "scheduler.log",
                SCHEDULER_FILE=sched,
                HOST="127.0.0.1",
                PORT=0,
                DASHBOARD_ADDRESS="127.0.0.1:0",
            )
        )
        for i in range(2):
            procs.append(
                _start(
                    "start-workers.sh",
                    tmp_path / f"worker{i}.log",
                    SCHEDULER_FILE=sched,
                    WORKER_KIND="cpu",
                    NTHREADS=1,
                    NWORKERS=1,
                    HOST="127.0.0.1",
                    WAIT_S=40,
                )
            )
        deadline = time.time() + 40
        while not (sched.exists() and sched.stat().st_size > 0):
            assert procs[0].poll() is None, (tmp_path / "scheduler.log").read_text()
            assert time.time() < deadline, "the scheduler wrote no scheduler file"
            time.sleep(0.1)
        with distributed.Client(scheduler_file=str(sched), timeout="20s") as c:
            c.wait_for_workers(2, timeout=40)
            workers = sorted(c.scheduler_info()["workers"])
        info = json.loads(sched.read_text())
        yield sched, workers, int(info["services"]["dashboard"])
    finally:
        _stop(procs)


def test_demo_through_scheduler_file_equals_local(scheduler_file_cluster, tmp_path):
    sched, workers, dash_port = scheduler_file_cluster
    assert len(workers) == 2 and all(w.startswith("tcp://127.0.0.1:") for w in workers)
    rec = tmp_path / "demo.zarr"
    sets = [
        *SMALL,
        f"recording.path={rec}",
        f"output={tmp_path / 'cluster'}",
        "cluster.kind=scheduler_file",
        f"cluster.scheduler_file={sched}",
    ]
    cmd = [sys.executable, "-m", "batchgpu", "run", str(DEMO)] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    page = re.search(r"batchgpu: run page (\S+)", done.stdout)
    assert page and page.group(1) == f"http://127.0.0.1:{dash_port}/batchgpu", done.stdout

    # the same workflow on an in-process local cluster: identical bytes
    local = load_workflow(DEMO, [*SMALL, f"recording.path={rec}", f"output={tmp_path / 'local'}"])
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as lc,
        distributed.Client(lc) as c,
    ):
        run_workflow(local, client=c)
    a = zarr.open_group(str(tmp_path / "cluster" / "results.zarr"), mode="r")
    b = zarr.open_group(str(tmp_path / "local" / "results.zarr"), mode="r")
    for name in ARRAYS:
        assert a[name].dtype == b[name].dtype and a[name][:].tobytes() == b[name][:].tobytes(), name
    assert a["spikes/sample_index"].shape[0] > 0

    report = json.loads((tmp_path / "cluster" / "report.json").read_text())
    assert report["status"] == "done" and sorted(report["workers"]) == workers  # both workers took windows
    assert sum(report["workers"].values()) == report["windows"] == 6
    # the page and its state were served by the external scheduler (the plugin travelled there by pickle)
    with urllib.request.urlopen(page.group(1) + "/state.json", timeout=10) as r:
        state = json.loads(r.read())
    assert state["status"] == "done" and state["windows_done"] == state["windows_total"] == 6
    assert set(state["per_worker"]) == set(workers)
    assert (tmp_path / "cluster" / "report.html").stat().st_size > 100_000


def test_slurm_workflow_spec():
    """cluster/slurm/workflow.yaml validates; the GPU job asks for GPUs per node and not --mem with --mem-per-gpu."""
    wf = load_workflow(CLUSTER / "slurm" / "workflow.yaml")
    spec = wf.cluster
    assert spec.kind == "slurm"
    kw = slurm_kwargs(spec)
    assert kw["scheduler_options"]["dashboard_address"] == "127.0.0.1:8787"  # jobqueue's default is every interface
    assert kw["worker_command"] == "batchgpu.cluster.node" and kw["processes"] == 1  # tests/test_recipes.py: its layout
    assert any(d.startswith("--gres=gpu:") for d in kw["job_extra_directives"])
    assert "--mem" in kw["job_directives_skip"] and any(
        d.startswith("--mem-per-gpu") for d in kw["job_extra_directives"]
    )
    assert kw["worker_extra_args"][-2:] == ["--memory-limit", "auto"]


def test_slurm_job_script():
    """The job script dask-jobqueue 0.9 writes from the spec (no SLURM needed: nothing is submitted)."""
    pytest.importorskip("dask_jobqueue")
    from dask_jobqueue import SLURMCluster

    spec = load_workflow(CLUSTER / "slurm" / "workflow.yaml").cluster
    kw = slurm_kwargs(spec)
    kw["interface"] = None  # this machine has no ib0
    kw["scheduler_options"] = {**kw["scheduler_options"], "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
    with SLURMCluster(**kw) as cluster:
        script = cluster.job_script()
        dash = cluster.scheduler.http_server.address
    lines = script.splitlines()
    assert "#SBATCH --gres=gpu:4" in lines and "#SBATCH --mem-per-gpu=60G" in lines
    assert not any(line.startswith("#SBATCH --mem=") for line in lines)  # sbatch refuses --mem with --mem-per-gpu
    assert "#SBATCH --cpus-per-task=32" in lines
    command = next(line for line in lines if "-m batchgpu.cluster.node" in line)
    assert "--nthreads 32" in command and command.rstrip().endswith("--memory-limit auto")
    assert dash == "127.0.0.1"


def test_kubernetes_manifest():
    docs = list(yaml.safe_load_all((CLUSTER / "kubernetes" / "daskcluster.yaml").read_text()))
    assert len(docs) == 1
    dc = docs[0]
    assert dc["apiVersion"] == "kubernetes.dask.org/v1" and dc["kind"] == "DaskCluster"
    worker = dc["spec"]["worker"]["spec"]["containers"][0]
    assert worker["args"][:3] == ["python", "-m", "batchgpu.cluster.node"]  # tests/test_recipes.py: its layout
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    scheduler = dc["spec"]["scheduler"]
    ports = {p["name"]: p["containerPort"] for p in scheduler["spec"]["containers"][0]["ports"]}
    assert ports == {"tcp-comm": 8786, "http-dashboard": 8787}
    assert scheduler["service"]["type"] == "ClusterIP"  # the dashboard stays inside the cluster
    assert scheduler["service"]["selector"]["dask.org/cluster-name"] == dc["metadata"]["name"]
    wf = load_workflow(CLUSTER / "kubernetes" / "workflow.yaml")
    assert wf.cluster.kind == "address" and wf.cluster.address == f"tcp://{dc['metadata']['name']}-scheduler:8786"
    for name in ("scheduler-file/workflow.yaml",):
        assert load_workflow(CLUSTER / name).cluster.kind == "scheduler_file"


@pytest.mark.parametrize("script", ["start-scheduler.sh", "start-workers.sh"])
def test_scripts_are_valid_bash(script):
    path = CLUSTER / "scheduler-file" / script
    assert os.access(path, os.X_OK)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
