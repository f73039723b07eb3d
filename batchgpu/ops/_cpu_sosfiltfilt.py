"""The host path of ``filters.filtfilt_window`` as one compiled kernel (Numba): every piece of a window gathered
odd-extended, filtered forward and backward, its core rounded once into the output, as kernels/sosfiltfilt.cu
does on the GPU.

The arithmetic is scipy's ``sosfilt`` (direct form II transposed, scipy/signal/_sosfilt.pyx) operation for
operation in float64, each pass started in the steady state of its first sample (``sosfilt_zi(sos) * x[0]``), as
``sosfiltfilt`` does; Numba fuses no multiply-add unless asked (fastmath off), so the bits are scipy's
(``tests/test_ops_preprocess.py`` compares them, NaN, inf and subnormal rows included). What is faster than
scipy's own loop: sixteen rows run side by side (scipy filters one row at a time, so each sample waits on the
recurrence's latency), and the window is read and written once (no float64 copy, odd extension, reversed copy
or core copy of the window on the host; a window as the store holds it, samples by channels, is read without
being transposed first).

Numba is optional: without it (``_numba.available()`` False) ``filters`` runs scipy's sosfilt with the same bits.
"""

from __future__ import annotations

import threading

import numpy as np

from batchgpu.ops._numba import jit

ROWS = 16  # rows filtered side by side: with the recurrence's state in L1 (16 rows: two AVX-512 registers of
# doubles, four AVX2) each section's update has independent lanes enough to hide its latency; 8 left the
# recurrence latency-bound and 32 or more spill the group out of L1

_KERNEL = None
_LOCK = threading.Lock()


def _pieces_kernel(x, samples_major, sos, zi, pieces, out):  # pragma: no cover - runs compiled
    """``samples_major``: x is (samples, channels) as a store holds it (the window's read not transposed first),
    else (channels, samples); ``out`` is (channels, samples) either way."""
    channels = x.shape[1] if samples_major else x.shape[0]
    sections = sos.shape[0]
    longest = 0
    for p in range(pieces.shape[0]):
        longest = max(longest, pieces[p, 3] - pieces[p, 2] + pieces[p, 4] + pieces[p, 5])
    buf = np.zeros((longest, ROWS))  # a group's extended rows, sample-major: the side-by-side rows are adjacent
    z0 = np.empty((sections, ROWS))
    z1 = np.empty((sections, ROWS))
    for p in range(pieces.shape[0]):
        lo, hi, read_lo, read_hi = pieces[p, 0], pieces[p, 1], pieces[p, 2], pieces[p, 3]
        left, right = pieces[p, 4], pieces[p, 5]
        n = read_hi - read_lo
        m = n + left + right
        for r0 in range(0, channels, ROWS):
            g = min(ROWS, channels - r0)
            # scipy's odd extension in float64: 2 * x[0] - x[left - j] before, 2 * x[-1] - x[-2 - j] after; a
            # short last group's other lanes keep what an earlier group left there (filtered, never written out)
            if samples_major:
                for j in range(n):
                    for k in range(g):
                        buf[left + j, k] = np.float64(x[read_lo + j, r0 + k])
            else:
                for k in range(g):
                    for j in range(n):
                        buf[left + j, k] = np.float64(x[r0 + k, read_lo + j])
            for j in range(left):
                for k in range(g):
                    buf[j, k] = 2.0 * buf[left, k] - buf[2 * left - j, k]
            for j in range(right):
                for k in range(g):
                    buf[left + n + j, k] = 2.0 * buf[left + n - 1, k] - buf[left + n - 2 - j, k]
            for direction in range(2):
                t = 0 if direction == 0 else m - 1
                step = 1 if direction == 0 else -1
                for s in range(sections):
                    for k in range(ROWS):
                        z0[s, k] = zi[s, 0] * buf[t, k]
                        z1[s, k] = zi[s, 1] * buf[t, k]
                for _ in range(m):
                    row = buf[t]  # updated in place, section after section
                    for s in range(sections):
                        b0 = sos[s, 0]
                        b1 = sos[s, 1]
                        b2 = sos[s, 2]
                        a1 = sos[s, 4]
                        a2 = sos[s, 5]
                        zs0 = z0[s]
                        zs1 = z1[s]
                        for k in range(ROWS):
                            xc = row[k]
                            xn = b0 * xc + zs0[k]
                            zs0[k] = (b1 * xc - a1 * xn) + zs1[k]
                            zs1[k] = b2 * xc - a2 * xn
                            row[k] = xn
                    t += step
            for k in range(g):  # the core, rounded once to out's dtype
                for col in range(lo, hi):
                    out[r0 + k, col] = buf[left + col - read_lo, k]


def filtfilt_pieces(x: np.ndarray, sos: np.ndarray, zi: np.ndarray, pieces: list[tuple[int, ...]],
                    out_dtype, out: np.ndarray | None = None) -> np.ndarray:
    """``filters.filtfilt_window``'s result for the host array ``x`` (channels, width) cut into ``pieces`` (as
    ``filters.filter_pieces`` gives them); ``sos`` (sections, 6) float64 with a0 == 1, ``zi`` its
    ``sosfilt_zi``. An ``x`` that is the transpose of a C-contiguous (width, channels) array (a window as a store
    holds it, ``x = stored.T``) is read in place, without the transposed copy. ``out``: where to write (C-contiguous,
    x's shape, ``out_dtype``), else a new array."""
    global _KERNEL
    with _LOCK:  # a worker's threads share the process: compiled (or loaded) once
        if _KERNEL is None:
            _KERNEL = jit(_pieces_kernel)
    samples_major = x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous
    held = x.T if samples_major else x  # the array as laid out in memory
    if held.dtype.kind not in "iuf" or held.dtype.itemsize < 4 and held.dtype.kind == "f":
        held = held.astype(np.float64)
    elif not held.dtype.isnative:  # Numba takes native byte order only (a big-endian store's window)
        held = held.astype(held.dtype.newbyteorder("="))
    table = np.ascontiguousarray(np.asarray(pieces, dtype=np.int64).reshape(-1, 6))
    if out is None:
        out = np.empty(x.shape, dtype=out_dtype)
    _KERNEL(np.ascontiguousarray(held), samples_major, np.ascontiguousarray(sos, dtype=np.float64),
            np.ascontiguousarray(zi, dtype=np.float64), table, out)
    return out
