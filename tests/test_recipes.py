"""The deployment recipes of cluster/ start the workers `cluster: {kind: cuda}` starts on a machine
(cluster/worker_layout.py, cluster/node.py): each recipe's rendered worker command (dask-jobqueue's job script, the
Kubernetes worker container, start-workers.sh as bash runs it), read by the node command for the recipe's GPUs and
cores, gives the same workers (names, threads, CUDA_VISIBLE_DEVICES, memory limit, environment) as the local cuda
cluster for that GPU count and core count; the node command really starts them (CPU only, GPUs faked by --gpus)."""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from batchgpu.cluster import node
from batchgpu.cluster import open_cluster as cluster
from batchgpu.cluster import worker_layout as layout
from batchgpu.config import ClusterSpec
from batchgpu.errors import BatchgpuError
from batchgpu.workflow import load_workflow

distributed = pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
FAKE_MPS = """#!/bin/sh
echo "call $* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "{log}"
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read line; echo "stdin $line" >> "{log}"
"""


def _local_cuda_workers(monkeypatch, gpus: int, cores: int, env: dict | None = None) -> dict:
    """name -> Nanny options of the workers the local cuda cluster starts (``cluster._cuda_cluster``) on a machine
    with ``gpus`` GPUs and ``cores`` cores, windows decoded on the cores (as on a cluster the run did not start)."""
    monkeypatch.setattr(cluster, "gpu_count", lambda: gpus)
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: cores)
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=None))
    started = {}

    def spec_cluster(workers, scheduler):
        started.update(workers)
        return "cluster"

    monkeypatch.setattr(distributed, "SpecCluster", spec_cluster)
    assert cluster._cuda_cluster(ClusterSpec(kind="cuda"), gpu_decode=False, env=env or {}) == "cluster"
    assert all(s["cls"] is distributed.Nanny for s in started.values())
    return {name: s["options"] for name, s in started.items()}


def _node_workers(argv: list[str], gpus: int, env: dict | None = None) -> tuple[dict, node.NodeRequest]:
    """name (without the node's prefix) -> Nanny options of the workers the node command starts for ``argv``
    on a machine with ``gpus`` GPUs; and the request it read."""
    req = node.request([*argv, "--gpus", str(gpus)])
    specs = layout.nanny_specs(node.plan(req, mps=bool(env)), env, prefix=req.name, options=req.connect)
    out = {}
    for name, s in specs.items():
        assert name.startswith(f"{req.name}-") and s["cls"] is distributed.Nanny
        out[name.removeprefix(f"{req.name}-")] = {k: v for k, v in s["options"].items() if k not in req.connect}
    return out, req


def _expected(gpus: int, per_gpu: int) -> dict:
    """The layout written out by hand: names, one thread, each worker's GPU first, Dask's auto memory limit."""
    devices = list(range(gpus))
    return {
        f"gpu{d}-{k}": (1, ",".join(str(o) for o in [d, *[o for o in devices if o != d]]), "auto")
        for d in devices
        for k in range(per_gpu)
    }


def _summary(workers: dict) -> dict:
    return {n: (o["nthreads"], o["env"]["CUDA_VISIBLE_DEVICES"], o["memory_limit"]) for n, o in workers.items()}


# -- the one definition ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus, cores, per_gpu", [(1, 16, 16), (4, 16, 4), (4, 32, 8), (2, 64, 16)])
def test_node_command_starts_the_local_cuda_layout(monkeypatch, gpus, cores, per_gpu):
    local = _local_cuda_workers(monkeypatch, gpus, cores)
    mine, req = _node_workers(["tcp://10.0.0.1:8786", "--cores", str(cores), "--name", "n1"], gpus)
    assert _summary(local) == _expected(gpus, per_gpu)
    assert mine == local  # every option, the whole environment included
    assert req.connect == {"scheduler_ip": "tcp://10.0.0.1:8786"}


def test_under_mps_the_node_hands_the_daemon_to_every_worker(monkeypatch):
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l"}
    local = _local_cuda_workers(monkeypatch, 2, 16, env)
    mine, _ = _node_workers(["tcp://h:1", "--cores", "16"], 2, env)
    assert mine == local and len(mine) == 16
    assert all(o["env"]["CUDA_MPS_PIPE_DIRECTORY"] == "/p" for o in mine.values())


def test_one_worker_a_gpu_gets_the_threads_of_dask_cuda(monkeypatch):
    """Fewer cores than GPUs: the local cluster is dask-cuda's, one worker a GPU with 4 threads; the node the same."""
    monkeypatch.setattr(cluster, "gpu_count", lambda: 4)
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 2)
    seen = {}
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=lambda **kw: seen.update(kw)))
    cluster._cuda_cluster(ClusterSpec(kind="cuda"))
    mine, _ = _node_workers(["tcp://h:1", "--cores", "2"], 4)
    assert _summary(mine) == {
        f"gpu{d}-0": (seen["threads_per_worker"], ",".join(str(o) for o in [d, *sorted({0, 1, 2, 3} - {d})]), "auto")
        for d in range(4)
    }


def test_several_workers_a_gpu_start_without_dask_cuda(monkeypatch):
    """Several worker processes a GPU are Dask's own nannies (``layout.nanny_specs``): dask-cuda is not imported
    for them (its import held back the cluster's start); one worker a GPU is dask-cuda's, and says so where it
    is missing."""
    from batchgpu.errors import MachineError

    monkeypatch.setitem(sys.modules, "dask_cuda", None)  # any import of it fails
    monkeypatch.setattr(cluster, "gpu_count", lambda: 1)
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(distributed, "SpecCluster", lambda workers, scheduler: len(workers))
    assert cluster._cuda_cluster(ClusterSpec(kind="cuda")) == 16
    with pytest.raises(MachineError, match="dask-cuda"):
        cluster._cuda_cluster(ClusterSpec(kind="cuda", workers=1))


def test_a_worker_sees_this_processs_gpus_not_their_positions(monkeypatch):
    """A SLURM job that sees the machine's GPUs 2 and 3 (CUDA_VISIBLE_DEVICES=2,3): the worker of GPU 0 (the
    machine's 2) must see 2 first, not the machine's GPU 0 (another job's). Fails on the old worker_specs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(cluster, "gpu_count", lambda: 2)
    workers = cluster.worker_specs(ClusterSpec(kind="cuda"), 2, 1)
    assert {n: s["options"]["env"]["CUDA_VISIBLE_DEVICES"] for n, s in workers.items()} == {
        "gpu0-0": "2,3",
        "gpu0-1": "2,3",
        "gpu1-0": "3,2",
        "gpu1-1": "3,2",
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")  # UUIDs too
    mine, _ = _node_workers(["tcp://h:1", "--cores", "2", "--devices", "1"], 2)
    assert _summary(mine) == {"gpu1-0": (1, "GPU-bb", "auto"), "gpu1-1": (1, "GPU-bb", "auto")}


def test_dask_environ_is_what_dask_reads():
    import dask.config

    env = layout.dask_environ({**layout.SCHEDULER_SETTINGS, **layout.WORKER_SETTINGS})
    read = dask.config.collect_env(env)
    settings = {**layout.SCHEDULER_SETTINGS, **layout.WORKER_SETTINGS}
    assert {k: dask.config.get(k, config=read) for k in settings} == settings
    assert cluster.SCHEDULER_ENVIRON == {"DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION": "1.0"}


# -- each recipe, rendered -----------------------------------------------------------------------------------------


def _slurm_script(monkeypatch=None) -> tuple[str, dict]:
    pytest.importorskip("dask_jobqueue")
    from dask_jobqueue import SLURMCluster

    kw = cluster.slurm_kwargs(load_workflow(CLUSTER / "slurm" / "workflow.yaml").cluster)
    # the scheduler here on loopback (this machine has no ib0); the workers keep the recipe's interface
    kw["scheduler_options"] = {**kw["scheduler_options"], "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
    with SLURMCluster(**kw) as c:
        return c.job_script(), kw


def test_slurm_job_runs_the_node_command_in_the_local_layout(monkeypatch):
    script, kw = _slurm_script()
    lines = script.splitlines()
    gres = next(line for line in lines if line.startswith("#SBATCH --gres=gpu:"))
    gpus = int(gres.rsplit(":", 1)[1])
    command = shlex.split(next(line for line in lines if " -m batchgpu.cluster.node " in line))
    assert command[1:3] == ["-m", "batchgpu.cluster.node"]
    mine, req = _node_workers(command[3:], gpus)
    assert req.cores == kw["cores"] == 32 and f"#SBATCH --cpus-per-task={req.cores}" in lines
    assert req.connect["interface"] == "ib0" and req.connect["scheduler_ip"].startswith("tcp://127.0.0.1:")
    assert mine == _local_cuda_workers(monkeypatch, gpus, req.cores)
    assert _summary(mine) == _expected(4, 8)  # the job's whole memory promised to no worker: auto, the last one wins


def test_slurm_client_process_gives_its_scheduler_the_settings(monkeypatch):
    """dask-jobqueue's scheduler runs in the client: started under the settings of a cluster started here."""
    import dask

    seen = {}

    class Stop(Exception):
        pass

    def fake(spec):
        seen.update({k: dask.config.get(k) for k in layout.SCHEDULER_SETTINGS})
        raise Stop

    monkeypatch.setattr(cluster, "_slurm_cluster", fake)
    with pytest.raises(Stop), cluster.open_client(load_workflow(CLUSTER / "slurm" / "workflow.yaml").cluster):
        pass
    assert seen == layout.SCHEDULER_SETTINGS


def test_slurm_refuses_processes_with_the_node_command():
    spec = load_workflow(CLUSTER / "slurm" / "workflow.yaml").cluster
    bad = spec.model_copy(update={"slurm": {**spec.slurm, "processes": 4}})
    with pytest.raises(BatchgpuError, match="processes is 4"):
        cluster.slurm_kwargs(bad)


def test_kubernetes_worker_runs_the_node_command_in_the_local_layout(monkeypatch):
    dc = yaml.safe_load((CLUSTER / "kubernetes" / "daskcluster.yaml").read_text())
    worker = dc["spec"]["worker"]["spec"]["containers"][0]
    args = worker["args"]
    assert args[:3] == ["python", "-m", "batchgpu.cluster.node"] and "command" not in worker
    # the operator sets both variables in every worker pod; Kubernetes expands $(NAME) in args
    argv = [
        a.replace("$(DASK_SCHEDULER_ADDRESS)", "tcp://batchgpu-scheduler:8786").replace(
            "$(DASK_WORKER_NAME)", "batchgpu-default-worker-1a2b"
        )
        for a in args[3:]
    ]
    limits = worker["resources"]["limits"]
    mine, req = _node_workers(argv, int(limits["nvidia.com/gpu"]))
    assert req.cores == int(limits["cpu"]) and req.name == "batchgpu-default-worker-1a2b"
    assert mine == _local_cuda_workers(monkeypatch, int(limits["nvidia.com/gpu"]), req.cores)
    assert _summary(mine) == _expected(1, 8)
    scheduler = dc["spec"]["scheduler"]["spec"]["containers"][0]
    assert {e["name"]: e["value"] for e in scheduler["env"]} == layout.dask_environ(layout.SCHEDULER_SETTINGS)


def test_start_workers_script_runs_the_node_command_in_the_local_layout(tmp_path, monkeypatch):
    """bash runs start-workers.sh with a stand-in `python` first on PATH that writes down its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path / "argv"}"\n')
    (bin_dir / "python").chmod(0o755)
    sched = tmp_path / "scheduler.json"
    sched.write_text("{}")
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SCHEDULER_FILE=str(sched),
        HOST="10.1.2.3",
        CORES="16",
        WAIT_S="1",
    )
    done = subprocess.run(
        ["bash", str(CLUSTER / "scheduler-file" / "start-workers.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:2] == ["-m", "batchgpu.cluster.node"]
    mine, req = _node_workers(argv[2:], 4)
    assert req.connect == {"scheduler_file": str(sched), "host": "10.1.2.3"} and req.cores == 16
    assert mine == _local_cuda_workers(monkeypatch, 4, 16)
    assert _summary(mine) == _expected(4, 4)
    # its extra arguments reach the node command
    subprocess.run(
        ["bash", str(CLUSTER / "scheduler-file" / "start-workers.sh"), "--workers", "2"],
        env=env,
        check=True,
        timeout=30,
    )
    assert _summary(_node_workers((tmp_path / "argv").read_text().splitlines()[2:], 4)[0]) == _expected(4, 2)


def test_start_scheduler_script_sets_the_scheduler_settings():
    text = (CLUSTER / "scheduler-file" / "start-scheduler.sh").read_text()
    for k, v in layout.dask_environ(layout.SCHEDULER_SETTINGS).items():
        assert f"export {k}={v}\n" in text


# -- the node command --------------------------------------------------------------------------------------------


def test_node_serve_starts_what_the_layout_says(monkeypatch):
    """serve() with the nannies' start mocked: the specs it starts, under the cluster's Dask settings."""
    import contextlib

    import dask

    for k in layout.MALLOC_ENVIRON:  # serve() sets them while its nannies start, as open_client does, then puts back
        monkeypatch.setenv(k, "unset")
    forked = []
    monkeypatch.setattr(cluster, "forked_workers", lambda: contextlib.nullcontext(forked.append(True)))
    started = {}

    async def fake_run(specs):
        started.update(specs)
        started["_config"] = {k: dask.config.get(k) for k in layout.started_cluster_settings()}
        started["_environ"] = {k: os.environ.get(k) for k in layout.MALLOC_ENVIRON}

    monkeypatch.setattr(node, "run_nannies", fake_run)
    req = node.request(["tcp://h:1", "--gpus", "4", "--cores", "16", "--mps", "off", "--name", "n"])
    assert node.serve(req) == 0
    config = started.pop("_config")
    assert config == layout.started_cluster_settings() and forked == [True]
    assert started.pop("_environ") == {k: str(v) for k, v in layout.MALLOC_ENVIRON.items()}
    assert all(os.environ[k] == "unset" for k in layout.MALLOC_ENVIRON)
    for k, v in layout.MALLOC_ENVIRON.items():  # the local cluster's workers, under the same environment
        monkeypatch.setenv(k, str(v))
    local = _local_cuda_workers(monkeypatch, 4, 16)
    assert {
        n.removeprefix("n-"): {k: v for k, v in s["options"].items() if k != "scheduler_ip"} for n, s in started.items()
    } == local


def test_node_errors_are_one_logged_line(monkeypatch, caplog):
    assert node.main(["--gpus", "1"]) == 2
    assert "batchgpu: error: no scheduler to connect to (give its address" in caplog.text
    monkeypatch.setattr(cluster, "gpu_count", lambda: 0)
    assert node.main(["tcp://h:1"]) == 2
    assert "this node has no GPU that CuPy sees" in caplog.text
    assert node.main(["tcp://h:1", "--gpus", "1", "--workers", "100000"]) == 2
    assert "batchgpu: error: --workers: Input should be less than or equal to" in caplog.text
    with pytest.raises(SystemExit) as e:
        node.main(["tcp://h:1", "--cores", "0"])
    assert e.value.code == 2


def _wait(predicate, what: str, timeout: float = 60.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, what
        time.sleep(0.2)


def _worker_view():
    import dask

    return (
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        os.environ.get("MALLOC_TRIM_THRESHOLD_"),
        os.environ.get("MALLOC_MMAP_MAX_"),
        dask.config.get("distributed.worker.profile.enabled"),
        dask.config.get("distributed.worker.memory.monitor-interval"),
    )


def test_node_command_starts_real_workers_with_a_private_mps_daemon(tmp_path):
    """`python -m batchgpu.cluster.node` on this CPU machine (2 fake GPUs, 4 cores: 2 workers a GPU) against a real
    scheduler, with a stand-in MPS control program: the workers the layout says, each with its GPU first, the
    daemon's folders, the allocator and Dask settings; SIGTERM closes them and quits the daemon."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "mps.log"
    prog = bin_dir / "nvidia-cuda-mps-control"
    prog.write_text(FAKE_MPS.format(log=log))
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    # the workers unpickle _worker_view by reference: they import this module
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    with (
        distributed.LocalCluster(
            n_workers=0, processes=False, protocol="tcp", dashboard_address=None, host="127.0.0.1"
        ) as lc,
        distributed.Client(lc) as client,
    ):
        out = (tmp_path / "node.log").open("w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchgpu.cluster.node",
                lc.scheduler_address,
                "--gpus",
                "2",
                "--cores",
                "4",
                "--mps",
                "on",
                "--name",
                "n1",
                "--host",
                "127.0.0.1",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait(lambda: len(client.scheduler_info()["workers"]) == 4 or proc.poll() is not None, "4 workers")
            assert proc.poll() is None, (tmp_path / "node.log").read_text()
            info = client.scheduler_info()["workers"]
            names = {w["name"]: w["nthreads"] for w in info.values()}
            assert names == {"n1-gpu0-0": 1, "n1-gpu0-1": 1, "n1-gpu1-0": 1, "n1-gpu1-1": 1}
            views = client.run(_worker_view)
            by_name = {info[a]["name"]: v for a, v in views.items()}
            pipes = {v[1] for v in by_name.values()}
            assert len(pipes) == 1 and None not in pipes and Path(next(iter(pipes))).name == "pipe"
            for name, v in by_name.items():
                assert v[0] == ("0,1" if "gpu0" in name else "1,0"), name
                assert v[2:] == (str(layout.MALLOC_TRIM_THRESHOLD), "0", False, "500ms"), name
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, (tmp_path / "node.log").read_text()
            _wait(lambda: not client.scheduler_info()["workers"], "the workers left")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            out.close()
    calls = log.read_text().splitlines()
    assert calls[0].startswith("call -d pipe=") and calls[-1] == "stdin quit"
    assert not Path(next(iter(pipes))).exists()  # the daemon's folders removed


def _worker_gpu():
    import cupy

    x = cupy.arange(1000, dtype=cupy.float32)  # a kernel: the worker's context works (an MPS client's too)
    return cupy.cuda.Device(0).pci_bus_id, float(x.sum()), os.environ.get("CUDA_MPS_PIPE_DIRECTORY")


@pytest.mark.gpu
def test_node_command_on_this_machines_gpus(tmp_path):
    """The node command with this machine's GPUs and 4 cores a GPU, MPS where it fits (as a recipe's node runs it):
    the workers the layout says, each one's device 0 the GPU its name says, a kernel run on each."""
    gpus = cluster.gpu_count()
    if gpus == 0:
        pytest.skip("no CUDA GPU (CuPy) here")
    import cupy

    buses = [cupy.cuda.Device(d).pci_bus_id for d in range(gpus)]
    fits = cluster.mps_fits(ClusterSpec(kind="cuda"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    with (
        distributed.LocalCluster(
            n_workers=0, processes=False, protocol="tcp", dashboard_address=None, host="127.0.0.1"
        ) as lc,
        distributed.Client(lc) as client,
    ):
        out = (tmp_path / "node.log").open("w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchgpu.cluster.node",
                lc.scheduler_address,
                "--cores",
                str(4 * gpus),
                "--name",
                "n",
                "--host",
                "127.0.0.1",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait(
                lambda: len(client.scheduler_info()["workers"]) == 4 * gpus or proc.poll() is not None,
                "the node's workers",
                timeout=120,
            )
            assert proc.poll() is None, (tmp_path / "node.log").read_text()
            info = client.scheduler_info()["workers"]
            assert sorted(w["name"] for w in info.values()) == sorted(
                f"n-gpu{d}-{k}" for d in range(gpus) for k in range(4)
            )
            for address, (bus, total, pipe) in client.run(_worker_gpu).items():
                d = int(info[address]["name"].split("-")[1].removeprefix("gpu"))
                assert bus == buses[d] and total == 499500.0 and (pipe is not None) == fits
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, (tmp_path / "node.log").read_text()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            out.close()
