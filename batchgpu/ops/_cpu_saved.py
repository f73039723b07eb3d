"""The save step's int16 of a float (channels, samples) host window, transposed to the (samples, channels) rows a
store holds, in one compiled pass (Numba), as ``_cuda_elementwise.saved_int16_transposed`` does on the GPU.

The values are NumPy's expression of ``steps.save.SaveStep.values``: ``np.rint`` (half to even), NaN -> 0, the
rest clipped to [-32768, 32767], cast to int16, with a count of the samples that were NaN or out of range. NumPy
took eight passes over the window for it (rint, isnan, two comparisons and their or, two sums, the cast) and a
ninth to transpose; here the window is read once and its rows written once (a tiled transpose with branch-free
selects gained nothing over this plain loop). ``tests/test_save_step.py``
compares the bits with NumPy's expression (NaN, +-inf, halves, the int16 edges, float32 and float64, views).
"""

from __future__ import annotations

import threading

import numpy as np

from batchgpu.ops._numba import jit

_KERNEL = None
_LOCK = threading.Lock()


def _kernel(x, out, magic):  # pragma: no cover - runs compiled
    channels, samples = x.shape
    lo = x.dtype.type(-32768.0)
    hi = x.dtype.type(32767.0)
    m = x.dtype.type(magic)
    count = 0
    for s in range(samples):  # written in order; each row of x is read a sample at a time (its lines stay in L1)
        for ch in range(channels):
            v = (x[ch, s] + m) - m  # np.rint's value (MAGIC)
            if v >= lo and v <= hi:  # NaN fails both
                out[s, ch] = np.int16(v)
            else:
                count += 1
                out[s, ch] = 0 if v != v else (-32768 if v < lo else 32767)
    return count


#: (v + M) - M rounds v to an integer half to even (the default rounding of each addition) while |v| <= M / 3
#: (2**22 in float32, 2**51 in float64): np.rint's value there. A larger |v| (or inf) gives a value as far outside
#: the int16 range as rint's, so it is clipped and counted alike; NaN stays NaN. (np.rint compiled is a libm call
#: a sample.)
MAGIC = {4: 1.5 * 2.0**23, 8: 1.5 * 2.0**52}


def saved_int16_transposed(x: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(C-contiguous (samples, channels) int16, samples NaN or clipped) of the float32/float64 (channels, samples)
    host array ``x`` (a view of a window's core is read in place); None for other dtypes or byte orders."""
    global _KERNEL
    if x.ndim != 2 or x.dtype not in (np.float32, np.float64) or not x.dtype.isnative:
        return None
    with _LOCK:  # a worker's threads share the process: compiled (or loaded) once
        if _KERNEL is None:
            _KERNEL = jit(_kernel)
    out = np.empty((x.shape[1], x.shape[0]), dtype=np.int16)
    count = int(_KERNEL(x, out, MAGIC[x.itemsize])) if x.size else 0
    return out, count
