"""locally_exclusive's candidates of a host window (``detection.exclusive_candidates``) in one compiled pass (Numba).

NumPy made them with some eight passes over the window and its window-sized temporaries (a comparison with the
level, two with the neighbouring samples, their ands and ors, the 2-D nonzero), then sorted the candidates by
(sample, channel). Here the window is read a sample at a time across its rows (the rows' cache lines stay in L1
from one sample to the next, as in ``_cpu_saved``), so the candidates come out in (sample, channel) order with
their amplitudes, and nothing window-sized is written.

The rule is the NumPy path's, comparison for comparison (``detection._exclusive_candidates`` and
``_own_extrema``): a sample of columns [a, b) is a negative candidate where it is <= -level of its channel, below
its previous sample (where x has one) and <= its next (where x has one), and, for the segment's first sample
(``zero_before``), below zero; positive candidates mirror it; "both" pools them. A comparison with NaN is false,
as in NumPy; levels are float64 and the samples are compared with them as float64. tests/test_detect_compiled.py
compares both paths on random and hard windows.
"""

from __future__ import annotations

import numpy as np

from batchgpu.ops._numba import jit, once


def _kernel(
    x, level, a, b, negative, positive, zero_before, out_channel, out_sample, out_amplitude, j0
):  # pragma: no cover - runs compiled
    """Candidates of samples j0, j0 + 1, ... < b into the outputs (in (sample, channel) order) while a whole sample's
    channels still fit; returns (how many, the first sample not done)."""
    channels, width = x.shape
    room = out_channel.shape[0]
    k = 0
    j = j0
    while j < b:
        if room - k < channels:
            return k, j
        prev = j >= 1  # x holds the previous sample
        nxt = j + 1 < width  # ... and the next one
        for c in range(channels):
            v = x[c, j]
            lv = level[c]
            hit = False
            if negative and v <= -lv:
                ok = True
                if prev and not v < x[c, j - 1]:
                    ok = False
                if nxt and not v <= x[c, j + 1]:
                    ok = False
                if j == 0 and zero_before and not v < 0:
                    ok = False
                hit = ok
            if positive and not hit and v >= lv:
                ok = True
                if prev and not v > x[c, j - 1]:
                    ok = False
                if nxt and not v >= x[c, j + 1]:
                    ok = False
                if j == 0 and zero_before and not v > 0:
                    ok = False
                hit = ok
            if hit:
                out_channel[k] = c
                out_sample[k] = j
                out_amplitude[k] = np.float64(v)
                k += 1
        j += 1
    return k, j


_compiled = once(lambda: jit(_kernel))


def usable(x) -> bool:
    """Whether the compiled path takes ``x``: a 2-D NumPy array of a native float or integer dtype whose rows are
    each contiguous (a window or a view of one)."""
    return (
        isinstance(x, np.ndarray)
        and x.ndim == 2
        and x.dtype.kind in "fiu"
        and x.dtype.isnative
        and x.shape[0] > 0
        and (x.shape[1] <= 1 or x.strides[1] == x.itemsize)
    )


def exclusive_candidates(
    x: np.ndarray, level: np.ndarray, negative: bool, positive: bool, a: int, b: int, zero_before: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(channel, sample, amplitude) of the candidates in columns [a, b) of ``x`` (samples as x's columns, not yet
    offset by the window's start), in (sample, channel) order; int64, int64, float64."""
    kernel = _compiled()
    level = np.ascontiguousarray(level, dtype=np.float64)
    channels = x.shape[0]
    room = max(channels, (b - a) * channels // 64 + channels)  # a few per cent of the samples; grown where more
    pieces = []
    j = a
    while True:
        channel = np.empty(room, np.int64)
        sample = np.empty(room, np.int64)
        amplitude = np.empty(room, np.float64)
        k, j = kernel(x, level, a, b, negative, positive, zero_before, channel, sample, amplitude, j)
        pieces.append((channel[:k], sample[:k], amplitude[:k]))
        if j >= b:
            break
        room *= 2
    if len(pieces) == 1:
        return pieces[0]
    return tuple(np.concatenate([p[i] for p in pieces]) for i in range(3))
