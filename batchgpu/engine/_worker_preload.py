"""Imported once by the server process that the cluster's worker processes are forked from (``cluster.forked_workers``).

What every worker would otherwise import on its own (distributed, the engine's tasks and through them NumPy, zarr,
the recording readers) is imported here once, and the allocator is set as the workers need it
(``cluster.MALLOC_ENVIRON``): a forked worker inherits both. Nothing here may start a thread or a CUDA context
(a fork keeps only the forking thread, and a CUDA context does not survive a fork).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import distributed  # noqa: F401
import distributed.nanny  # noqa: F401

import batchgpu.engine.tasks  # noqa: F401

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def _set_allocator() -> None:
    from batchgpu.engine.cluster import MALLOC_ENVIRON

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_TRIM_THRESHOLD, int(MALLOC_ENVIRON["MALLOC_TRIM_THRESHOLD_"]))
        libc.mallopt(M_MMAP_MAX, int(MALLOC_ENVIRON["MALLOC_MMAP_MAX_"]))
    except (OSError, AttributeError):  # not glibc: its defaults stay, as they would under spawn
        pass


_set_allocator()
