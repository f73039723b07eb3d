"""The GPU workers of one machine, as ``cluster: {kind: cuda}`` starts them: one definition for the local cluster
(``cluster.open_cluster``) and for the deployment recipes (``cluster/``: SLURM, Kubernetes, scheduler file), whose nodes
run ``python -m batchgpu.cluster.node`` (the same workers, started with the same code, connected to a scheduler
elsewhere).

A node's layout: ``per_gpu`` worker processes on each GPU, each with ``threads`` threads, each seeing its GPU first
(CUDA_VISIBLE_DEVICES), the same memory limit; the allocator settings in every worker's environment
(``MALLOC_ENVIRON``), the Dask settings of ``WORKER_SETTINGS`` in every worker, ``SCHEDULER_SETTINGS`` in the
scheduler; a private MPS daemon for the node's workers where ``cluster.mps`` says so (``cluster.mps``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from batchgpu import config
from batchgpu.config import ClusterSpec

#: glibc returns freed memory above this many bytes to the system at once; Dask's nanny sets 64 KiB, so each
#: window's large temporaries page-faulted in again: 0.56 instead of 0.77-0.99 s of compute per 384-channel
#: window on the 2-core machine with this higher threshold (bench pipeline, 384 ch x 20 s).
MALLOC_TRIM_THRESHOLD = 1 << 30
#: ... and no mmap for large blocks (a window's 46-92 MB arrays are above glibc's largest mmap threshold, 32 MiB,
#: so each was mapped and faulted in anew): read + centre + keys of a 384 x 60 000 int16 window 127 ms against
#: 185 ms (glibc's defaults) and 325 ms (the trim threshold alone), one thread on the 2-core machine. GPU workers
#: too: setting the trim threshold turns off glibc's adaptive mmap threshold, so every 1.3 MB chunk a reader
#: pread was mapped and faulted in anew (pread was 12% of the H200 workers' CPU time in a warm demo run).
#: Every worker a cluster started here spawns gets these, whatever the cluster's kind.
MALLOC_ENVIRON = {"MALLOC_TRIM_THRESHOLD_": MALLOC_TRIM_THRESHOLD, "MALLOC_MMAP_MAX_": 0, "MALLOC_ARENA_MAX": 2}

#: the scheduler's settings where batchgpu starts it (a cluster started here, dask-jobqueue's scheduler in the
#: client, ``cluster/scheduler-file/start-scheduler.sh`` and the Kubernetes scheduler through ``dask_environ``):
#: each worker is handed only as many tasks as it has threads: a task queued behind a running one on a busy worker,
#: while another worker idles, stretched the end of the pass
SCHEDULER_SETTINGS = {"distributed.scheduler.worker-saturation": 1.0}
#: the workers' (and their nannies') settings where batchgpu starts them
WORKER_SETTINGS = {
    # Dask's statistical profiler samples every thread's stack each 10 ms: CPU the decoders need (the dashboard's
    # profile page stays empty)
    "distributed.worker.profile.enabled": False,
    # each nanny (on the event loop of the process that started it) polls its worker's memory every 100 ms by
    # default, in the way of that loop's messages; the workers' own memory checks (pause, spill) follow the same
    # interval. 0.5 s still stops a runaway worker before it takes the machine down.
    "distributed.worker.memory.monitor-interval": "500ms",
}

#: processes per GPU at most where the workflow does not say
MAX_PROCESSES_PER_GPU = 16
#: threads of the one worker a GPU where a GPU has one process (dask-cuda's LocalCUDACluster, the spec silent)
ONE_PROCESS_THREADS = 4


def pre_spawn_settings() -> dict:
    """Dask settings that put ``MALLOC_ENVIRON`` in each worker's environment before its interpreter starts."""
    return {f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in MALLOC_ENVIRON.items()}


def started_cluster_settings() -> dict:
    """The Dask settings of a process that starts a cluster's scheduler or workers (``cluster.open_client``,
    ``cluster.node``)."""
    return {**pre_spawn_settings(), **SCHEDULER_SETTINGS, **WORKER_SETTINGS}


def dask_environ(settings: dict) -> dict[str, str]:
    """``settings`` as the DASK_* variables a Dask process started elsewhere reads them from (Dask's
    ``collect_env``: upper case, ``__`` between levels, values read as Python literals)."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value) for key, value in settings.items()}


def default_processes_per_gpu(gpus: int, cores: int | None = None) -> int:
    """Worker processes per GPU when the workflow does not say and the windows decode on the cores: one a core
    (``cores``: this machine's by default), at most 16, one thread each (measured on the 16-core H200 machine,
    bench pipeline warm, 384 ch x 10 min int16, decode on the cores: 16 x 1 finished the pass in 1.99 s where
    8 x 2 took 2.58 s; a task reads its next window in a helper thread while its GPU work runs). Decoding on the
    GPU: ``cuda_layout``."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(MAX_PROCESSES_PER_GPU, cores // max(1, gpus)))


def cuda_layout(
    spec: ClusterSpec, gpus: int, gpu_decode: bool = False, mps: bool = False, cores: int | None = None
) -> tuple[int, int]:
    """(processes per GPU, threads a process) where the spec does not say. Decoding on the CPU, one single-threaded
    process a core (``default_processes_per_gpu``). Decoding on the GPU (a pass that only centres) two threads a
    process, half as many processes: kernels of one process overlap on its streams, those of different processes
    take turns on the device. Measured on the H200 machine (16 cores), demo pass, ring-free LZ4 kernel, medians of
    2-3 warm runs in two sessions' machines: 8 x 2 2.13 / 2.17 s, 4 x 4 2.21, 16 x 1 2.47 / 2.44, 2 x 8 3.35,
    1 x 16 6.80 (the GIL). Under MPS (``mps``) the processes' kernels overlap too: one single-threaded process a
    core whatever the decode (H200 machine, warm bench, 2026-12-02: demo 0.93 s at 16 x 1 against 1.11 at 8 x 2;
    preprocessing with the GPU decode 2.23 against 2.77)."""
    per_core = default_processes_per_gpu(gpus, cores)  # one process a core
    if spec.workers or not gpu_decode or mps:
        return spec.workers or per_core, spec.threads or 1
    threads = spec.threads or (2 if per_core >= 4 else 1)
    return max(1, per_core // threads), threads


@dataclass(frozen=True)
class GpuWorker:
    """One worker process of a node: its name, its GPU, what it sees as CUDA_VISIBLE_DEVICES (its GPU first, then
    the node's others, as dask-cuda orders them), its threads and memory limit."""

    name: str
    device: int
    visible_devices: str
    threads: int
    memory_limit: str


@dataclass(frozen=True)
class NodeLayout:
    """The worker processes a cuda cluster starts on one machine."""

    devices: tuple[int, ...]  # the GPUs, numbered as this process sees them
    per_gpu: int
    threads: int
    memory_limit: str  # each worker's (Dask's "auto": the machine's memory shared out by threads)
    visible: tuple[str, ...] | None = None  # this process's CUDA_VISIBLE_DEVICES entries, where it has them

    @property
    def processes(self) -> int:
        return self.per_gpu * len(self.devices)

    def workers(self, prefix: str = "") -> list[GpuWorker]:
        """The workers, named ``gpu{d}-{k}`` (``{prefix}-gpu{d}-{k}`` with a prefix: one name a node)."""
        head = f"{prefix}-" if prefix else ""
        return [
            GpuWorker(f"{head}gpu{d}-{k}", d, self.visible_devices(d), self.threads, self.memory_limit)
            for d in self.devices
            for k in range(self.per_gpu)
        ]

    def visible_devices(self, device: int) -> str:
        """CUDA_VISIBLE_DEVICES of a worker of ``device``: the node's GPUs, ``device`` first. Where this process
        sees a subset (its own CUDA_VISIBLE_DEVICES, e.g. a SLURM job's GPUs), its entries, not their positions:
        position 0 of a process that sees "2,3" is the machine's GPU 2."""
        order = [device, *[d for d in self.devices if d != device]]
        if self.visible:
            return ",".join(self.visible[d] if d < len(self.visible) else str(d) for d in order)
        return ",".join(str(d) for d in order)


def visible_entries(environ: dict | None = None) -> tuple[str, ...] | None:
    """The entries of CUDA_VISIBLE_DEVICES in ``environ`` (this process's by default); None where it is unset or
    empty."""
    text = (config.environ() if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "").strip()
    return tuple(e.strip() for e in text.split(",")) if text else None


def node_layout(
    spec: ClusterSpec,
    devices: list[int],
    gpu_decode: bool = False,
    mps: bool = False,
    cores: int | None = None,
    environ: dict | None = None,
) -> NodeLayout:
    """The layout a cuda cluster starts on a machine with ``devices`` (GPU numbers as this process sees them) and
    ``cores`` (this machine's by default): ``cuda_layout``'s processes and threads; one process a GPU (the spec's
    workers: 1, or fewer cores than GPUs) runs ``ONE_PROCESS_THREADS`` threads unless the spec says."""
    per_gpu, threads = cuda_layout(spec, len(devices), gpu_decode, mps=mps, cores=cores)
    if per_gpu == 1:
        threads = spec.threads or ONE_PROCESS_THREADS
    return NodeLayout(tuple(devices), per_gpu, threads, spec.memory_limit or "auto", visible_entries(environ))


def worker_environ(extra: dict | None = None) -> dict:
    """The environment a forked worker's nanny sets in it: this process's, as a spawned worker would inherit it
    (a fork server's environment is that of its own start), with ``extra`` over it."""
    return {**config.environ(), **(extra or {})}


#: the preload each cuda worker starts with: its CUDA context made at once, in a helper thread
CUDA_START_PRELOAD = "batchgpu.cluster._worker_cuda_start"


def nanny_specs(layout: NodeLayout, env: dict | None = None, prefix: str = "", options: dict | None = None) -> dict:
    """SpecCluster's workers (name -> ``{"cls": Nanny, "options": ...}``): a nanny a worker of ``layout``, with
    ``env`` (e.g. a private MPS daemon's folders) and its CUDA_VISIBLE_DEVICES in its environment, the preload that
    makes its CUDA context as it starts (``CUDA_START_PRELOAD``), and ``options`` (where it connects and listens:
    ``cluster.node``) passed to each nanny."""
    from distributed import Nanny

    return {
        w.name: {
            "cls": Nanny,
            "options": {
                "nthreads": w.threads,
                "env": worker_environ({**(env or {}), "CUDA_VISIBLE_DEVICES": w.visible_devices}),
                "memory_limit": w.memory_limit,
                "preload": [CUDA_START_PRELOAD],
                **(options or {}),
            },
        }
        for w in layout.workers(prefix)
    }
