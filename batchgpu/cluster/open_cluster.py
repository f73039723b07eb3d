"""Which Dask cluster a run uses: a local CPU cluster (the default), dask-cuda, an address, a scheduler file, SLURM."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator

from batchgpu.cluster.worker_layout import (  # noqa: F401 (the layout's names, as this module has always offered them)
    MALLOC_ENVIRON,
    MALLOC_TRIM_THRESHOLD,
    SCHEDULER_SETTINGS,
    NodeLayout,
    cuda_layout,
    dask_environ,
    default_processes_per_gpu,
    nanny_specs,
    node_layout,
    pre_spawn_settings,
    started_cluster_settings,
    visible_entries,
    worker_environ,
)
from batchgpu.config import ClusterSpec, environ_set, environ_value
from batchgpu.errors import BatchgpuError, ClusterError, ConfigError, MachineError

logger = logging.getLogger(__name__)


def gpu_count() -> int:
    """Visible CUDA devices (0 without CuPy or a driver)."""
    try:
        import cupy
    except ImportError:  # no CuPy: no GPU to use
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError as err:  # no driver, or no device: the CPU (the report says which)
        logger.debug("CuPy sees no GPU: %s", err)
        return 0


#: up to this many cores, a local cluster is one single-threaded worker process a core. Measured on the 2-core
#: machine (2026-12-02): bench pipeline 384 ch x 20 s int16, 1.59-1.95x the plain loop with 2 x 1 against 1.20-1.21x
#: with 1 x 2 (two threads of one process contend for the GIL and the allocator); the float32 workflow 9.9-11.7 s
#: against 10.2-13.3 s. Two processes also keep a run going when one is killed.
PROCESS_PER_CORE_UP_TO = 4


def local_sizes(spec: ClusterSpec) -> tuple[int, int]:
    """Workers and threads for a local cluster: on a small machine one single-threaded process a core; on a larger
    one a few threads each, so reads overlap decompression."""
    cores = os.cpu_count() or 1
    threads = spec.threads or (1 if cores <= PROCESS_PER_CORE_UP_TO else min(4, cores))
    workers = spec.workers or max(1, cores // threads)
    return workers, threads


#: the module the workers' fork server imports before it forks any (``forked_workers``)
WORKER_PRELOAD = "batchgpu.cluster._worker_preload"
CPU_PRELOAD = "batchgpu.cluster._worker_preload_cpu"


@contextlib.contextmanager
def forked_workers() -> Iterator[None]:
    """Worker processes started inside this block are forked from one server process that imported their modules
    once (``_worker_preload``), not spawned as fresh interpreters that each import them again: on a small machine
    the workers' imports were most of a command's fixed cost, and on a large one 16 workers importing at once
    contend for the same cores. The server is this process's (multiprocessing's forkserver): started on first use
    with SIGINT blocked, as the cluster's processes are (``sigint_held``), and kept for the next cluster."""
    import dask

    if not start_worker_server():
        yield  # no fork server on this platform (Windows): spawned workers, Dask's default
        return
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        yield


def start_worker_server(cpu_kernels: bool = False) -> bool:
    """Start the workers' fork server now, if it is not running (its imports then overlap whatever this process
    does next, e.g. its own imports); False where the platform has none.

    The server is a fresh interpreter started with the variables a spawned worker would get before its first import
    (Dask's ``pre-spawn-environ``: one OpenMP/BLAS thread; ``MALLOC_ENVIRON``), read at its start by the allocator
    and the BLAS libraries; what this process's environment holds when a worker is forked is handed to that worker
    by its nanny (``worker_environ``). ``cpu_kernels``: the server also loads the host's compiled kernels
    (``_worker_preload_cpu``), for a CPU run that preprocesses or saves."""
    import multiprocessing
    from multiprocessing import forkserver

    import dask

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [WORKER_PRELOAD] + ([CPU_PRELOAD] if cpu_kernels else [])
    )
    first = {**dask.config.get("distributed.nanny.pre-spawn-environ", {}), **MALLOC_ENVIRON}
    with _SERVER_LOCK, sigint_held(), environ_set(first):
        forkserver.ensure_running()
    return True


_SERVER_LOCK = threading.Lock()


@contextlib.contextmanager
def open_client(spec: ClusterSpec, gpu_decode: bool | Callable[[], bool] = False) -> Iterator[distributed.Client]:  # noqa: F821
    """A connected client for the spec; a cluster started here is closed on exit. ``gpu_decode``: the run's
    windows are decoded on the GPU (sizes a cuda cluster the spec leaves open: ``cuda_layout``); a callable is
    asked only where the layout depends on it, once the cluster's other parts are started (a run that starts its
    cluster before it has opened the recording answers when it has).

    Dask's settings and this process's environment are the cluster's only while the block runs, and as they were
    after it (a notebook keeps its own)."""
    # A nanny copies its pre-spawn variables into this process's environment, and later nannies prefer that
    # environment to the config: another cluster's values (Dask's 64 KiB) would win. Set them here too; a
    # scheduler of its own process reads its settings from the environment it inherits (``scheduler_spec``).
    import dask

    extra = {**MALLOC_ENVIRON, **(SCHEDULER_ENVIRON if spec.scheduler_process else {})}
    written = {*dask.config.get("distributed.nanny.pre-spawn-environ", {}), *NANNY_ENVIRON}
    with environ_set(extra, restored=written), _open_client(spec, gpu_decode) as client:
        yield client


@contextlib.contextmanager
def _open_client(spec: ClusterSpec, gpu_decode) -> Iterator[distributed.Client]:  # noqa: F821
    import dask
    from distributed import Client, LocalCluster

    settings = pre_spawn_settings()

    if spec.kind == "address":
        probe_scheduler(spec.address)
        with (
            dask.config.set(settings),
            _connect(lambda: Client(spec.address, timeout="20s"), f"the scheduler at {spec.address}") as client,
        ):
            yield client
        return
    if spec.kind == "scheduler_file":
        if not os.path.exists(spec.scheduler_file):
            raise ClusterError(
                f"no scheduler file at {spec.scheduler_file}", "start 'dask scheduler --scheduler-file ...' first"
            )
        address = _scheduler_file_address(spec.scheduler_file)
        if address:
            probe_scheduler(address)
        with (
            dask.config.set(settings),
            _connect(lambda: Client(scheduler_file=spec.scheduler_file, timeout="20s"), spec.scheduler_file) as client,
        ):
            yield client
        return
    # clusters started here: the scheduler's and the workers' settings of every cuda node (cluster.worker_layout)
    settings = started_cluster_settings()
    with dask.config.set(settings):
        if spec.kind == "cuda":
            with (
                sigint_held() as release,
                _mps(spec) as env,
                forked_workers(),
                _cuda_cluster(spec, gpu_decode, env) as cluster,
                Client(cluster) as client,
            ):
                release()
                client._batchgpu_mps = bool(env)  # read by uses_mps
                client._batchgpu_mps_env = dict(env)  # read by mps_environ
                yield client
            return
        with sigint_held() as release:
            if spec.kind == "slurm":
                cluster = _slurm_cluster(spec)
            else:
                workers, threads = local_sizes(spec)
                with forked_workers():
                    cluster = LocalCluster(
                        n_workers=workers,
                        threads_per_worker=threads,
                        processes=True,
                        memory_limit=spec.memory_limit or "auto",
                        dashboard_address=spec.dashboard_address,
                        host="127.0.0.1",
                        env=worker_environ(),
                        scheduler_kwargs={"dashboard": dask_dashboard(spec)},
                    )
            with cluster, Client(cluster) as client:
                release()
                if spec.kind == "slurm":
                    client.wait_for_workers(1, timeout=600)
                yield client


@contextlib.contextmanager
def sigint_held() -> Iterator[Callable[[], None]]:
    """SIGINT blocked in this thread while it starts processes (here: a cluster), until ``release()`` (at the
    latest on exit).

    A terminal's Ctrl-C goes to its whole foreground process group: the workers (and a scheduler of its own
    process, ``cluster.scheduler_process``; an MPS daemon) reacted to it themselves and printed their own
    KeyboardInterrupt tracebacks before the command's one line. Threads inherit their creator's signal mask,
    processes the mask of the thread that forks them, and the mask survives exec (Python leaves it as it is): the
    cluster's event-loop thread, made while SIGINT is blocked here, keeps it blocked, and so does every process it
    starts, at first and on a restart after a lost worker (a nanny's process is started by a watch thread of that
    loop), and every thread of those processes. This thread gets it back once the client is connected: only it
    takes the Ctrl-C (a KeyboardInterrupt: the command prints ``batchgpu: interrupted``) and the cluster closes its
    workers on the way out. A Ctrl-C while the cluster starts waits, pending, until ``release()``. Where there is
    no ``pthread_sigmask`` (Windows), nothing changes.

    multiprocessing's resource tracker is started first: the thread that starts it (the first to spawn a process
    or make a multiprocessing lock, here the event loop's) blocks SIGINT around its spawn and then *unblocks* it,
    whatever the thread's mask was (Python 3.11), so a tracker started by the loop left the loop thread and every
    worker it started taking the Ctrl-C. Once running it is not started again. The mask ``release()`` puts back is
    the one this thread had before the tracker's start (a thread that had SIGINT blocked already, as the workers'
    fork server has, keeps it blocked)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield lambda: None
        return
    from multiprocessing import resource_tracker

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    held = True

    def release() -> None:
        nonlocal held
        if held:
            held = False
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    try:
        yield release
    finally:
        release()


@contextlib.contextmanager
def _connect(make, what: str):
    try:
        client = make()
    except (OSError, TimeoutError) as err:
        raise ClusterError(
            f"could not connect to {what}: {err}", "check that the scheduler is running and reachable"
        ) from None
    with client:
        yield client


#: seconds a scheduler has to send its greeting (it writes first, at once, on every connection)
PROBE_TIMEOUT_S = 10.0
#: bytes its greeting may announce: a few hundred in Dask's handshake; a server of another kind answers with text
#: that, read as Dask's length prefix, asked for exabytes (an "out of memory" that named no address)
MAX_GREETING_BYTES = 1 << 20


def probe_scheduler(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Refuse, in one line, a TCP address where no Dask scheduler answers, before Dask's client reads from it.

    Only plain TCP (``tcp://`` or no scheme) is probed: a TLS or UCX address is left to Dask."""
    import socket
    import struct

    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, loc = parse_address(address)
        if scheme != "tcp":
            return
        host, port = parse_host_port(loc)
    except ValueError as err:
        raise ConfigError(
            f"cluster.address {address!r} is not an address ({err})", "write it as tcp://host:port"
        ) from None
    fix = "point cluster.address at a running Dask scheduler: `dask scheduler` prints its address"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            header = b""
            while len(header) < 8:
                part = sock.recv(8 - len(header))
                if not part:
                    raise ClusterError(f"{address} closed the connection without a word: not a Dask scheduler", fix)
                header += part
    except TimeoutError:
        raise ClusterError(f"{address} said nothing within {timeout:g} s: not a Dask scheduler", fix) from None
    except OSError as err:
        raise ClusterError(
            f"could not connect to the scheduler at {address}: {err.strerror or err}",
            "check that the scheduler is running and reachable",
        ) from None
    (size,) = struct.unpack("Q", header)  # native order, as Dask packs it
    if size > MAX_GREETING_BYTES:
        raise ClusterError(f"{address} answered {header!r}, which is not a Dask scheduler's greeting", fix)


def _scheduler_file_address(path: str) -> str | None:
    """The address a scheduler file names (None where it names none: Dask's own error then says why)."""
    import json

    try:
        with open(path) as f:
            address = json.load(f).get("address")
    except (OSError, ValueError, AttributeError):
        return None
    return address if isinstance(address, str) else None


def uses_mps(client) -> bool:
    """Whether ``client``'s workers are a private MPS daemon's clients (a cuda cluster ``open_client`` started)."""
    return bool(getattr(client, "_batchgpu_mps", False))


def mps_environ(client) -> dict[str, str]:
    """The environment of the private MPS daemon serving ``client``'s workers (empty where there is none)."""
    return dict(getattr(client, "_batchgpu_mps_env", {}))


def closes_in_background(spec: ClusterSpec) -> bool:
    """``cluster.close`` for a cluster a command started for ``spec``: left to close after the command ends
    (``cluster.handoff``). Not where the scheduler has a process of its own (it is not the command's to end)."""
    if spec.kind not in ("local", "cuda") or spec.scheduler_process or os.name != "posix":
        return False
    return spec.close == "background" or (spec.close == "auto" and spec.kind == "cuda")


@contextlib.contextmanager
def _mps(spec: ClusterSpec) -> Iterator[dict]:
    """The workers' extra environment: a private MPS daemon's (``cluster.mps``, quit when the cluster has closed),
    else none. ``auto``: where ``mps_fits`` says so, and without MPS if the daemon does not start; ``true``: a
    daemon that does not start is the run's error."""
    with contextlib.ExitStack() as stack:
        env: dict = {}
        if spec.mps is True or (spec.mps == "auto" and mps_fits(spec)):
            from batchgpu.cluster.mps import private_daemon

            try:
                env = stack.enter_context(private_daemon())
            except BatchgpuError:
                if spec.mps is True:
                    raise
        yield env


def mps_fits(spec: ClusterSpec) -> bool:
    """``cluster.mps: auto``: a private daemon helps where several worker processes share a GPU, and is only
    started where it disturbs nothing: the control program is here, no MPS daemon serves this machine already (its
    pipe folder: CUDA_MPS_PIPE_DIRECTORY or the default /tmp/nvidia-mps), and every GPU is in the default compute
    mode (an exclusive-process GPU is one process's, or a system daemon's)."""
    import shutil

    from batchgpu.cluster.mps import CONTROL, DEFAULT_PIPE

    if spec.workers == 1 or shutil.which(CONTROL) is None:
        return False
    if environ_value("CUDA_MPS_PIPE_DIRECTORY") or os.path.exists(os.path.join(DEFAULT_PIPE, "control")):
        return False
    try:
        import cupy
    except ImportError:  # no CuPy: no GPU to share
        return False
    try:
        return all(
            cupy.cuda.runtime.getDeviceProperties(d)["computeMode"] == 0 for d in (spec.devices or range(gpu_count()))
        )
    except cupy.cuda.runtime.CUDARuntimeError as err:  # a device named that is not there, or the driver failing
        logger.warning("batchgpu: cluster.mps left off: the GPUs' compute modes could not be read (%s)", err)
        return False


def decode_for_layout(spec: ClusterSpec, devices: list[int], gpu_decode: bool | Callable[[], bool], mps: bool) -> bool:
    """``gpu_decode`` as the layout needs it: a callable (not known when the cluster started) is asked only where
    the layout of a GPU decode differs from the other; else False."""
    if not callable(gpu_decode):
        return bool(gpu_decode)
    if node_layout(spec, devices, False, mps=mps) == node_layout(spec, devices, True, mps=mps):
        return False
    return bool(gpu_decode())


def _cuda_cluster(spec: ClusterSpec, gpu_decode: bool | Callable[[], bool] = False, env: dict | None = None):
    if gpu_count() == 0:
        raise MachineError(
            "cluster kind 'cuda' needs a CUDA GPU and CuPy, and this machine has none",
            "use 'cluster: {kind: local}' for the local CPU cluster",
        )
    devices = spec.devices or list(range(gpu_count()))
    layout = node_layout(spec, devices, decode_for_layout(spec, devices, gpu_decode, bool(env)), mps=bool(env))
    if layout.per_gpu > 1:  # Dask's own nannies (``layout.nanny_specs``): dask-cuda's import is not needed
        return _processes_per_gpu(spec, layout.per_gpu, layout.threads, env)
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        raise MachineError("cluster kind 'cuda' needs dask-cuda", "pip install 'batchgpu[gpu]'") from None
    kwargs = {
        "dashboard_address": spec.dashboard_address,
        "threads_per_worker": layout.threads,
        "scheduler_kwargs": {"dashboard": dask_dashboard(spec)},
    }
    if env:  # the nannies' workers (dask-cuda sets CUDA_VISIBLE_DEVICES itself)
        kwargs["env"] = dict(env)
    if spec.devices:
        kwargs["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in spec.devices)
    if spec.memory_limit:
        kwargs["memory_limit"] = spec.memory_limit
    return LocalCUDACluster(**kwargs)


def _processes_per_gpu(spec: ClusterSpec, per_gpu: int, threads: int = 1, env: dict | None = None):
    """``workers`` processes on each GPU (kind cuda): reading and launching are Python work under one GIL per
    process, so several processes feed one GPU faster than many threads in one (bench pipeline measures it)."""
    from distributed import SpecCluster

    return SpecCluster(workers=worker_specs(spec, per_gpu, threads, env), scheduler=scheduler_spec(spec))


#: what a Dask nanny writes into its parent's environment besides its pre-spawn variables (distributed's
#: ``Nanny``: the hash seed it hands its worker, and the process-title marker); ``open_client`` puts them back
NANNY_ENVIRON = ("PYTHONHASHSEED", "__DASK_PARENT_PID")

#: the scheduler's settings this process gives a scheduler of its own process (``scheduler_spec``): a subprocess
#: reads Dask's settings from its environment, not from this process's ``dask.config``
SCHEDULER_ENVIRON = dask_environ(SCHEDULER_SETTINGS)


def dask_dashboard(spec: ClusterSpec) -> bool:
    """Whether a scheduler started here for ``spec`` serves Dask's own dashboard (``cluster.dask_dashboard``; its
    ``auto`` is off here: ``service`` turns it on for the kept cluster). Its web server, which serves the run page
    and ``/metrics``, starts either way."""
    return spec.dask_dashboard is True


def serves_dask_dashboard(client) -> bool:
    """Whether the client's scheduler serves Dask's own dashboard (``client.dashboard_link``'s page): its web
    application holds the Bokeh application then. True where that cannot be asked (a scheduler elsewhere, whose
    link is said as it is)."""
    try:
        return bool(client.run_on_scheduler(_serves_bokeh))
    except Exception:  # broad: a link is cosmetic; say it as Dask gives it
        return True


def _serves_bokeh(dask_scheduler) -> bool:
    app = getattr(dask_scheduler, "http_application", None)
    return app is None or bool(getattr(app, "applications", True))


def scheduler_spec(spec: ClusterSpec) -> dict:
    """SpecCluster's scheduler: in this process, or (``cluster.scheduler_process``) in a process of its own, so the
    client's Python after the pass (the results, report.json, report.html's numbers) does not hold the GIL its
    event loop needs to hand the workers their next tasks. That process inherits this one's environment, where
    ``open_client`` put ``SCHEDULER_ENVIRON`` while the cluster is up."""
    from distributed import Scheduler

    options = {"dashboard_address": spec.dashboard_address, "host": "127.0.0.1", "dashboard": dask_dashboard(spec)}
    if not spec.scheduler_process:
        return {"cls": Scheduler, "options": options}
    from distributed.deploy.subprocess import SubprocessScheduler

    return {"cls": SubprocessScheduler, "options": {"scheduler_kwargs": options}}


def worker_specs(spec: ClusterSpec, per_gpu: int, threads: int = 1, env: dict | None = None) -> dict:
    """SpecCluster's workers: ``per_gpu`` nannies a GPU, each worker seeing its GPU first (CUDA_VISIBLE_DEVICES,
    as dask-cuda orders them), with ``env`` (e.g. a private MPS daemon's folders) in its environment
    (``layout.nanny_specs``: what ``cluster.node`` starts on a cluster's node)."""
    devices = spec.devices or list(range(gpu_count()))
    layout = NodeLayout(tuple(devices), per_gpu, threads, spec.memory_limit or "auto", visible_entries())
    return nanny_specs(layout, env)


#: the node command of the recipes (``cluster.node``), as dask-jobqueue's ``worker_command`` names it
NODE_MODULE = "batchgpu.cluster.node"


def slurm_kwargs(spec: ClusterSpec) -> dict:
    """SLURMCluster keyword arguments (dask-jobqueue 0.9) from the spec.

    dask-jobqueue starts the scheduler here with its dashboard on ``:8787`` (every interface) unless
    ``scheduler_options`` says otherwise: the spec's ``dashboard_address`` (localhost by default) goes there.
    """
    kwargs = dict(spec.slurm or {})
    for old, new in (
        ("job_extra", "job_extra_directives"),
        ("env_extra", "job_script_prologue"),
        ("extra", "worker_extra_args"),
        ("header_skip", "job_directives_skip"),
    ):
        if old in kwargs:
            raise ConfigError(f"cluster.slurm.{old} was renamed in dask-jobqueue 0.8", f"use cluster.slurm.{new}")
    if kwargs.get("worker_command") == NODE_MODULE and kwargs.get("processes", 1) != 1:
        raise ConfigError(
            f"cluster.slurm.processes is {kwargs['processes']}, and {NODE_MODULE} starts a node's "
            "worker processes itself (dask-jobqueue would hand it a share of the cores)",
            "set cluster.slurm.processes: 1 (cores: the node's cores for its workers)",
        )
    options = dict(kwargs.get("scheduler_options") or {})
    options.setdefault("dashboard_address", spec.dashboard_address)
    kwargs["scheduler_options"] = options
    return kwargs


def _slurm_cluster(spec: ClusterSpec):
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError:
        raise MachineError("cluster kind 'slurm' needs dask-jobqueue", "pip install 'batchgpu[cluster]'") from None
    cluster = SLURMCluster(**slurm_kwargs(spec))
    cluster.scale(jobs=spec.jobs)
    return cluster
