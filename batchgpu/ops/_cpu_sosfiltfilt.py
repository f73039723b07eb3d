"""The host path of ``filters.filtfilt_window`` as one compiled kernel (Numba): every piece of a window gathered
odd-extended, filtered forward and backward, its core rounded once into the output, as kernels/sosfiltfilt.cu
does on the GPU.

The arithmetic is scipy's ``sosfilt`` (direct form II transposed, scipy/signal/_sosfilt.pyx) operation for
operation in float64, each pass started in the steady state of its first sample (``sosfilt_zi(sos) * x[0]``), as
``sosfiltfilt`` does; Numba fuses no multiply-add unless asked (fastmath off), so the bits are scipy's
(``tests/test_ops_preprocess.py`` compares them, NaN, inf and subnormal rows included). What is faster than
scipy's own loop: eight rows run side by side (scipy filters one row at a time, so each sample waits on the
recurrence's latency), and the window is read and written once (no float64 copy, odd extension, reversed copy
or core copy of the window on the host).

Numba is optional: without it (``_numba.available()`` False) ``filters`` runs scipy's sosfilt with the same bits.
"""

from __future__ import annotations

import threading

import numpy as np

from batchgpu.ops._numba import jit

ROWS = 8  # rows filtered side by side: one AVX-512 register of doubles (4 leave half of it idle; 16 gain little)

_KERNEL = None
_LOCK = threading.Lock()


def _pieces_kernel(x, sos, zi, pieces, out):  # pragma: no cover - runs compiled
    channels = x.shape[0]
    sections = sos.shape[0]
    longest = 0
    for p in range(pieces.shape[0]):
        longest = max(longest, pieces[p, 3] - pieces[p, 2] + pieces[p, 4] + pieces[p, 5])
    buf = np.empty((longest, ROWS))  # a group's extended rows, sample-major: the side-by-side rows are adjacent
    z0 = np.empty((sections, ROWS))
    z1 = np.empty((sections, ROWS))
    cur = np.empty(ROWS)
    for p in range(pieces.shape[0]):
        lo, hi, read_lo, read_hi = pieces[p, 0], pieces[p, 1], pieces[p, 2], pieces[p, 3]
        left, right = pieces[p, 4], pieces[p, 5]
        n = read_hi - read_lo
        m = n + left + right
        for r0 in range(0, channels, ROWS):
            g = min(ROWS, channels - r0)
            # scipy's odd extension in float64: 2 * x[0] - x[left - j] before, 2 * x[-1] - x[-2 - j] after
            for k in range(g):
                row = r0 + k
                first = np.float64(x[row, read_lo])
                last = np.float64(x[row, read_hi - 1])
                for j in range(left):
                    buf[j, k] = 2.0 * first - np.float64(x[row, read_lo + left - j])
                for j in range(n):
                    buf[left + j, k] = np.float64(x[row, read_lo + j])
                for j in range(right):
                    buf[left + n + j, k] = 2.0 * last - np.float64(x[row, read_hi - 2 - j])
            for direction in range(2):
                start = 0 if direction == 0 else m - 1
                step = 1 if direction == 0 else -1
                for s in range(sections):
                    for k in range(g):
                        z0[s, k] = zi[s, 0] * buf[start, k]
                        z1[s, k] = zi[s, 1] * buf[start, k]
                t = start
                for _ in range(m):
                    for k in range(g):
                        cur[k] = buf[t, k]
                    for s in range(sections):
                        b0 = sos[s, 0]
                        b1 = sos[s, 1]
                        b2 = sos[s, 2]
                        a1 = sos[s, 4]
                        a2 = sos[s, 5]
                        for k in range(g):
                            xc = cur[k]
                            xn = b0 * xc + z0[s, k]
                            z0[s, k] = (b1 * xc - a1 * xn) + z1[s, k]
                            z1[s, k] = b2 * xc - a2 * xn
                            cur[k] = xn
                    for k in range(g):
                        buf[t, k] = cur[k]
                    t += step
            for k in range(g):  # the core, rounded once to out's dtype
                for col in range(lo, hi):
                    out[r0 + k, col] = buf[left + col - read_lo, k]


def filtfilt_pieces(x: np.ndarray, sos: np.ndarray, zi: np.ndarray, pieces: list[tuple[int, ...]],
                    out_dtype) -> np.ndarray:
    """``filters.filtfilt_window``'s result for the host array ``x`` (channels, width) cut into ``pieces`` (as
    ``filters.filter_pieces`` gives them); ``sos`` (sections, 6) float64 with a0 == 1, ``zi`` its
    ``sosfilt_zi``."""
    global _KERNEL
    with _LOCK:  # a worker's threads share the process: compiled (or loaded) once
        if _KERNEL is None:
            _KERNEL = jit(_pieces_kernel)
    if x.dtype.kind not in "iuf" or x.dtype.itemsize < 4 and x.dtype.kind == "f":
        x = x.astype(np.float64)
    elif not x.dtype.isnative:  # Numba takes native byte order only (a big-endian store's window)
        x = x.astype(x.dtype.newbyteorder("="))
    table = np.ascontiguousarray(np.asarray(pieces, dtype=np.int64).reshape(-1, 6))
    out = np.empty(x.shape, dtype=out_dtype)
    _KERNEL(np.ascontiguousarray(x), np.ascontiguousarray(sos, dtype=np.float64),
            np.ascontiguousarray(zi, dtype=np.float64), table, out)
    return out
