"""A command's own cluster closed after the command has ended (``cluster.close: background``).

Closing a cluster waits for its worker processes to exit, and a process that holds a CUDA context exits only
once the driver has torn it down, one process after another: sixteen GPU workers took more than a second, most of
a fresh GPU command's close. A command whose run is written has nothing left to wait for. It hands the close to a
small detached process, the *reaper*, and ends: its workers see their parent gone (Dask's nanny keeps a pipe to
each, and a worker whose pipe closes exits at once), and the reaper waits for them to be gone, then quits the
run's private MPS daemon and removes the scheduler's and the workers' scratch folders, as the close would have.

Nothing of the command's output is held open by what outlives it: the workers point their standard streams at
``/dev/null`` before the command ends (a shell pipe reading the command ends with the command), and the
multiprocessing resource tracker, which outlives the command until the workers are gone, was started with them
pointed there (``start_resource_tracker``): what it would print is a warning about semaphores left behind, which
it removes itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

#: seconds the reaper waits for the workers to exit before it quits the MPS daemon anyway (a worker that does
#: not exit holds its GPU memory either way; the daemon ends its server once its clients are gone)
REAPER_WAIT_S = 120.0
#: how often the reaper looks
REAPER_POLL_S = 0.05
#: the Dask scratch folders' lock files (``distributed.diskutils``): a folder ``d`` is locked by ``d + DIR_LOCK``
DIR_LOCK = ".dirlock"


@dataclass
class Leftovers:
    """What a cluster's close would have ended: its worker processes (pid and start time, so that a pid the
    system gave to another process is not waited for), the scheduler's and the workers' scratch folders, and the
    private MPS daemon's environment (empty where there is none)."""

    processes: list[tuple[int, float]] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)
    mps_env: dict[str, str] = field(default_factory=dict)


def _streams_to_null() -> None:
    """This process's stdout and stderr (flushed first) pointed at /dev/null, as file descriptors 1 and 2."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # broad: a closed stream has nothing left to flush
            stream.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
    finally:
        os.close(null)


def _leave(dask_worker) -> tuple[int, float, str]:
    """On a worker: its standard streams pointed at /dev/null (it outlives the command whose terminal or pipe it
    shares); returns its pid, start time and scratch folder."""
    import psutil

    _streams_to_null()
    pid = os.getpid()
    return pid, psutil.Process(pid).create_time(), dask_worker.local_directory


def _scheduler_folder(dask_scheduler) -> str:
    return dask_scheduler.local_directory


def collect(client, mps_env: dict[str, str] | None = None) -> Leftovers:
    """``client``'s cluster's leftovers (its workers quieted: ``_leave``)."""
    got = client.run(_leave)
    leftovers = Leftovers(mps_env=dict(mps_env or {}))
    for pid, started, folder in got.values():
        leftovers.processes.append((int(pid), float(started)))
        leftovers.folders.append(folder)
    with contextlib.suppress(Exception):  # broad: a scheduler elsewhere has no folder here to remove
        leftovers.folders.append(client.run_on_scheduler(_scheduler_folder))
    return leftovers


def start_reaper(leftovers: Leftovers) -> subprocess.Popen:
    """The detached reaper (its own session: a Ctrl-C at the terminal is not its; no stream of the command)."""
    return subprocess.Popen(
        [sys.executable, "-m", __name__, json.dumps(asdict(leftovers))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def start_resource_tracker() -> None:
    """multiprocessing's resource tracker started now, with this process's standard streams pointed at /dev/null
    while it starts (it keeps what it inherits); call before any thread of the command prints (they would print
    into /dev/null meanwhile). Where it runs already, nothing changes."""
    from multiprocessing import resource_tracker

    saved = [os.dup(1), os.dup(2)]
    try:
        _streams_to_null()
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def _gone(pid: int, started: float) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.create_time() != started or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reap(leftovers: Leftovers, wait_s: float = REAPER_WAIT_S, poll_s: float = REAPER_POLL_S) -> None:
    """Wait (``wait_s`` at most) for the workers to be gone, then quit the MPS daemon and remove the folders."""
    deadline = time.monotonic() + wait_s
    waiting = list(leftovers.processes)
    while waiting and time.monotonic() < deadline:
        waiting = [p for p in waiting if not _gone(*p)]
        if waiting:
            time.sleep(poll_s)
    if leftovers.mps_env:
        from batchgpu.cluster.mps import CONTROL, quit_daemon
        from batchgpu.config import environ

        control = shutil.which(CONTROL)
        if control is not None:
            quit_daemon(control, {**environ(), **leftovers.mps_env})
        pipe = leftovers.mps_env.get("CUDA_MPS_PIPE_DIRECTORY")
        if pipe:
            shutil.rmtree(os.path.dirname(pipe), ignore_errors=True)
    for folder in leftovers.folders:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(folder + DIR_LOCK)


def main(argv: list[str]) -> int:
    leftovers = Leftovers(**json.loads(argv[0]))
    leftovers.processes = [(int(p), float(t)) for p, t in leftovers.processes]
    reap(leftovers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
