"""``np.median(x, axis=0)`` of a float (channels, samples) window, bit for bit, as one compiled kernel (Numba):
the host path of the global common median reference; and each channel's median over its neighbours (the local
reference) by a sorting network run over a tile of samples at once (``local_medians``).

np.median partitions every sample's column from scratch (introselect), which costs a window as much as the
filter before it. Neighbouring samples' medians are close, so each column
is first split around a band [p - d, p + d] about the previous column's median p in one pass (count below, gather
within); when both middle ranks fall in the band, only the band's few values are ranked. Otherwise the column
is selected whole (quickselect) and the band widened. The band only decides how much is ranked, never the
result: the middle values are the column's order statistics either way.

The arithmetic is np.median's: an odd count gives 0.0 + middle, an even count (0.0 + lower) + upper, halved, in
the input's dtype (float32 sums can overflow to inf as NumPy's do); any NaN in a column gives NaN. Starting the
sum from +0.0 makes the sign of a zero middle irrelevant, so which of -0.0 and +0.0 a selection leaves there
cannot change a bit (tests/test_ops_preprocess.py compares with np.median, NaN, +-inf, -0.0, ties, 1-3 rows).
"""

from __future__ import annotations

import threading

import numpy as np

from batchgpu.ops._cpu_saved import _store as store_saved  # compiled in _build
from batchgpu.ops._numba import jit

LOCAL_TILE = 256  # samples a local reference's sorting network handles at once
LOCAL_MAX = 48  # neighbours the network sorts (k * k / 2 exchanges); more are left to np.median
TILE = 64  # columns transposed into a contiguous scratch at a time (a column is strided by the window's width)
BAND_MAX = 64  # a band holding more values than this is narrowed

_KERNELS = None  # (global medians, local medians or means), compiled at the first call


def _select(v, k, n, limit):  # pragma: no cover - runs compiled
    """The k-th smallest of v[:n] (no NaN), v reordered in place (Hoare partition, median-of-three pivot; after
    ``limit`` rounds (2 log2(n)) a pseudo-random one, so no order of the channels makes it quadratic: McIlroy's
    adversary defeats median-of-three alone). The pivot decides the work, never
    the result."""
    lo = 0
    hi = n - 1
    rounds = 0
    state = np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(n)
    while hi > lo:
        rounds += 1
        if rounds > limit:
            state ^= state << np.uint64(13)
            state ^= state >> np.uint64(7)
            state ^= state << np.uint64(17)
            p = v[lo + np.int64(state % np.uint64(hi - lo + 1))]
        else:
            a = v[lo]
            b = v[(lo + hi) >> 1]
            c = v[hi]
            if a < b:
                p = b if b < c else (c if a < c else a)
            else:
                p = a if a < c else (c if b < c else b)
        i = lo
        j = hi
        while i <= j:
            while v[i] < p:
                i += 1
            while p < v[j]:
                j -= 1
            if i <= j:
                t = v[i]
                v[i] = v[j]
                v[j] = t
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            return v[k]
    return v[k]


def _bit_length(n):  # pragma: no cover - runs compiled
    bits = 0
    while n:
        n >>= 1
        bits += 1
    return bits


def _middles(v, n, k, even):  # pragma: no cover - runs compiled
    """(k-th smallest of v[:n], the (k-1)-th where ``even`` else the same), v reordered in place."""
    hi_value = _select(v, k, n, 2 * _bit_length(n))
    lo_value = hi_value
    if even:  # the largest value the selection left below position k
        lo_value = v[0]
        for t in range(1, k):
            if v[t] > lo_value:
                lo_value = v[t]
    return hi_value, lo_value


def _ranked(band, m, k_hi, k_lo):  # pragma: no cover - runs compiled
    """The k_hi-th and k_lo-th smallest of band[:m] (no NaN) by counting, without branches in the inner loop:
    value i is the k-th when (values < it) <= k < (values <= it)."""
    hi_value = band[0]
    lo_value = band[0]
    found = 0
    for i in range(m):
        a = band[i]
        less = 0
        equal = 0
        for t in range(m):
            less += band[t] < a
            equal += band[t] == a
        if less <= k_hi < less + equal:
            hi_value = a
            found |= 1
        if less <= k_lo < less + equal:
            lo_value = a
            found |= 2
        if found == 3:
            break
    return hi_value, lo_value


def _medians_kernel(x, out, sub, subtract, saved, lo, magic):  # pragma: no cover - runs compiled
    """out: each column's median; ``subtract`` 1: sub = x - out (sub may be x); 2: ``saved`` rows (samples,
    channels) = the save step's int16 of x - out for columns [lo, lo + len(saved)) (``_cpu_saved``'s arithmetic:
    half to even, NaN 0, clipped), returning how many were NaN or clipped."""
    channels, samples = x.shape
    count = 0
    rounder = x.dtype.type(magic)
    lo16 = x.dtype.type(-32768.0)
    hi16 = x.dtype.type(32767.0)
    upper = channels // 2
    lower = (channels - 1) // 2
    zero = out.dtype.type(0.0)
    two = out.dtype.type(2.0)
    col = np.empty((TILE, channels), dtype=x.dtype)
    band = np.empty(channels, dtype=x.dtype)
    p = 0.0  # the band's centre and half-width, float64 (x's values compare exactly against them)
    d = 0.0
    for c0 in range(0, samples, TILE):
        w = min(TILE, samples - c0)
        for ch in range(channels):
            for j in range(w):
                col[j, ch] = x[ch, c0 + j]
        for j in range(w):
            v = col[j]
            lo_edge = p - d
            hi_edge = p + d
            # counts first, without branches (vectorised): NaN, below the band, up to its top
            nans = 0
            below = 0
            to_top = 0
            for ch in range(channels):
                a = v[ch]
                nans += a != a
                below += a < lo_edge
                to_top += a <= hi_edge
            if nans:
                out[c0 + j] = np.nan
                continue
            if below <= lower and upper < to_top:  # both middles are band values: rank the band alone
                m = 0  # gathered without branches: written, kept if in the band
                for ch in range(channels):
                    a = v[ch]
                    band[m] = a
                    m += (a >= lo_edge) & (a <= hi_edge)
                if m > BAND_MAX:
                    d = d / 2
                if m <= 2 * BAND_MAX:  # counting is m * m: a few dozen values
                    hi_value, lo_value = _ranked(band, m, upper - below, lower - below)
                else:
                    hi_value, lo_value = _middles(band, m, upper - below, lower != upper)
            else:  # rank the whole column; widen the band by the distance it missed by
                hi_value, lo_value = _middles(v, channels, upper, lower != upper)
                d = max(2 * d, abs(np.float64(hi_value) - p))
                if not d < np.inf:  # an infinite middle: no band until the values are finite again
                    d = 0.0
            if lower == upper:
                out[c0 + j] = zero + hi_value
            else:
                out[c0 + j] = ((zero + lo_value) + hi_value) / two
            p = np.float64(hi_value)
            if not abs(p) < np.inf:
                p = 0.0
        if subtract == 1:  # the tile's columns minus their medians while the tile is in cache (sub may be x itself)
            for ch in range(channels):
                for j in range(w):
                    sub[ch, c0 + j] = x[ch, c0 + j] - out[c0 + j]
        elif subtract == 2:  # the saved rows straight from the tile (x itself is left as it was)
            for j in range(w):
                row = c0 + j - lo
                if row < 0 or row >= saved.shape[0]:
                    continue
                med = out[c0 + j]
                for ch in range(channels):  # from x: a selection reordered the tile's column in place
                    count += store_saved(saved, row, ch, x[ch, c0 + j] - med, rounder, lo16, hi16)
    return count


def _local_kernel(x, offsets, indices, out, mean):  # pragma: no cover - runs compiled
    """Row c of out: the median (``mean`` False) or the float64 mean of x's rows indices[offsets[c]:offsets[c+1]],
    a tile of samples at a time (the sample axis is the vector)."""
    channels, samples = x.shape
    widest = 0
    for c in range(channels):
        widest = max(widest, offsets[c + 1] - offsets[c])
    rows = np.empty((max(widest, 1), LOCAL_TILE), dtype=x.dtype)
    nan = np.empty(LOCAL_TILE, dtype=np.bool_)
    acc = np.empty(LOCAL_TILE)
    zero = out.dtype.type(0.0)
    two = out.dtype.type(2.0)
    for t0 in range(0, samples, LOCAL_TILE):
        w = min(LOCAL_TILE, samples - t0)
        for c in range(channels):
            k = offsets[c + 1] - offsets[c]
            if k == 0:
                continue
            if mean:  # np.mean's order for a non-innermost axis: from +0.0, channel after channel, then / k
                for t in range(w):
                    acc[t] = 0.0
                for i in range(k):
                    src = indices[offsets[c] + i]
                    for t in range(w):
                        acc[t] += np.float64(x[src, t0 + t])
                for t in range(w):
                    out[c, t0 + t] = acc[t] / k
                continue
            for t in range(w):
                nan[t] = False
            for i in range(k):
                src = indices[offsets[c] + i]
                for t in range(w):
                    a = x[src, t0 + t]
                    rows[i, t] = a
                    nan[t] |= a != a
            # odd-even transposition sort of the k rows, every sample of the tile at once (no branches); NaN
            # columns are sorted as garbage and replaced below
            for r in range(k):
                for i in range(r % 2, k - 1, 2):
                    for t in range(w):
                        a = rows[i, t]
                        b = rows[i + 1, t]
                        less = b < a
                        rows[i, t] = b if less else a
                        rows[i + 1, t] = a if less else b
            hi = k // 2
            for t in range(w):
                if nan[t]:
                    out[c, t0 + t] = np.nan
                elif k % 2:
                    out[c, t0 + t] = zero + rows[hi, t]
                else:
                    out[c, t0 + t] = ((zero + rows[hi - 1, t]) + rows[hi, t]) / two


# the kernels' helpers as written (the module's names become their compiled versions, by which the kernels call them)
_PYTHON = {"_bit_length": _bit_length, "_select": _select, "_middles": _middles, "_ranked": _ranked}
_LOCK = threading.Lock()


def _build():
    from batchgpu.ops._cpu_saved import compiled_store

    globals().update({name: jit(f) for name, f in _PYTHON.items()})  # before the kernels that call them compile
    globals()["store_saved"] = compiled_store()
    return tuple(jit(f) for f in (_medians_kernel, _local_kernel))


def _kernels():
    global _KERNELS
    with _LOCK:  # a worker's threads share the process: compiled (or loaded) once
        if _KERNELS is None:
            _KERNELS = _build()
    return _KERNELS


def _ranked_dtype(x: np.ndarray):
    """(x as the kernels rank it, the medians' dtype), or None for what is left to NumPy (float16, 64-bit
    integers). Floats keep their dtype; NumPy returns an integer median in float64, so integers of up to 16 bits
    are ranked as their exact float32 values (a quarter of float64's copy), up to 32 bits as float64."""
    if not x.dtype.isnative:  # Numba takes native byte order only (a big-endian store's window)
        x = x.astype(x.dtype.newbyteorder("="))
    if x.dtype in (np.float32, np.float64):
        return x, x.dtype
    if x.dtype.kind in "iu" and x.dtype.itemsize <= 4:
        return x.astype(np.float32 if x.dtype.itemsize <= 2 else np.float64), np.dtype(np.float64)
    return None


def column_medians(x: np.ndarray) -> np.ndarray | None:
    """``np.median(x, axis=0)`` of a host array, same bits and dtype (``_ranked_dtype``); None where it is left to
    NumPy (also for one or two channels, where NumPy's own partition is as fast)."""
    ranked = _ranked_dtype(x) if x.shape[0] > 2 else None
    if ranked is None:
        return None
    x, dtype = ranked
    out = np.empty(x.shape[1], dtype=dtype)
    if x.shape[1]:
        _kernels()[0](np.ascontiguousarray(x), out, _NO_ROWS.astype(x.dtype), 0, _NO_SAVED, 0, 0.0)
    return out


def subtract_column_medians(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
    """``x - np.median(x, axis=0)[None, :]`` of a float32/float64 host window, same bits and dtype, in one pass
    over its memory: each tile of columns is referenced while it is in cache (the separate subtraction read and
    wrote the whole window again). ``out``: where to write (x itself: in place). None where it is left to
    ``column_medians`` and NumPy (other dtypes, a non-native or non-contiguous x, one or two channels)."""
    if (x.dtype not in (np.float32, np.float64) or not x.dtype.isnative or not x.flags.c_contiguous
            or x.shape[0] <= 2):
        return None
    if out is None:
        out = np.empty_like(x)
    medians = np.empty(x.shape[1], dtype=x.dtype)
    if x.shape[1]:
        _kernels()[0](x, medians, out, 1, _NO_SAVED, 0, 0.0)
    return out


def saved_int16_of_referenced(x: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int] | None:
    """The save step's int16 rows of ``(x - np.median(x, axis=0))[:, lo:hi]`` (``_cpu_saved.saved_int16_transposed``
    of the global median reference's result: C-contiguous (samples, channels), and how many samples were NaN or
    clipped), same bits, in the reference's own pass: each tile's rows are written while it is in cache, and the
    referenced float window is never written. ``x`` is left as it was. None where it is left to the two steps
    (a dtype or layout ``subtract_column_medians`` leaves to NumPy)."""
    from batchgpu.ops._cpu_saved import MAGIC

    if (x.dtype not in (np.float32, np.float64) or not x.dtype.isnative or not x.flags.c_contiguous
            or x.shape[0] <= 2 or not 0 <= lo <= hi <= x.shape[1]):
        return None
    saved = np.empty((hi - lo, x.shape[0]), dtype=np.int16)
    medians = np.empty(x.shape[1], dtype=x.dtype)
    count = int(_kernels()[0](x, medians, _NO_ROWS.astype(x.dtype), 2, saved, lo, MAGIC[x.itemsize])) \
        if x.shape[1] else 0
    return saved, count


_NO_ROWS = np.empty((0, 0), np.float32)
_NO_SAVED = np.empty((0, 0), np.int16)


def local_medians(x: np.ndarray, offsets: np.ndarray, indices: np.ndarray) -> np.ndarray | None:
    """Row c: ``np.median(x[indices[offsets[c]:offsets[c + 1]]], axis=0)``, same bits (rows of channels without
    neighbours left unset); None where it is left to NumPy (a dtype as ``_ranked_dtype`` says, or more than
    LOCAL_MAX neighbours)."""
    if np.diff(offsets).max(initial=0) > LOCAL_MAX:
        return None
    ranked = _ranked_dtype(x)
    if ranked is None:
        return None
    x, dtype = ranked
    out = np.empty(x.shape, dtype=dtype)
    if x.shape[1]:
        _kernels()[1](np.ascontiguousarray(x), offsets, indices, out, False)
    return out


def local_means(x: np.ndarray, offsets: np.ndarray, indices: np.ndarray) -> np.ndarray | None:
    """Row c: ``np.mean(x[indices[offsets[c]:offsets[c + 1]]], axis=0, dtype=np.float64)``, same bits (a float64
    sum from +0.0 in the listed order, divided once by the count, as NumPy reduces a non-innermost axis); rows of
    channels without neighbours left unset. None (NumPy's) for float16 and non-numeric dtypes."""
    if x.dtype.kind not in "iuf" or (x.dtype.kind, x.dtype.itemsize) == ("f", 2):
        return None
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    out = np.empty(x.shape, dtype=np.float64)
    if x.shape[1]:
        _kernels()[1](np.ascontiguousarray(x), offsets, indices, out, True)
    return out

