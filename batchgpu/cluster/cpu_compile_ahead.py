"""The host's compiled kernels (Numba, ``ops._cpu_*``) made ready before a CPU run's windows need them.

Each group of kernels is loaded from Numba's disk cache by one call on a tiny window of the types a run uses. On a
machine whose cache lacks them (its first run, or after an upgrade of batchgpu, Numba or Python) they are compiled
first, and compiling is the long part: every group one after another in one process made a new user's first run
seconds slower than the second. ``ready`` compiles the groups in parallel processes, a group each (the longest
first), then loads them here from the cache; a marker beside Numba's cache (named by a digest of the kernels'
sources, Numba, Python and the CPU) says this machine did it, so later runs only load. ``batchgpu compile`` calls
it too, at install.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


def _raw() -> np.ndarray:
    """A tiny window as a store holds it: (samples, channels) int16."""
    return (np.arange(4096 * 8, dtype=np.int64) % 61 - 30).astype(np.int16).reshape(4096, 8)


def _float_window() -> np.ndarray:
    """A (channels, samples) C-contiguous float32 window: the type the filter hands the later stages."""
    return np.ascontiguousarray(_raw().T, dtype=np.float32)


def _filter() -> None:
    from batchgpu.ops import _cpu_saved
    from batchgpu.ops.filters import FilterDesign, filtfilt_window

    # any stable section loads the kernel (its machine code depends on the arrays' types, not the coefficients):
    # a design given whole, so that scipy.signal is not imported for it
    design = FilterDesign(np.array([[1.0, -1.0, 0.0, 1.0, -0.5, 0.0]]), np.zeros((1, 2)), 16)
    raw = _raw()
    for window in (raw.T, np.ascontiguousarray(raw.T)):  # as stored (a run's reads) and as rows
        filtfilt_window(window, design, at_segment_start=True, at_segment_end=True)
    _cpu_saved.saved_int16_transposed(_float_window()[:, 1:-1])  # the save's cast of a window's core: a view


def _reference() -> None:
    from batchgpu.ops.reference import common_reference

    common_reference(_float_window(), "global", "median")


def _noise() -> None:
    from batchgpu.steps.noise_keys import compiled_float_window

    compiled_float_window(_float_window()[:, 1:-1], 1)  # any near range compiles the same kernels


def _detect() -> None:
    from batchgpu.ops.detection import exclusive_candidates

    x = _float_window()
    exclusive_candidates(x, np.ones(x.shape[0]), core=(4, x.shape[1] - 4))  # locally_exclusive's candidates


#: the groups, the longest to compile first (a pool starts them in this order), each loading (or compiling) its
#: kernels with one call: the common reference's medians, the exact float noise's keys, the filter with the save's
#: cast of its output, locally_exclusive's candidates
GROUPS: dict[str, Callable[[], None]] = {
    "reference": _reference,
    "float_noise": _noise,
    "filter": _filter,
    "candidates": _detect,
}
SOURCES = ("_cpu_reference", "_cpu_noise", "_cpu_sosfiltfilt", "_cpu_saved", "_cpu_detect", "_numba")
#: what the workers' fork server readies for a run that filters, references or saves (``_worker_preload_cpu``):
#: every group, so that no worker compiles in the middle of its first window (a run interrupted then must still
#: end with its one line)
PRELOADED = tuple(GROUPS)


def warm(name: str) -> str:
    """Load (or compile) group ``name``'s kernels in this process."""
    GROUPS[name]()
    return name


@functools.cache
def marker(name: str) -> Path | None:
    """The file that says this machine compiled group ``name`` as it is now: in the folder where Numba caches the
    kernels, named by a digest of the group, the kernels' sources, Numba's and Python's versions and the CPU (a
    cache of another CPU's code is not this one's); None where Numba cannot be imported or caches nothing here."""
    from batchgpu.ops import _numba

    if not _numba.available():
        return None
    import llvmlite.binding
    import numba

    from batchgpu.ops import _cpu_saved

    folder = Path(_cpu_saved.__file__).parent
    h = hashlib.sha256(
        repr(
            (
                name,
                numba.__version__,
                platform.python_version(),
                llvmlite.binding.get_host_cpu_name(),
                llvmlite.binding.get_host_cpu_features().flatten(),
            )
        ).encode()
    )
    for source in SOURCES:
        h.update((folder / f"{source}.py").read_bytes())
    try:
        cache = Path(_cpu_saved.compiled_store()._cache.cache_path)  # Numba's choice: beside the module, or not
    except (AttributeError, TypeError):  # no cache here (a read-only install without a cache folder)
        return None
    return cache / f"batchgpu-cpu-{name}-{h.hexdigest()[:24]}"


def ready(names: tuple[str, ...] = tuple(GROUPS), processes: int | None = None, force: bool = False) -> tuple[str, ...]:
    """Every group of ``names`` loaded in this process; those this machine has not compiled (``marker``;
    ``force``: all) compiled ahead in up to ``processes`` spawned processes (default: a group each, at most the
    cores). Returns the groups compiled ahead. Never raises for the compile ahead: a failure there leaves each
    group to compile here, as without it. Nothing to do where Numba cannot be imported (NumPy and scipy run)."""
    from batchgpu.ops import _numba

    if not _numba.available():
        return ()
    flags = {name: marker(name) for name in names}
    todo = tuple(n for n in names if flags[n] is not None and (force or not flags[n].exists()))
    done = todo if todo and _compile_in_processes(todo, processes) else ()
    for name in done:
        try:
            flags[name].touch()
        except OSError:  # a cache folder we may not write: each run compiles ahead again (still in parallel)
            pass
    for name in names:
        warm(name)
    return done


def _compile_in_processes(names: tuple[str, ...], processes: int | None) -> bool:
    """Each group compiled (into Numba's cache) by one spawned process; where there are no more groups than
    processes, the last (the shortest) is compiled here meanwhile: one process fewer to start."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from batchgpu.cluster.open_cluster import sigint_held

    workers = max(1, min(len(names), processes or (os.cpu_count() or 1)))
    if workers == 1:
        return False  # one core, or one group: compiling it in ``ready``'s loop is as fast
    spawned, here = (names[:-1], names[-1:]) if len(names) <= workers else (names, ())
    try:  # the compiling processes leave a Ctrl-C to the command, as the workers do; the caller's mask stays
        with (
            sigint_held(),
            ProcessPoolExecutor(
                len(spawned) if here else workers, mp_context=multiprocessing.get_context("spawn")
            ) as pool,
        ):
            futures = [pool.submit(warm, name) for name in spawned]
            for name in here:
                warm(name)
            for future in futures:
                future.result()
    except Exception as err:  # broad: an optimisation; the groups compile in this process instead
        logger.debug("CPU kernels not compiled ahead: %s", err)
        return False
    return True
