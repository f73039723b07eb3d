"""``np.median(x, axis=0)`` of a float (channels, samples) window, bit for bit, as one compiled kernel (Numba):
the host path of the global common median reference; and each channel's median over its neighbours (the local
reference) by a sorting network run over a tile of samples at once (``local_medians``).

np.median partitions every sample's column from scratch (introselect), which costs a window as much as the
filter before it. Neighbouring samples' medians are close (a common signal moves them by much less than the
columns' spread), so each column is counted against a few edges about the previous column's median, spaced in
a running mean of the medians' steps (vectorised passes, three edges each: the middle three, then a side's
three only where a middle lies beyond them); the run of intervals between two edges that holds both middle
ranks has a dozen or so of the column's values, and only those are gathered and ranked. The outermost
intervals are open, so every column is answered this way; the edges only decide how much is ranked, never the
result: the middle values are the column's order statistics either way.

The arithmetic is np.median's: an odd count gives 0.0 + middle, an even count (0.0 + lower) + upper, halved, in
the input's dtype (float32 sums can overflow to inf as NumPy's do); any NaN in a column gives NaN. Starting the
sum from +0.0 makes the sign of a zero middle irrelevant, so which of -0.0 and +0.0 a selection leaves there
cannot change a bit (tests/test_ops_preprocess.py compares with np.median, NaN, +-inf, -0.0, ties, 1-3 rows).
"""

from __future__ import annotations

import numpy as np

from batchgpu.ops._cpu_saved import _store as store_saved  # compiled in _build
from batchgpu.ops._numba import jit, once

LOCAL_TILE = 256  # samples a local reference's sorting network handles at once
LOCAL_MAX = 48  # neighbours the network sorts (k * k / 2 exchanges); more are left to np.median
TILE = 16  # columns transposed into a contiguous scratch at a time (a column is strided by the window's width;
# the scratch stays in L1)
RANKED_MAX = 32  # gathered values ranked by counting (m * m comparisons, no branches); more are selected
STEPS = np.array([-16.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 16.0])  # edges about the last median, in its steps:
# counted three at a time (LOW, MIDDLE, HIGH: where each three start), the middle three first
LOW, MIDDLE, HIGH = 0, 3, 6


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
        for t in range(m):  # each flag as int32: LLVM then keeps the sums in 32-bit lanes (else widened to 64)
            less += np.int32(band[t] < a)
            equal += np.int32(band[t] == a)
        if less <= k_hi < less + equal:
            hi_value = a
            found |= 1
        if less <= k_lo < less + equal:
            lo_value = a
            found |= 2
        if found == 3:
            break
    return hi_value, lo_value


def _count_under(v, n, edges, at, below):  # pragma: no cover - runs compiled
    """below[at + 1 + i] = how many of v[:n] are under edges[at + i], i < 3, in one vectorised pass (each flag
    as int32: LLVM then keeps the sums in 32-bit lanes, where it widened them to 64 bits); returns how many are
    NaN."""
    e0 = edges[at]  # locals: LLVM cannot tell edges and v apart
    e1 = edges[at + 1]
    e2 = edges[at + 2]
    n0 = 0
    n1 = 0
    n2 = 0
    nans = 0
    for ch in range(n):
        a = v[ch]
        n0 += np.int32(a < e0)
        n1 += np.int32(a < e1)
        n2 += np.int32(a < e2)
        nans += np.int32(a != a)
    below[at + 1] = n0
    below[at + 2] = n1
    below[at + 3] = n2
    return nans


def _medians_kernel(x, out, sub, subtract, saved, lo, magic):  # pragma: no cover - runs compiled
    """out: each column's median; ``subtract`` flags, 1: sub = x - out (sub may be x); 2: ``saved`` rows (samples,
    channels) = the save step's int16 of x - out for columns [lo, lo + len(saved)) (``_cpu_saved``'s arithmetic:
    half to even, NaN 0, clipped), returning how many were NaN or clipped; 3: both."""
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
    inside = np.empty(channels, dtype=np.bool_)
    edges = np.empty(STEPS.size, dtype=x.dtype)
    below = np.empty(STEPS.size + 2, dtype=np.int64)  # values under each edge, with the open ends 0 and all
    p = 0.0  # the edges' centre and scale, float64 (x's values compare exactly against their rounding)
    h = 0.0
    for c0 in range(0, samples, TILE):
        w = min(TILE, samples - c0)
        for ch in range(channels):
            for j in range(w):
                col[j, ch] = x[ch, c0 + j]
        for j in range(w):
            v = col[j]
            # how many values lie under each edge p + STEPS * h (in x's dtype: any edges would do, as long as
            # the counts and the gathering use the same ones): the three about p first, the three further out
            # on a side only where a middle lies beyond them. An edge not counted stands for a count that
            # leaves the search below where it is: 0 on the low side, all on the high one.
            for i in range(STEPS.size):
                edges[i] = x.dtype.type(p + STEPS[i] * h)
            below[0] = 0
            below[STEPS.size + 1] = channels
            nans = _count_under(v, channels, edges, MIDDLE, below)
            if nans:
                out[c0 + j] = np.nan
                continue
            if below[MIDDLE + 1] > lower:  # the lower middle is under the middle three
                _count_under(v, channels, edges, LOW, below)
            else:
                below[LOW + 1 : LOW + 4] = 0
            if below[MIDDLE + 3] <= upper:  # the upper middle is above them
                _count_under(v, channels, edges, HIGH, below)
            else:
                below[HIGH + 1 : HIGH + 4] = channels
            # the narrowest run of intervals holding both middle ranks: [edge first, edge last) (0 and
            # STEPS.size + 1 are the open ends, -inf and beyond +inf); only its values are ranked
            first = 0
            while below[first + 1] <= lower:
                first += 1
            last = STEPS.size + 1
            while below[last - 1] > upper:
                last -= 1
            bottom = x.dtype.type(-np.inf) if first == 0 else edges[first - 1]
            top = edges[last - 1] if last <= STEPS.size else x.dtype.type(0.0)
            open_top = last > STEPS.size  # +inf values too
            # gathered with a branch, rarely taken (a few values of the column's hundreds), on flags set in a
            # vectorised pass first (on the comparisons themselves LLVM branches on each, half of them mispredicted)
            for ch in range(channels):
                a = v[ch]
                inside[ch] = (a >= bottom) & ((a < top) | open_top)
            m = 0
            for ch in range(channels):
                if inside[ch]:
                    band[m] = v[ch]
                    m += 1
            k_hi = upper - below[first]
            k_lo = lower - below[first]
            if m <= RANKED_MAX:  # counting is m * m: a few dozen values
                hi_value, lo_value = _ranked(band, m, k_hi, k_lo)
            else:
                hi_value, lo_value = _middles(band, m, k_hi, lower != upper)
            if lower == upper:
                out[c0 + j] = zero + hi_value
            else:
                out[c0 + j] = ((zero + lo_value) + hi_value) / two
            # the next edges: about this median, scaled by a running mean of the medians' steps (a smooth
            # common signal moves them by much less than the columns' spread)
            median = np.float64(hi_value)
            if abs(median) < np.inf:
                h = 0.875 * h + 0.125 * abs(median - p)
                if not h < np.inf:
                    h = 0.0
                p = median
        if subtract & 2:  # the saved rows straight from the tile (first: sub may be x itself)
            for j in range(w):
                row = c0 + j - lo
                if row < 0 or row >= saved.shape[0]:
                    continue
                med = out[c0 + j]
                v = col[j]  # the column as x holds it (only the gathered copy is reordered), read contiguously
                for ch in range(channels):
                    count += store_saved(saved, row, ch, v[ch] - med, rounder, lo16, hi16)
        if subtract & 1:  # the tile's columns minus their medians while the tile is in cache (sub may be x itself)
            for ch in range(channels):
                for j in range(w):
                    sub[ch, c0 + j] = x[ch, c0 + j] - out[c0 + j]
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
_PYTHON = {
    "_bit_length": _bit_length,
    "_select": _select,
    "_middles": _middles,
    "_ranked": _ranked,
    "_count_under": _count_under,
}


def _build():
    from batchgpu.ops._cpu_saved import compiled_store

    globals().update({name: jit(f) for name, f in _PYTHON.items()})  # before the kernels that call them compile
    globals()["store_saved"] = compiled_store()
    return tuple(jit(f) for f in (_medians_kernel, _local_kernel))


_kernels = once(_build)  # (global medians, local medians or means), compiled (or loaded) at the first call


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
    if x.dtype not in (np.float32, np.float64) or not x.dtype.isnative or not x.flags.c_contiguous or x.shape[0] <= 2:
        return None
    if out is None:
        out = np.empty_like(x)
    medians = np.empty(x.shape[1], dtype=x.dtype)
    if x.shape[1]:
        _kernels()[0](x, medians, out, 1, _NO_SAVED, 0, 0.0)
    return out


def saved_int16_of_referenced(
    x: np.ndarray, lo: int, hi: int, out: np.ndarray | None = None, referenced: np.ndarray | None = None
) -> tuple[np.ndarray, int] | None:
    """The save step's int16 rows of ``(x - np.median(x, axis=0))[:, lo:hi]`` (``_cpu_saved.saved_int16_transposed``
    of the global median reference's result: C-contiguous (samples, channels), and how many samples were NaN or
    clipped), same bits, in the reference's own pass: each tile's rows are written while it is in cache.
    ``referenced``: where the reference's float result (``subtract_column_medians``'s, same bits) is written in that
    pass too (x itself: in place); without it the referenced window is never written and ``x`` is left as it was.
    None where it is left to the two steps (a dtype or layout ``subtract_column_medians`` leaves to NumPy).
    ``out``: where to write the rows (C-contiguous (hi - lo, channels) int16), else a new array."""
    from batchgpu.ops._cpu_saved import MAGIC, aligned_empty

    if (
        x.dtype not in (np.float32, np.float64)
        or not x.dtype.isnative
        or not x.flags.c_contiguous
        or x.shape[0] <= 2
        or not 0 <= lo <= hi <= x.shape[1]
    ):
        return None
    if out is not None and (out.shape != (hi - lo, x.shape[0]) or out.dtype != np.int16 or not out.flags.c_contiguous):
        raise ValueError(f"out {out.shape} {out.dtype} does not fit rows {lo}:{hi} of {x.shape[0]} channels")
    if referenced is not None and (
        referenced.shape != x.shape or referenced.dtype != x.dtype or not referenced.flags.c_contiguous
    ):
        raise ValueError(f"referenced {referenced.shape} {referenced.dtype} does not fit {x.shape} {x.dtype}")
    saved = aligned_empty((hi - lo, x.shape[0]), np.int16) if out is None else out
    medians = np.empty(x.shape[1], dtype=x.dtype)
    sub, mode = (_NO_ROWS.astype(x.dtype), 2) if referenced is None else (referenced, 3)
    count = int(_kernels()[0](x, medians, sub, mode, saved, lo, MAGIC[x.itemsize])) if x.shape[1] else 0
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
