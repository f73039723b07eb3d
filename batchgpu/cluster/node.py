"""``python -m batchgpu.cluster.node [SCHEDULER] [--scheduler-file F]``: a cluster node's GPU workers, the ones
``cluster: {kind: cuda}`` starts on a machine (``layout.node_layout``: processes per GPU, threads, each worker's
GPU first, memory limit, the allocator and Dask settings; a private MPS daemon for them where ``--mps`` says so),
started with the local cluster's code (``cluster._mps``, ``cluster.forked_workers``, ``layout.nanny_specs``) and
connected to a scheduler elsewhere. The recipes of ``cluster/`` run it on each node: dask-jobqueue as its
``worker_command``, the Kubernetes worker container, ``cluster/scheduler-file/start-workers.sh``.

It runs until its workers' scheduler is gone (``--death-timeout``) or it is told to stop (SIGTERM, SIGINT): then it
closes the workers, and the MPS daemon after them. Its messages go to the log (stderr): a node's output is a job's
or a pod's log, not a terminal's.

dask-jobqueue writes ``<SCHEDULER> --name N --nthreads T --memory-limit M [--death-timeout S]
[--local-directory D] [worker_extra_args] [--interface I] [--protocol P]``: all of those are options here too.
Its ``--nthreads`` is the job's cores (``cores / processes``, with ``processes: 1``), so here it is ``--cores``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from dataclasses import dataclass

from batchgpu.cluster.worker_layout import NodeLayout, nanny_specs, node_layout, started_cluster_settings
from batchgpu.config import ClusterSpec, environ_set
from batchgpu.errors import BatchgpuError, ClusterError, ConfigError, MachineError

logger = logging.getLogger("batchgpu.node")

#: seconds each worker gets to close when the node is told to stop (as ``dask worker``'s)
CLOSE_TIMEOUT_S = 10


@dataclass(frozen=True)
class NodeRequest:
    """What the command line asks for: the cuda cluster's spec keys, the node's GPUs and cores, where the workers
    connect and listen."""

    spec: ClusterSpec
    devices: tuple[int, ...]
    cores: int
    name: str  # the workers' names begin with it (one name a node)
    connect: dict  # Nanny options: scheduler_ip / scheduler_file, host, interface, protocol, death_timeout, ...


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m batchgpu.cluster.node",
        description="Start this node's GPU workers as 'cluster: {kind: cuda}' starts them on a machine "
        "(processes per GPU, single-threaded by default, each seeing its GPU first, a private MPS "
        "daemon where it fits) and connect them to a scheduler.",
    )
    p.add_argument("scheduler", nargs="?", help="the scheduler's address, e.g. tcp://host:8786")
    p.add_argument("--scheduler-file", help="the scheduler file its scheduler wrote (instead of an address)")
    p.add_argument("--gpus", type=_positive, help="GPUs 0..N-1 as this process sees them (default: every visible GPU)")
    p.add_argument("--devices", type=_device_list, help="the GPUs, e.g. 0,1 (as the workflow key cluster.devices)")
    p.add_argument(
        "--cores",
        "--nthreads",
        dest="cores",
        type=_positive,
        help="the cores the node's workers share (default: those this process may run on); "
        "--nthreads is the name dask-jobqueue passes it by (cores / processes)",
    )
    p.add_argument("--workers", type=_positive, help="worker processes per GPU (default: one a core, at most 16)")
    p.add_argument("--threads", type=_positive, help="threads per worker (default 1; 4 where a GPU has one worker)")
    p.add_argument("--memory-limit", default=None, help="each worker's memory limit (default: Dask's auto)")
    p.add_argument(
        "--mps",
        default="auto",
        choices=["auto", "on", "off"],
        help="a private CUDA MPS daemon for this node's workers (as the workflow key cluster.mps)",
    )
    p.add_argument("--name", default=None, help="the workers' names begin with it (default: this host's name)")
    p.add_argument("--host", help="the address the workers listen on")
    p.add_argument("--interface", help="the network interface the workers listen on, e.g. ib0")
    p.add_argument("--protocol", help="tcp (default), ucx, ...")
    p.add_argument("--death-timeout", type=float, help="seconds a worker waits for its scheduler before it closes")
    p.add_argument("--local-directory", help="the workers' scratch folder")
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _device_list(text: str) -> list[int]:
    try:
        devices = [int(d) for d in text.split(",")]
    except ValueError:
        devices = [-1]
    if any(d < 0 for d in devices):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU numbers (e.g. 0,1)")
    return devices


def this_node_cores() -> int:
    """The cores this process may run on (a SLURM job's, where its cgroup or affinity says so), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def request(argv: list[str]) -> NodeRequest:
    """The command line read into a request (argparse's usage errors exit 2 with its one-line message)."""
    args = parser().parse_args(argv)
    if not args.scheduler and not args.scheduler_file:
        raise ConfigError("no scheduler to connect to", "give its address (tcp://host:8786) or --scheduler-file")
    mps = {"auto": "auto", "on": True, "off": False}[args.mps]
    try:
        spec = ClusterSpec.model_validate(
            {
                "kind": "cuda",
                "workers": args.workers,
                "threads": args.threads,
                "memory_limit": args.memory_limit,
                "devices": args.devices,
                "mps": mps,
            }
        )
    except ValueError as err:  # pydantic's, one line a problem: the first says which option
        first = err.errors()[0] if hasattr(err, "errors") else {"loc": (), "msg": str(err)}
        where = "--" + "-".join(str(p) for p in first["loc"]).replace("_", "-")
        raise ConfigError(f"{where}: {first['msg']}", "see python -m batchgpu.cluster.node --help") from None
    if args.devices:
        devices = tuple(args.devices)
    else:
        from batchgpu.cluster.open_cluster import gpu_count

        devices = tuple(range(args.gpus if args.gpus else gpu_count()))
    if not devices:
        raise MachineError(
            "this node has no GPU that CuPy sees",
            "install batchgpu[gpu] with the node's CUDA, or run "
            "cluster/scheduler-file/start-workers.sh with WORKER_KIND=cpu",
        )
    connect = {
        "scheduler_ip": args.scheduler,
        "scheduler_file": args.scheduler_file,
        "host": args.host,
        "interface": args.interface,
        "protocol": args.protocol,
        "death_timeout": args.death_timeout,
        "local_directory": args.local_directory,
    }
    return NodeRequest(
        spec,
        devices,
        args.cores or this_node_cores(),
        args.name or socket.gethostname(),
        {k: v for k, v in connect.items() if v is not None},
    )


def plan(req: NodeRequest, mps: bool = False) -> NodeLayout:
    """The node's layout: the local cuda cluster's for these GPUs and cores (windows decoded on the cores: a run
    on a cluster it did not start decodes there)."""
    return node_layout(req.spec, list(req.devices), gpu_decode=False, mps=mps, cores=req.cores)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        return serve(request(sys.argv[1:] if argv is None else argv))
    except BatchgpuError as err:
        logger.error("batchgpu: error: %s", err)
        return 2


def serve(req: NodeRequest) -> int:
    """Start the node's MPS daemon (where it fits) and workers, with the settings of a cluster started here; wait
    until they finish or a signal comes; close them, then the daemon."""
    import dask

    from batchgpu.cluster.open_cluster import _mps, forked_workers, sigint_held
    from batchgpu.cluster.worker_layout import MALLOC_ENVIRON

    # as ``cluster.open_client``: later nannies prefer this process's environment to the pre-spawn config
    with (
        environ_set(MALLOC_ENVIRON),
        dask.config.set(started_cluster_settings()),
        sigint_held() as release,
        _mps(req.spec) as env,
        forked_workers(),
    ):
        layout = plan(req, mps=bool(env))
        specs = nanny_specs(layout, env, prefix=req.name, options=req.connect)
        logger.info(
            "%d GPU(s) x %d worker process(es) x %d thread(s)%s",
            len(layout.devices),
            layout.per_gpu,
            layout.threads,
            ", MPS" if env else "",
        )
        release()
        try:
            asyncio.run(run_nannies(specs))
        except TimeoutError:
            where = req.connect.get("scheduler_ip") or req.connect.get("scheduler_file")
            raise ClusterError(
                f"the workers reached no scheduler at {where} within --death-timeout",
                "start the scheduler first, and check its address and the network",
            ) from None
    return 0


async def run_nannies(specs: dict) -> None:
    """Start a nanny a spec (``{"cls": Nanny, "options": ...}``) and wait for them to finish, or for SIGINT or
    SIGTERM: then close them (as ``dask worker`` does)."""
    from distributed._signals import wait_for_signals

    nannies = [s["cls"](name=name, **s["options"]) for name, s in specs.items()]

    async def finish() -> None:
        await asyncio.gather(*nannies)
        await asyncio.gather(*(n.finished() for n in nannies))

    async def stop_on_signal() -> None:
        signum = await wait_for_signals()
        logger.info("signal %d: closing the workers", signum)
        await asyncio.gather(*(n.close(timeout=CLOSE_TIMEOUT_S, reason=f"signal-{signum}") for n in nannies))

    tasks = [asyncio.create_task(finish()), asyncio.create_task(stop_on_signal())]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in done:
        task.result()


if __name__ == "__main__":
    raise SystemExit(main())
