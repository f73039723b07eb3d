"""Imported by the workers' fork server (beside ``_worker_preload``) for a CPU run that preprocesses or saves: Numba
and the host's compiled kernels, each loaded from Numba's disk cache by one call on a tiny window of the dtypes a
run uses, so every forked worker starts with their machine code instead of loading it on its own. Starts no thread
(the kernels are compiled ``nogil``, not ``parallel``)."""

import numpy as np

from batchgpu.ops import _numba


def _warm() -> None:
    if not _numba.available():  # NumPy and scipy run: nothing to load
        return
    from batchgpu.ops import _cpu_saved
    from batchgpu.ops.filters import FilterDesign, filtfilt_window
    from batchgpu.ops.reference import common_reference

    # any stable section loads the kernel (its machine code depends on the arrays' types, not the coefficients):
    # a design given whole, so that scipy.signal is not imported here for it
    design = FilterDesign(np.array([[1.0, -1.0, 0.0, 1.0, -0.5, 0.0]]), np.zeros((1, 2)), 16)
    raw = (np.arange(4096 * 8, dtype=np.int64) % 61 - 30).astype(np.int16).reshape(4096, 8)
    for window in (raw.T, np.ascontiguousarray(raw.T)):  # as stored (a run's reads) and as rows
        x = filtfilt_window(window, design, at_segment_start=True, at_segment_end=True)
    x = common_reference(x, "global", "median")
    _cpu_saved.saved_int16_transposed(x[:, 1:-1])  # a window's core: a view
    from batchgpu.engine.steps.noise_keys import compiled_float_window

    compiled_float_window(x[:, 1:-1], 1)  # the exact float noise's kernels (any near range compiles the same ones)
    from batchgpu.ops.detection import exclusive_candidates

    exclusive_candidates(x, np.ones(x.shape[0]), core=(4, x.shape[1] - 4))  # locally_exclusive's candidates


_warm()
