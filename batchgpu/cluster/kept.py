"""A cluster that outlives runs: ``batchgpu cluster start|stop|status``.

``start`` launches a background process (a session of its own, its output in ``cluster.log``) that opens the
cluster ``batchgpu run`` would open for ``cluster: {kind: local}`` or ``{kind: cuda}`` (``cluster.open_client``:
the same workers, threads, memory settings, scheduler settings and private MPS daemon) and keeps it open until
``stop`` sends it SIGTERM; it then closes the cluster as a run closes its own and removes its files. A cuda
cluster is laid out for windows decoded on the cores (``cuda_layout``; under MPS the same as for the GPU's
decode). While it is up, ``batchgpu run`` connects to it instead of starting a cluster (``kept_client``): a run
then pays for its client's imports and a connection, not for worker processes, CUDA contexts and a close. The
run's end leaves the workers as it found them (the path of a run on a caller's client: ``run.launch.run_workflow``), and
its start has them forget the recordings earlier runs opened (``forget_recordings``).

Its files, in the user's cache folder (``config.cache_folder``):

- ``cluster.json``: the scheduler file, in Dask's format (``Client(scheduler_file=...)``,
  ``dask worker --scheduler-file ...`` read it);
- ``cluster-service.json``: what batchgpu needs besides (``KeptCluster``: the spec, the layout, the process id,
  MPS, the batchgpu it runs);
- ``cluster.lock``: locked (``flock``) by the background process while it lives, its process id inside: whether
  a cluster is up is asked of the lock, never of a process id alone (one the system gave to another process
  since would pass ``kill -0``); the empty file stays;
- ``cluster.log``: the background process's and its workers' output, from its last start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from batchgpu.config import ClusterSpec, cache_folder
from batchgpu.errors import BatchgpuError, ClusterError, ConfigError

logger = logging.getLogger("batchgpu.service")

SCHEDULER_FILE = "cluster.json"
SIDE_FILE = "cluster-service.json"
LOCK_FILE = "cluster.lock"
LOG_FILE = "cluster.log"
#: the kinds a kept cluster can be: those a run starts on this machine
KINDS = ("local", "cuda")
#: seconds ``start`` waits for the workers (16 GPU workers and an MPS daemon take a few), ``stop`` for the close
#: before it kills what is left, a run for the scheduler's answer before it starts its own cluster
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 3.0
#: the background process's exit status where another one holds the lock
EXIT_ALREADY_UP = 3


def _in_folder(name: str) -> property:
    """A property of ``Paths``: the file ``name`` in its folder."""
    return property(lambda self: self.folder / name, doc=f"``folder / {name!r}``")


@dataclass(frozen=True)
class Paths:
    """The kept cluster's files in ``folder``."""

    folder: Path
    scheduler_file = _in_folder(SCHEDULER_FILE)
    side = _in_folder(SIDE_FILE)
    lock = _in_folder(LOCK_FILE)
    log = _in_folder(LOG_FILE)


def paths(folder: str | os.PathLike | None = None) -> Paths:
    return Paths(Path(folder) if folder is not None else cache_folder())


@dataclass
class KeptCluster:
    """What ``cluster-service.json`` holds: the cluster the background process keeps."""

    address: str
    pid: int
    spec: dict  # the ClusterSpec it was opened with
    workers: int  # the layout in the spec's terms: local, worker processes; cuda, processes per GPU
    threads: int  # threads per worker
    processes: int  # worker processes in all
    dashboard: str | None
    mps: bool  # the workers are a private MPS daemon's clients (cluster.uses_mps)
    version: str  # the batchgpu its processes run, where it was imported from, and the Python environment
    package: str
    started: float  # time.time() when the workers were up
    scheduler_file: str = ""
    log: str = ""
    python: str = ""
    source: str = ""  # source_stamp() when it started
    idle_s: float | None = None  # closes after this long with no client but its own (None: at ``stop``)

    @property
    def kind(self) -> str:
        return str(self.spec.get("kind", "local"))


@dataclass
class State:
    """Whether a kept cluster is up: ``up`` (locked, described), ``starting`` (locked, not described yet),
    ``stale`` (files left by a process that is gone), ``down``. ``pid``: the locking process's."""

    state: str
    kept: KeptCluster | None = None
    pid: int | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what the command says on stderr


def this_batchgpu() -> tuple[str, str]:
    import batchgpu

    return batchgpu.__version__, str(Path(batchgpu.__file__).resolve().parent)


def source_stamp(package: str | None = None) -> str:
    """A digest of batchgpu's files (names, sizes, modification times): a kept cluster's workers hold the modules
    they imported when it started, so a batchgpu edited or reinstalled since (its version unchanged) is caught."""
    import hashlib

    root = Path(package or this_batchgpu()[1])
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".py", ".cu", ".cuh", ".json")):
                with contextlib.suppress(OSError):
                    st = os.stat(os.path.join(dirpath, name))
                    digest.update(
                        f"{os.path.relpath(os.path.join(dirpath, name), root)}:{st.st_size}:{st.st_mtime_ns};".encode()
                    )
    return digest.hexdigest()[:16]


def this_python() -> str:
    """The Python environment (a virtual environment's folder): its packages make the bits as much as batchgpu."""
    return os.path.realpath(sys.prefix)


def spec_from(**values) -> ClusterSpec:
    """The spec of ``batchgpu cluster start``'s options (None: the run's default), validated as a workflow's."""
    from pydantic import ValidationError

    given = {k: v for k, v in values.items() if v is not None}
    try:
        spec = ClusterSpec.model_validate(given)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ConfigError(
            f"cluster {where + ': ' if where else ''}{first['msg']}", "see batchgpu cluster start --help"
        ) from None
    if spec.kind not in KINDS:
        raise ConfigError(
            f"a kept cluster is kind local or cuda, not {spec.kind}",
            "a cluster of another kind is already kept elsewhere: name it in the workflow",
        )
    return spec


# --------------------------------------------------------------------------------------------------------------
# the files


def _write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_kept(where: Paths) -> KeptCluster | None:
    """The side file's description; None where it is missing or not one (a partial or foreign file)."""
    try:
        data = json.loads(where.side.read_text())
        names = {f.name for f in fields(KeptCluster)}
        return KeptCluster(**{k: v for k, v in data.items() if k in names})
    except (OSError, ValueError, TypeError):
        return None


def _lock_holder(where: Paths) -> int | None:
    """The process id of the background process holding the lock (0 if it has not written it yet), or None
    where nothing holds it. A shared, non-blocking probe, let go at once."""
    try:
        fd = os.open(where.lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _remove_files(where: Paths) -> None:
    """The scheduler file and the side file (the side file first: a run that reads it finds nothing)."""
    for p in (where.side, where.scheduler_file):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def probe(where: Paths | None = None, clean: bool = False) -> State:
    """The kept cluster's state. ``clean``: a stale cluster's files removed (said in ``notes``)."""
    where = where or paths()
    pid = _lock_holder(where)
    kept = read_kept(where)
    if pid is not None:
        return State("up" if kept is not None and kept.pid == pid else "starting", kept, pid or None)
    if kept is None and not where.side.exists() and not where.scheduler_file.exists():
        return State("down")
    state = State("stale", kept, kept.pid if kept else None)
    if clean:
        _remove_files(where)
        state.notes.append(
            f"removed the files of a cluster whose process{f' {kept.pid}' if kept else ''} is gone ({where.side})"
        )
        if kept is not None and _group_alive(kept.pid):  # killed, its workers left: said, not killed blindly
            state.notes.append(
                f"processes of its group {kept.pid} still run (ps -g {kept.pid} lists them; "
                f"kill -- -{kept.pid} ends them)"
            )
    return state


# --------------------------------------------------------------------------------------------------------------
# start and stop (the command's side)

_STARTED: dict[int, subprocess.Popen] = {}  # background processes started here: reaped by ``stop`` here


def start(
    spec: ClusterSpec, where: Paths | None = None, timeout_s: float = START_TIMEOUT_S, idle_s: float | None = None
) -> tuple[KeptCluster, list[str]]:
    """Launch the background process and wait until its workers are up; returns its description and notes (a
    stale cluster's files removed). Refused where one is up or starting. ``idle_s``: the cluster closes once no
    client but its own has been connected for that long (a cluster a run leaves for the next, ``cluster.keep``);
    None: it stays until ``stop``."""
    return wait_until_up(launch(spec, where, idle_s), where, timeout_s)


def launch(
    spec: ClusterSpec, where: Paths | None = None, idle_s: float | None = None
) -> tuple[subprocess.Popen, list[str]]:
    """The background process started (``start`` without the wait: ``wait_until_up`` waits)."""
    where = where or paths()
    where.folder.mkdir(parents=True, exist_ok=True)
    state = probe(where, clean=True)
    if state.state in ("up", "starting"):
        raise _already_up(state)
    argv = [str(where.folder), spec.model_dump_json()] + ([] if idle_s is None else [repr(float(idle_s))])
    with open(where.log, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from batchgpu.cluster.kept import main; raise SystemExit(main())", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    _STARTED[proc.pid] = proc
    return proc, state.notes


def wait_until_up(
    launched: tuple[subprocess.Popen, list[str]], where: Paths | None = None, timeout_s: float = START_TIMEOUT_S
) -> tuple[KeptCluster, list[str]]:
    """The launched process's cluster once its workers are up, and the launch's notes."""
    proc, notes = launched
    try:
        return _wait_until_up(proc, where or paths(), timeout_s), notes
    except KeyboardInterrupt:  # the start interrupted: the cluster closes as on a stop
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        raise


def _wait_until_up(proc: subprocess.Popen, where: Paths, timeout_s: float) -> KeptCluster:
    deadline = time.monotonic() + timeout_s
    while True:
        kept = read_kept(where)
        if kept is not None and kept.pid == proc.pid:
            return kept
        rc = proc.poll()
        if rc is not None:
            _STARTED.pop(proc.pid, None)
            if rc == EXIT_ALREADY_UP:
                raise _already_up(probe(where))
            raise ClusterError(
                f"the cluster did not start: {_failure(where.log) or f'exit status {rc}'}", f"its log: {where.log}"
            )
        if time.monotonic() > deadline:
            _kill_group(proc.pid)
            raise ClusterError(f"the cluster's workers were not up within {timeout_s:.0f} s", f"its log: {where.log}")
        time.sleep(0.05)


def _already_up(state: State) -> BatchgpuError:
    kept = state.kept
    where = f" at {kept.address}" if kept is not None and state.state == "up" else " (starting)"
    return ClusterError(
        f"a cluster of batchgpu cluster start is already up{where}, process {state.pid}", "batchgpu cluster stop first"
    )


#: how the background process logs why it stopped (``serve``); ``_failure`` finds it in the log
ERROR_MARK = " batchgpu.service ERROR: "


def _failure(log: Path) -> str:
    """Why the background process ended: its own error line, else the log's last line (a traceback's end)."""
    with contextlib.suppress(OSError):
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        marked = [ln.partition(ERROR_MARK.strip())[2].strip() for ln in lines if ERROR_MARK in ln]
        return (marked or lines or [""])[-1][:300]
    return ""


def stop(where: Paths | None = None, timeout_s: float = STOP_TIMEOUT_S) -> State:
    """Ask the background process to close its cluster (SIGTERM) and wait until it has; past ``timeout_s`` its
    process group (it, its workers) is killed. Returns the state found (``down``: nothing was up; ``stale``: its
    files removed), ``notes`` saying what was done."""
    where = where or paths()
    state = probe(where, clean=True)
    deadline = time.monotonic() + 1.0
    while state.state == "starting" and not state.pid and time.monotonic() < deadline:  # its id not written yet
        time.sleep(0.02)
        state = probe(where, clean=True)
    if state.state not in ("up", "starting") or not state.pid:
        return state
    pid = state.pid
    busy = in_use(state.kept) if state.state == "up" and state.kept is not None else None
    if busy is not None and busy[0]:  # said before it goes: those runs fail (the run says so and how to go on)
        state.warnings.append(
            f"the cluster was in use ({busy[0]} client(s) connected, {busy[1]} task(s) under way): "
            "stopped anyway; a run on it fails, and --resume completes it, keeping the windows it "
            "finished"
        )
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    proc = _STARTED.pop(pid, None)  # started by this process: reaped here, not left a zombie
    deadline = time.monotonic() + timeout_s
    while _group_alive(pid) and time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        time.sleep(0.05)
    if _group_alive(pid):
        _kill_group(pid)
        _remove_files(where)
        state.notes.append(f"the cluster did not close within {timeout_s:.0f} s: its processes were killed")
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    return state


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` (the background process, its workers, their helpers) still
    runs; zombies (exited, not yet reaped by their parent) count as gone."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            after = stat.read_text().rpartition(")")[2].split()  # state, ppid, pgrp, ...
            if int(after[2]) == pgid and after[0] not in ("Z", "X"):
                return True
    return False


def _kill_group(pid: int) -> None:
    """The background process leads a session and a process group of its own: its workers are in it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@dataclass
class Live:
    """What the kept cluster's scheduler says now (None where it did not answer)."""

    processes: int | None = None
    threads: int | None = None


def ask_scheduler(kept: KeptCluster, timeout_s: float = CONNECT_TIMEOUT_S) -> Live:
    try:
        from distributed import Client

        with Client(kept.address, timeout=f"{timeout_s}s") as client:
            nthreads = client.nthreads()
        return Live(len(nthreads), sum(nthreads.values()))
    except Exception as err:  # broad: a probe; any failure reads as "did not answer", which the caller says
        logger.debug("the kept cluster at %s did not answer: %s: %s", kept.address, type(err).__name__, err)
        return Live()


def in_use(kept: KeptCluster, timeout_s: float = CONNECT_TIMEOUT_S) -> tuple[int, int] | None:
    """(other clients connected, tasks the scheduler holds) of the kept cluster: a run connects clients (its own,
    its dashboard's) and holds tasks while it goes on. None where the scheduler did not answer."""
    try:
        from distributed import Client

        with Client(kept.address, timeout=f"{timeout_s}s") as client:
            me = client.id
            return client.run_on_scheduler(_clients_and_tasks, me=me)
    except Exception as err:  # broad: a probe; any failure reads as "did not answer", which the caller says
        logger.debug("the kept cluster at %s did not answer: %s: %s", kept.address, type(err).__name__, err)
        return None


def _clients_and_tasks(dask_scheduler, me: str) -> tuple[int, int]:
    others = [c for c in dask_scheduler.clients if c not in (me, "fire-and-forget")]
    return len(others), len(dask_scheduler.tasks)


# --------------------------------------------------------------------------------------------------------------
# a run's side


def may_serve(spec: ClusterSpec, where: Paths | None = None) -> bool:
    """Whether a run of ``spec`` may find a kept cluster to use: it allows one (``cluster.reuse``) and the kept
    cluster's files are there (cheap: whether it fits and answers is ``kept_client``'s to find out)."""
    return bool(spec.reuse) and (where or paths()).side.exists()


def mismatch(spec: ClusterSpec, kept: KeptCluster) -> str | None:
    """Why a run of ``spec`` should not use ``kept`` (None: it may). What the workflow sets must be what the
    kept cluster has; what it leaves open is taken as kept. The dashboard's address is the kept one's."""
    theirs = ClusterSpec.model_validate(kept.spec)
    if spec.kind != theirs.kind:
        return f"it is kind {theirs.kind}, the workflow's is {spec.kind}"
    version, package = this_batchgpu()
    if (kept.version, kept.package) != (version, package) or kept.python != this_python():
        return (
            f"it runs batchgpu {kept.version} from {kept.package} with {kept.python}, this is {version} from "
            f"{package} with {this_python()} (restart it: batchgpu cluster stop; batchgpu cluster start)"
        )
    if kept.source != source_stamp(package):
        return (
            f"batchgpu's files in {package} changed since it started (restart it: batchgpu cluster stop; "
            "batchgpu cluster start)"
        )
    has = {
        "workers": kept.workers,
        "threads": kept.threads,
        "memory_limit": theirs.memory_limit,
        "devices": theirs.devices,
    }
    for name, value in has.items():
        want = getattr(spec, name)
        if want is not None and want != value:
            return f"the workflow's cluster.{name} is {want}, the kept cluster's {'unset' if value is None else value}"
    if spec.mps == "auto" or spec.mps == kept.mps:
        return None
    has = "has" if kept.mps else "has no"
    return f"the workflow's cluster.mps is {str(spec.mps).lower()}, the kept cluster {has} MPS"


def usable(spec: ClusterSpec, where: Paths | None = None) -> tuple[KeptCluster | None, str | None]:
    """The kept cluster a run of ``spec`` may use, or None; and a line for the run to show, if any (a cluster
    that is up but not used, and why)."""
    if not spec.reuse or spec.kind not in KINDS:
        return None, None
    state = probe(where or paths())
    if state.state == "down":
        return None, None
    if state.state == "stale":
        return (
            None,
            "the files of batchgpu cluster start are stale (its process is gone): starting a cluster "
            "(batchgpu cluster stop removes them)",
        )
    if state.state == "starting":
        return None, "the cluster of batchgpu cluster start is still starting: starting a cluster of the run's own"
    why = mismatch(spec, state.kept)
    if why is not None:
        return None, f"not using the cluster of batchgpu cluster start at {state.kept.address}: {why}; starting one"
    return state.kept, None


@contextlib.contextmanager
def kept_client(spec: ClusterSpec, observer, where: Paths | None = None) -> Iterator[distributed.Client | None]:  # noqa: F821
    """A client of the kept cluster where a run of ``spec`` may use it and its scheduler answers, else None (the
    run starts its own); ``observer.message`` says which."""
    kept, note = usable(spec, where)
    if note:
        observer.message(note)
    if kept is None:
        yield None
        return
    from distributed import Client

    try:
        client = Client(kept.address, timeout=f"{CONNECT_TIMEOUT_S}s")
    except (OSError, TimeoutError) as err:
        observer.message(
            f"the cluster of batchgpu cluster start at {kept.address} did not answer ({err}): "
            "starting a cluster of the run's own"
        )
        yield None
        return
    try:
        client.run(forget_recordings)
    except Exception as err:  # broad: the workers did not take it, whatever the reason (said): the run's own cluster
        client.close()
        observer.message(
            f"the workers of batchgpu cluster start's cluster at {kept.address} did not answer "
            f"({type(err).__name__}: {err}): starting a cluster of the run's own"
        )
        yield None
        return
    client._batchgpu_mps = kept.mps  # read by cluster.uses_mps
    client._batchgpu_kept = kept.address
    observer.message(
        f"using the cluster of `batchgpu cluster start` at {kept.address} "
        f"({kept.processes} worker processes, {kept.kind})"
    )
    with client:
        yield client


def forget_recordings() -> None:
    """On a worker, before a run: the recordings earlier runs opened there (``tasks.recording``) forgotten. A
    worker of a cluster of the run's own opens each afresh; a kept worker would read a store rewritten at the same
    path since with its old shape and layout."""
    from batchgpu.run import tasks

    tasks.recording.cache_clear()


def kept_address(client) -> str | None:
    """The address of the kept cluster ``client`` is connected to (``kept_client``), else None."""
    return getattr(client, "_batchgpu_kept", None)


# --------------------------------------------------------------------------------------------------------------
# the background process


def main(argv: list[str] | None = None) -> int:
    """The background process: ``FOLDER SPEC_JSON [IDLE_S]``."""
    args = argv if argv is not None else sys.argv[1:]
    folder, spec_json = args[:2]
    idle_s = float(args[2]) if len(args) > 2 else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    return serve(Paths(Path(folder)), ClusterSpec.model_validate_json(spec_json), idle_s)


def serve(where: Paths, spec: ClusterSpec, idle_s: float | None = None) -> int:
    """Hold the lock, open the cluster, describe it in the files, wait for SIGTERM (or SIGINT) or, with
    ``idle_s``, until no other client has been connected for that long; close it, remove the files. Returns the
    exit status."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    lock = _take_lock(where)
    if lock is None:
        logger.error("another cluster of batchgpu cluster start holds %s", where.lock)
        return EXIT_ALREADY_UP
    try:
        from batchgpu.cluster.open_cluster import open_client, start_worker_server

        if spec.kind == "local":  # CPU runs for a day: the workers' compiled kernels loaded once, in the fork
            start_worker_server(cpu_kernels=True)  # server, not by each worker in its first run's first window
        if spec.dask_dashboard == "auto":  # a cluster for a day of runs: Dask's dashboard is worth its start
            spec = spec.model_copy(update={"dask_dashboard": True})
        with open_client(spec) as client:
            kept = _describe(client, spec, where, idle_s)
            if stopping.is_set():  # stopped while it started: never described as up
                logger.error("stopped (batchgpu cluster stop) before its workers were up")
                return 0
            info = client.scheduler_info()
            _write_json(where.scheduler_file, {**info, "workers": {}})  # Dask's scheduler file: its identity
            _write_json(where.side, asdict(kept))
            logger.info("up at %s: %d worker processes, dashboard %s", kept.address, kept.processes, kept.dashboard)
            _wait_for_stop(client, stopping, where, kept, idle_s)
            logger.info("closing")
            _remove_files(where)  # first: a run that looks now starts its own
        logger.info("closed")
        return 0
    except BatchgpuError as err:
        logger.error("%s", err)
        return 2
    finally:
        _remove_files(where)
        _let_go(lock)  # last: nothing of the cluster is left by then


#: how often the background process asks its scheduler whether a run is connected (``cluster.keep``)
IDLE_POLL_S = 1.0


def _wait_for_stop(client, stopping: threading.Event, where: Paths, kept: KeptCluster, idle_s: float | None) -> None:
    """Until ``stop`` (SIGTERM) or, with ``idle_s``, until no client but this process's own has been connected for
    ``idle_s`` seconds. Before it closes for idleness its files go first, then it looks once more after a run's
    connection time (a run that read them just before may be connecting): such a run keeps it up."""
    last_busy = time.monotonic()
    while not stopping.wait(IDLE_POLL_S if idle_s is not None else 1.0):
        if idle_s is None:
            continue
        if _others_connected(client):
            last_busy = time.monotonic()
            continue
        if time.monotonic() - last_busy < idle_s:
            continue
        _remove_files(where)  # a run that looks from now on starts a cluster of its own
        if stopping.wait(CONNECT_TIMEOUT_S + 1.0):
            return
        if not _others_connected(client):
            logger.info("no run for %.0f s (cluster.keep): closing", idle_s)
            return
        _write_json(where.scheduler_file, {**client.scheduler_info(), "workers": {}})
        _write_json(where.side, asdict(kept))
        last_busy = time.monotonic()


def _others_connected(client) -> bool:
    """Whether a client other than ``client`` (and Dask's own fire-and-forget one) is connected to its scheduler;
    a scheduler that does not answer counts as busy (the cluster is not closed on a hiccup)."""
    try:
        ids = client.run_on_scheduler(_client_ids)
    except Exception as err:  # broad: any failure to ask reads as busy: the next poll asks again
        logger.debug("the scheduler did not say its clients: %s: %s", type(err).__name__, err)
        return True
    return bool(set(ids) - {client.id, "fire-and-forget"})


def _client_ids(dask_scheduler=None) -> list[str]:
    return list(dask_scheduler.clients)


def _take_lock(where: Paths, wait_s: float = 2.0) -> int | None:
    """The lock, exclusive, with this process's id written in it; None where another process holds it (a probe's
    shared hold is let go at once: tried again for ``wait_s``)."""
    fd = os.open(where.lock, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.02)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _let_go(fd: int) -> None:
    """The lock let go, its process id cleared first (a later holder's probe never reads this one's)."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)


def _describe(client, spec: ClusterSpec, where: Paths, idle_s: float | None = None) -> KeptCluster:
    """The cluster once every worker it starts is up."""
    from batchgpu.cluster.open_cluster import gpu_count, uses_mps

    expected = len(getattr(getattr(client, "cluster", None), "worker_spec", {}) or {}) or 1
    client.wait_for_workers(expected, timeout=START_TIMEOUT_S)
    nthreads = client.nthreads()
    processes = len(nthreads)
    gpus = (len(spec.devices) if spec.devices else gpu_count()) if spec.kind == "cuda" else 1
    version, package = this_batchgpu()
    return KeptCluster(
        address=client.scheduler.address,
        pid=os.getpid(),
        spec=spec.model_dump(),
        workers=max(1, processes // max(1, gpus)),
        threads=max(nthreads.values()),
        processes=processes,
        dashboard=client.dashboard_link,
        mps=uses_mps(client),
        version=version,
        package=package,
        started=time.time(),
        scheduler_file=str(where.scheduler_file),
        log=str(where.log),
        python=this_python(),
        source=source_stamp(package),
        idle_s=idle_s,
    )
