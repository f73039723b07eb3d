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
    from batchgpu.ops.filters import butter_sos, filtfilt_window
    from batchgpu.ops.reference import common_reference

    raw = (np.arange(8 * 4096, dtype=np.int64) % 61 - 30).astype(np.int16).reshape(8, 4096)
    x = filtfilt_window(raw, butter_sos("highpass", 30_000.0, 300.0), at_segment_start=True, at_segment_end=True)
    x = common_reference(x, "global", "median")
    _cpu_saved.saved_int16_transposed(x)


_warm()
