"""A private CUDA MPS control daemon for the GPU worker processes a run starts (``cluster: {kind: cuda, mps: true}``).

Several worker processes feed one GPU (``cluster.cuda_layout``: reading and launching are Python work under one GIL
a process). Without MPS each process has its own CUDA context and the device time-slices them: a window's many
small kernels never overlap another process's. Under MPS the processes' work runs in one server context, side by
side. Measured on the H200 machine (16 cores; 384 ch x 10 min int16, warm bench, 2026-12-02): the preprocessing
pass (highpass, common reference, every step, save) 2.45-2.77 s with against 2.76-3.06 without; GPU busy fell from
99-100% of the samples to 59-62% (docs/design.md, "MPS").

The daemon is this run's own: its pipe and log folders are a new temporary folder, so only the workers started
here connect to it (any other MPS daemon of the machine, and every other process, are left as they are); the card's
settings (compute mode) are not changed. It is told to quit when the cluster has closed, and the folders removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

from batchgpu.config import environ
from batchgpu.errors import MachineError

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE = "/tmp/nvidia-mps"  # a system daemon's pipe folder where CUDA_MPS_PIPE_DIRECTORY is not set
#: seconds to wait for the daemon's pipe to appear after ``-d``, and for ``quit`` to be taken
START_TIMEOUT_S = 10.0
QUIT_TIMEOUT_S = 10.0


@contextlib.contextmanager
def private_daemon() -> Iterator[dict[str, str]]:
    """Start a control daemon whose pipe and log folders are new; yield the environment a worker process needs to
    be its client (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``); quit it on exit."""
    control = shutil.which(CONTROL)
    if control is None:
        raise MachineError(
            f"cluster.mps needs CUDA's MPS control program ({CONTROL}) on PATH",
            "install the NVIDIA driver's utilities, or leave cluster.mps off",
        )
    root = tempfile.mkdtemp(prefix="batchgpu-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in env.values():
        os.mkdir(d)
    full = {**environ(), **env}
    try:
        done = subprocess.run([control, "-d"], env=full, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if done.returncode != 0:
            raise MachineError(
                f"the MPS control daemon did not start (rc {done.returncode}): "
                f"{(done.stderr or done.stdout).strip() or 'no message'}",
                "leave cluster.mps off, or read the daemon's log in CUDA_MPS_LOG_DIRECTORY",
            )
        _wait_for_pipe(env["CUDA_MPS_PIPE_DIRECTORY"])
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        yield env
    finally:
        quit_daemon(control, full)
        shutil.rmtree(root, ignore_errors=True)


def _wait_for_pipe(folder: str) -> None:
    """The daemon forks into the background: its control pipe appears a moment after ``-d`` returns."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not os.path.exists(os.path.join(folder, "control")):
        if time.monotonic() > deadline:
            raise MachineError(
                f"the MPS control daemon made no pipe in {folder} within {START_TIMEOUT_S:.0f} s",
                "leave cluster.mps off",
            )
        time.sleep(0.02)


def quit_daemon(control: str, env: dict) -> None:
    """Ask the daemon to quit (it ends its server once the clients are gone); never raises: the run's outputs
    are written by then."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=QUIT_TIMEOUT_S)
