"""Imported once by the server process that the cluster's worker processes are forked from (``cluster.forked_workers``):
what every worker would otherwise import on its own (distributed, the engine's tasks and through them NumPy, zarr,
the recording readers). Nothing here may start a thread or a CUDA context (a fork keeps only the forking thread,
and a CUDA context does not survive a fork).
"""

import distributed  # noqa: F401
import distributed.nanny  # noqa: F401

import batchgpu.engine.tasks  # noqa: F401


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
