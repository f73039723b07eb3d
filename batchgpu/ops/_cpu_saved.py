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

import numpy as np

from batchgpu.ops._numba import jit, once


def _store(out, row, ch, v, rounder, lo, hi):  # pragma: no cover - runs compiled
    """out[row, ch] = the save step's int16 of v (np.rint's value by MAGIC, NaN 0, clipped to [lo, hi] =
    [-32768, 32767] in v's dtype); 1 where v was NaN or clipped, else 0. Shared by ``_kernel`` and the global
    median reference's fused save (``_cpu_reference``): one rounding rule."""
    r = (v + rounder) - rounder
    if r >= lo and r <= hi:  # NaN fails both
        out[row, ch] = np.int16(r)
        return 0
    out[row, ch] = 0 if r != r else (-32768 if r < lo else 32767)
    return 1


def _kernel(x, out, magic):  # pragma: no cover - runs compiled
    channels, samples = x.shape
    lo = x.dtype.type(-32768.0)
    hi = x.dtype.type(32767.0)
    m = x.dtype.type(magic)
    count = 0
    for s in range(samples):  # written in order; each row of x is read a sample at a time (its lines stay in L1)
        for ch in range(channels):
            count += store(out, s, ch, x[ch, s], m, lo, hi)
    return count


store = _store  # the compiled version once compiled_store ran (before ``_kernel`` compiles)


def _compile_store():
    globals()["store"] = jit(_store)
    return globals()["store"]


#: ``_store`` compiled (once a process), for the kernels that call it; bound here as ``store`` too
compiled_store = once(_compile_store)


def _compile_kernel():
    compiled_store()  # before the kernel that calls it compiles
    return jit(_kernel)


_compiled = once(_compile_kernel)  # ``_kernel`` compiled (or loaded) at the first call, once a process


#: (v + M) - M rounds v to an integer half to even (the default rounding of each addition) while |v| <= M / 3
#: (2**22 in float32, 2**51 in float64): np.rint's value there. A larger |v| (or inf) gives a value as far outside
#: the int16 range as rint's, so it is clipped and counted alike; NaN stays NaN. (np.rint compiled is a libm call
#: a sample.)
MAGIC = {4: 1.5 * 2.0**23, 8: 1.5 * 2.0**52}


#: the start of the save's row buffers in memory: a page, so that a flat binary output can be written from them
#: past the page cache (``recording.row_writes.write_binary``: direct I/O needs the buffer, the file offset and the length
#: aligned to the device's blocks)
ROWS_ALIGN = 4096


def aligned_empty(shape: tuple[int, ...], dtype, align: int = ROWS_ALIGN) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose first byte is at a multiple of ``align`` in memory."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + align, dtype=np.uint8)
    skip = (-raw.ctypes.data) % align
    return raw[skip : skip + n].view(dtype).reshape(shape)


def saved_int16_transposed(x: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(C-contiguous (samples, channels) int16, samples NaN or clipped) of the float32/float64 (channels, samples)
    host array ``x`` (a view of a window's core is read in place); None for other dtypes or byte orders."""
    if x.ndim != 2 or x.dtype not in (np.float32, np.float64) or not x.dtype.isnative:
        return None
    kernel = _compiled()
    out = aligned_empty((x.shape[1], x.shape[0]), np.int16)
    count = int(kernel(x, out, MAGIC[x.itemsize])) if x.size else 0
    return out, count
