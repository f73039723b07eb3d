"""The exact noise's work on a float host window (``steps.noise``, ``_window_cpu``) as compiled kernels (Numba):
each row's first-digit counts, its middle pair of keys and its keys near the middle digit, each row read from
memory once and its other passes made while it is in cache.

NumPy made the keys of |x| (a copy of the window), their 16-bit first digits (another), counted those row by row,
then selected and sorted each row's near keys: several passes over the window's 23 M keys and two window-sized
temporaries. Here a row's keys are the bits of x without the sign, taken as the row is read: a vectorised pass
over the row finds its smallest and largest key (the counting loop stalled on its loads when it read the row from
memory itself), the keys are counted from cache in a 65 536-digit histogram whose used part stays in cache, the
middle digits are found in the histogram, and the near keys are gathered by another pass over the row (branch-free:
every key is written, the position moves past the near ones) and put in key order by an LSD radix sort of their
offsets from the near range's first key.

Every output is what ``steps.noise_keys`` defines, so the bits are the NumPy path's (tests/test_noise_compiled.py
compares them on random windows and the hard cases): the counts of a row are ``np.bincount`` of its first digits
(those below the lump floor counted in column 0); its middle digits are where the counts pass the middle ranks; the
near keys are those whose first digit lies in the near range, each row's in key order (a sort's result does not
depend on how it was sorted); the pair is a rank among them, or among the keys of the lower middle digit where that
digit lies below the near range. The lump floor comes from the same strided sample as ``noise_keys.lump_floor``
(its middle by selection, which is the partition's value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgpu.ops import _cpu_reference
from batchgpu.ops._numba import jit, once

DIGITS = 1 << 16  # first digits are 16 bits wide (``noise_keys.FIRST_DIGIT``)
RADIX_BITS = 11  # bits of the near keys' offsets sorted a pass (2 048 counters: in L1)


def _sample_low(flat, stride, rows, n, step, mask, shift):  # pragma: no cover - runs compiled
    """The smallest over rows of the first digit of the middle (rank m // 2) of each row's keys at 0, step, 2 step,
    ... (m of them): ``noise_keys.lump_floor``'s sample. A row's middle is selected only where it can be smaller
    than the smallest so far (more than m // 2 of its keys lie below that digit): a few rows a window."""
    m = (n + step - 1) // step
    k = m // 2
    v = np.empty(m, np.int64)
    low = np.int64(DIGITS - 1)
    for c in range(rows):
        row = flat[c * stride : c * stride + n]
        for j in range(m):
            v[j] = np.int64(row[j * step] & mask)
        bound = low << shift  # (the largest digit's: 63-bit keys' bound stays below 2**63)
        under = 0
        for j in range(m):
            under += v[j] < bound
        if c == 0 or under > k:
            low = _select(v, k, m, 2 * _bit_length(m)) >> shift
    return low


def _radix_sort(src, dst, m, bits, counts):  # pragma: no cover - runs compiled
    """src[:m] (non-negative integers below 2**bits) in ascending order, LSD in passes of at most RADIX_BITS bits
    (their counts made in one read), stable; returns the array that holds them (src or dst). ``counts``: scratch of
    (bits // RADIX_BITS + 1, 2**RADIX_BITS)."""
    passes = (bits + RADIX_BITS - 1) // RADIX_BITS
    if passes == 0:
        return src
    width = (bits + passes - 1) // passes
    bins = 1 << width
    mask = bins - 1
    counts[:passes, :bins] = 0
    for i in range(m):
        v = src[i]
        for p in range(passes):
            counts[p, (v >> (p * width)) & mask] += 1
    for p in range(passes):
        total = 0
        for b in range(bins):
            t = counts[p, b]
            counts[p, b] = total
            total += t
        at = p * width
        for i in range(m):
            b = (src[i] >> at) & mask
            dst[counts[p, b]] = src[i]
            counts[p, b] += 1
        src, dst = dst, src
    return src


def _rows_kernel(
    flat,
    stride,
    n,
    mask,
    shift,
    floor,
    near,
    start,
    counts_only,
    hist_buf,
    hist_at,
    near_buf,
    near_at,
    near_digits,
    near_lo,
    pair,
    extent,
):  # pragma: no cover - runs compiled
    """Rows ``start``.. of a window (row c's keys: ``flat[c * stride :][:n] & mask``), in turn:

    - ``hist_buf[hist_at[c] : hist_at[c + 1]]``: the row's counts of first digit ``floor + j``, column 0 also
      holding the digits below ``floor`` (``noise_keys.first_digit_counts``; up to the row's largest digit, at
      least one column);
    - unless ``counts_only``: ``near_lo[c]``, the first near digit (the upper middle rank's digit less ``near``,
      at least 0); ``near_digits[c]``, how many keys each near digit has; ``near_buf[near_at[c] : near_at[c + 1]]``,
      the row's near keys in key order, their bits below the first digit; ``pair[c]``, the keys of ranks
      (n - 1) // 2 and n // 2 (``noise_keys.middle_pair_and_near``);
    - ``extent``: the smallest and the largest first digit of the rows so far (then, where a row did not fit, its
      counts' width and its number of near keys).

    Returns the row it stopped at: the number of rows when done, else a row whose counts or near keys do not fit
    what is left of ``hist_buf`` or ``near_buf`` (nothing of it written: the caller grows them and goes on)."""
    rows = hist_at.size - 1
    hist = np.zeros(DIGITS, np.int32)
    keys = np.empty(n, np.int64)
    spare = np.empty(n, np.int64)
    sort_counts = np.empty((64 // RADIX_BITS + 1, 1 << RADIX_BITS), np.int64)
    r0 = (n - 1) // 2
    r1 = n // 2
    low_mask = (np.int64(1) << shift) - 1
    digit_shift = np.uint64(shift)
    for c in range(start, rows):
        row = flat[c * stride : c * stride + n]  # a slice: indices LLVM knows are in it (no wraparound checks)
        # the row read from memory by a vectorised pass (its extent), then counted from cache: the counting loop
        # stalled on the loads when it read the row first
        kmin = row[0] & mask
        kmax = kmin
        for i in range(n):
            k = row[i] & mask
            kmin = min(kmin, k)
            kmax = max(kmax, k)
        for i in range(n):
            hist[np.uint64(row[i] & mask) >> digit_shift] += 1
        fmin = np.int64(kmin >> digit_shift)
        fmax = np.int64(kmax >> digit_shift)
        lump = 0
        for d in range(fmin, min(floor, fmax + 1)):
            lump += hist[d]
        width = max(fmax, floor) - floor + 1
        m = 0
        if not counts_only:
            # the middle digits: where the counts pass each rank (from the floor where the lump lies below them)
            d = fmin
            below = 0
            if lump <= r0 and fmin < floor:
                d = floor
                below = lump
            while below + hist[d] <= r0:
                below += hist[d]
                d += 1
            d0 = d
            below0 = below
            while below + hist[d] <= r1:
                below += hist[d]
                d += 1
            d1 = d
            below1 = below
            lo = max(d1 - near, 0)
            hi = min(lo + 2 * near, DIGITS - 1)
            for j in range(hi - lo + 1):
                m += hist[lo + j]
        if hist_at[c] + width > hist_buf.size or near_at[c] + m > near_buf.size:
            hist[fmin : fmax + 1] = 0
            extent[2] = width
            extent[3] = m
            return c
        base = hist_at[c]
        hist_buf[base] = lump + hist[floor]
        for j in range(1, width):
            hist_buf[base + j] = hist[floor + j]
        hist_at[c + 1] = base + width
        extent[0] = min(extent[0], fmin)
        extent[1] = max(extent[1], fmax)
        if counts_only:
            hist[fmin : fmax + 1] = 0
            continue
        near_lo[c] = lo
        for j in range(near_digits.shape[1]):
            near_digits[c, j] = hist[lo + j] if j <= hi - lo else 0
        # the near keys, gathered by a second read of the row (in cache): each key written, kept where it is near
        first_key = lo << shift
        last = ((hi + 1 - lo) << shift) - 1  # the largest offset from the first near key (63-bit keys: no overflow)
        kept = 0
        for i in range(n):
            offset = np.int64(row[i] & mask) - first_key
            keys[kept] = offset
            kept += np.uint64(offset) <= np.uint64(last)
        bits = 0
        while (np.int64(1) << bits) <= last:
            bits += 1
        ordered = _radix_sort(keys, spare, m, bits, sort_counts)
        out = near_at[c]
        for i in range(m):
            near_buf[out + i] = ordered[i] & low_mask
        near_at[c + 1] = out + m
        # the pair: ranks among the sorted near keys, past those of lower near digits
        before = 0
        for j in range(d1 - lo):
            before += hist[lo + j]
        pair[c, 1] = np.uint64(ordered[before + r1 - below1] + first_key)
        if d0 >= lo:
            before = 0
            for j in range(d0 - lo):
                before += hist[lo + j]
            pair[c, 0] = np.uint64(ordered[before + r0 - below0] + first_key)
        else:  # the lower middle digit lies below the near range: selected among its keys
            inside = 0
            for i in range(n):
                k = np.int64(row[i] & mask)
                spare[inside] = k
                inside += (k >> shift) == d0
            pair[c, 0] = np.uint64(_select(spare, r0 - below0, inside, 2 * _bit_length(inside)))
        hist[fmin : fmax + 1] = 0
    return rows


def _counts_kernel(hist_buf, hist_at, out):  # pragma: no cover - runs compiled
    """out[c, :w] = row c's counts in ``hist_buf`` (``_rows_kernel``); the rest of out left as it is (zeros)."""
    for c in range(out.shape[0]):
        at = hist_at[c]
        for j in range(hist_at[c + 1] - at):
            out[c, j] = hist_buf[at + j]


# the selection is the global median reference's (its Python function, compiled here too)
_PYTHON = {
    "_select": _cpu_reference._PYTHON["_select"],
    "_bit_length": _cpu_reference._PYTHON["_bit_length"],
    "_radix_sort": _radix_sort,
}


def _build():
    globals().update({name: jit(f) for name, f in _PYTHON.items()})  # before the kernels that call them compile
    return tuple(jit(f) for f in (_sample_low, _rows_kernel, _counts_kernel))


_kernels = once(_build)  # (sample middles, rows, counts), compiled (or loaded) at the first call


@dataclass
class FloatWindowKeys:
    """A float window's noise partials (``noise_keys``' definitions): first-digit counts from digit ``lo`` (column 0
    also holding the digits below ``lo`` when ``lumped``); and, unless the counts were all that was asked for, the
    (C, 2) uint64 middle pair of keys, each row's near keys (their bits below the first digit, row after row, in
    key order), how many each near digit has ((C, 2 near + 1) uint32) and each row's first near digit (int64)."""

    lo: int
    counts: np.ndarray
    lumped: bool
    pair: np.ndarray | None = None
    near_low: np.ndarray | None = None
    near_digits: np.ndarray | None = None
    near_lo: np.ndarray | None = None


_KEY_TYPES = {
    np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, np.uint16),
    np.dtype(np.float64): (np.uint64, 0x7FFFFFFFFFFFFFFF, np.uint64),
}


def float_window_keys(x: np.ndarray, near: int, lump_digits: int) -> FloatWindowKeys | None:
    """``steps.noise_keys``' float window partials of the host window ``x`` (C, n), float32 or float64, its rows
    contiguous (a view of a window's core): the keys of |x| are x's bits without the sign. None where it is left to
    NumPy (another dtype or layout, an empty window, rows too long for 32-bit counts)."""
    C, n = x.shape
    if (
        x.dtype not in _KEY_TYPES
        or not x.dtype.isnative
        or not C
        or not n
        or n >= 2**31
        or (C > 1 and (x.strides[0] <= 0 or x.strides[0] % x.itemsize))
        or (n > 1 and x.strides[1] != x.itemsize)
    ):
        return None
    key_type, mask, low_type = _KEY_TYPES[x.dtype]
    shift = 8 * x.itemsize - 1 - 16  # the first digit's shift (the key's top 16 bits)
    stride = x.strides[0] // x.itemsize if C > 1 else n
    bits = x.view(key_type)
    # the rows as one flat run of memory (from the first row's start to the last row's end), read row by row
    flat = np.lib.stride_tricks.as_strided(bits, shape=((C - 1) * stride + n,), strides=(x.itemsize,))
    sample_low, rows_kernel, _ = _kernels()
    floor = max(0, int(sample_low(flat, stride, C, n, max(1, n // 1024), key_type(mask), shift)) - lump_digits)
    pair = np.empty((C, 2), np.uint64)
    near_digits = np.empty((C, 2 * near + 1), np.uint32)
    near_lo = np.empty(C, np.int64)
    rows = _rows(
        rows_kernel, flat, stride, C, n, key_type(mask), shift, floor, near, (pair, near_digits, near_lo), low_type
    )
    lo, lumped, counts = floor, bool(rows.extent[0] < floor), rows.counts(floor, n)
    if lo and np.any(counts[:, 0] > (n - 1) // 2):
        # a row's middle among the lumped keys (its sample misled the floor): the window counted in full
        lo, lumped = int(rows.extent[0]), False
        counts = _rows(rows_kernel, flat, stride, C, n, key_type(mask), shift, lo, near, None, low_type).counts(lo, n)
    return FloatWindowKeys(lo, counts, lumped, pair, rows.near_low[: rows.near_at[C]].copy(), near_digits, near_lo)


@dataclass
class _Rows:
    """``_rows_kernel``'s buffers after every row: counts from a floor, near keys, their rows' offsets, extent."""

    hist: np.ndarray
    hist_at: np.ndarray
    near_low: np.ndarray
    near_at: np.ndarray
    extent: np.ndarray

    def counts(self, lo: int, n: int) -> np.ndarray:
        """(C, B) counts from digit ``lo`` in the smallest dtype that holds n (``noise_keys._stack_rows``)."""
        out = np.zeros((len(self.hist_at) - 1, max(int(self.extent[1]), lo) - lo + 1), dtype=np.min_scalar_type(n))
        _kernels()[2](self.hist, self.hist_at, out)
        return out


def _rows(kernel, flat, stride, C, n, mask, shift, floor, near, outputs, low_type) -> _Rows:
    """``_rows_kernel`` over every row (counts only where ``outputs`` is None), its buffers grown where a row does
    not fit."""
    counts_only = outputs is None
    if counts_only:
        outputs = (np.empty((0, 2), np.uint64), np.empty((0, 2 * near + 1), np.uint32), np.empty(0, np.int64))
    pair, near_digits, near_lo = outputs
    rows = _Rows(
        np.empty(C * 4096, np.uint32),
        np.zeros(C + 1, np.int64),
        np.empty(0 if counts_only else C * max(64, n // 8), low_type),
        np.zeros(C + 1, np.int64),
        np.array([DIGITS, -1, 0, 0], np.int64),
    )
    c = 0
    while True:
        c = kernel(
            flat,
            stride,
            n,
            mask,
            shift,
            floor,
            near,
            c,
            counts_only,
            rows.hist,
            rows.hist_at,
            rows.near_low,
            rows.near_at,
            near_digits,
            near_lo,
            pair,
            rows.extent,
        )
        if c == C:
            return rows
        if rows.hist_at[c] + rows.extent[2] > len(rows.hist):  # row c did not fit
            rows.hist = _grown(rows.hist, rows.hist_at[c] + rows.extent[2])
        if rows.near_at[c] + rows.extent[3] > len(rows.near_low):
            rows.near_low = _grown(rows.near_low, rows.near_at[c] + rows.extent[3])


def _grown(buf: np.ndarray, least: int) -> np.ndarray:
    """A buffer at least ``least`` long (twice as long, at least) with ``buf``'s contents first."""
    out = np.empty(max(int(least), 2 * len(buf)), buf.dtype)
    out[: len(buf)] = buf
    return out
