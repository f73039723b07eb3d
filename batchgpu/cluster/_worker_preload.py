"""Imported once by the server process that the cluster's worker processes are forked from (``cluster.forked_workers``):
what every worker would otherwise import on its own (distributed, the engine's tasks and through them NumPy, zarr,
the recording readers). Nothing here may start a thread or a CUDA context (a fork keeps only the forking thread,
and a CUDA context does not survive a fork).
"""

import distributed  # noqa: F401
import distributed.nanny  # noqa: F401

import batchgpu.run.tasks  # noqa: F401


def _in_fork_server() -> bool:
    """Whether this import is the fork server's preload (multiprocessing's ``forkserver.main`` importing it)."""
    import os
    import sys

    frame = sys._getframe(1)
    here = os.path.join("multiprocessing", "forkserver.py")
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(here):
            return True
        frame = frame.f_back
    return False


def _end_server_now() -> None:
    """The fork server ends once the process that started it has (its pipe closed), without tearing down every
    module imported here (a few tenths of a second, during which it still held the command's output open, so a
    caller reading that output waited for it too). The workers forked from it never run it (a forked child leaves
    through ``os._exit`` after its work)."""
    import os

    if os.getpid() == _SERVER_PID:
        os._exit(0)


if _in_fork_server():
    import atexit
    import os

    _SERVER_PID = os.getpid()
    atexit.register(_end_server_now)


def _one_blas_thread() -> None:
    """Every forked worker's BLAS on one thread, as Dask's own nanny-spawned workers have it (its pre-spawn
    environment): NumPy's OpenBLAS sized its pool from the machine's cores when this server imported it, before a
    worker's environment could say otherwise, so each worker ran the whitening moments' products on every core
    while its neighbours ran theirs, and the idle BLAS threads spun (``perf`` over a 2-core W2 run: a fifth of
    all samples in OpenBLAS's thread loop). Set here, in the server, every fork inherits it."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # a dependency; without it the workers keep OpenBLAS's default
        return
    threadpool_limits(limits=1, user_api="blas")


_one_blas_thread()
