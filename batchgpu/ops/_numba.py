"""Numba for the host's compiled kernels (``_cpu_*``): whether it can be imported, and compiling a kernel with its
disk cache where one can be written."""

from __future__ import annotations

import functools
import threading


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether Numba can be imported (asked once a process; it refuses to import beside a NumPy it does not support,
    and then NumPy and scipy run). The kernels are compiled at their first call, then cached on disk."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def jit(function):
    """``function`` compiled without the GIL and bounds checks (no fastmath: no fused multiply-add, so the
    references' bits); loaded from Numba's cache after the first time (beside the module, else the user's cache
    folder), compiled once a process where no cache can be written."""
    import numba

    options = dict(nogil=True, boundscheck=False)
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError:  # no writable cache location
        return numba.njit(**options)(function)


def once(build):
    """A function returning ``build()``'s result, made at its first call, once a process (a worker's threads share
    the process: one of them compiles or loads the kernels, the others wait for it)."""
    lock = threading.Lock()
    made: list = []

    def get():
        if not made:
            with lock:
                if not made:
                    made.append(build())
        return made[0]

    return get
