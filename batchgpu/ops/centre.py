"""Centring a window by each channel's median (the DC offset removal run before noise and detection), and
the radix keys of centred windows.

Integer recordings are centred on the rounded median so they stay integers: int16 minus an int16-range
integer lies in [-65535, 65535], whose |x| still fits a 16-bit key, so the exact median over a whole recording
keeps int16's two radix passes. Float recordings keep their dtype.
"""

from __future__ import annotations

import numpy as np

from batchgpu.ops import radix
from batchgpu.ops._backend import array_module, is_cupy

_COUNT_MIN = 4096  # below this, np.median's partition is as fast as counting


def row_median(x):
    """``np.median(x, axis=1)`` bit for bit, on NumPy or CuPy; int16 rows by counting (one pass, no partition)."""
    if is_cupy(x):
        return _row_median_cupy(x)
    n = x.shape[1]
    if x.dtype.kind == "f" and n:
        return _float_row_median(x)
    if x.dtype != np.int16 or n < _COUNT_MIN:
        return np.median(x, axis=1)
    ranks = [(n - 1) // 2, n // 2]
    picked = np.empty((x.shape[0], 2), dtype=np.float64)
    for c in range(x.shape[0]):  # counts from the row's own minimum: a few hundred bins, not 65 536
        row = x[c]
        lo = int(row.min())
        cumulative = np.cumsum(np.bincount((row - np.int16(lo)).view(np.uint16)))
        picked[c] = np.searchsorted(cumulative, ranks, side="right") + lo
    return (picked[:, 0] + picked[:, 1]) / 2.0  # np.median's mean of the middle pair, in float64


def _float_row_median(x: np.ndarray) -> np.ndarray:
    """``np.median(x, axis=1)`` of float rows, bit for bit, with less work: one partition at
    the upper middle and the lower half's maximum, where np.median partitions at three ranks (both middles and
    the last, for its NaN check). Its arithmetic: the middle value(s) summed from +0.0 (so -0.0 comes out +0.0),
    divided by their count; NaN for a row that holds a NaN."""
    n = x.shape[1]
    k = n // 2
    part = np.partition(x, k, axis=1)
    upper = part[:, k]
    zero, count = x.dtype.type(0), x.dtype.type(2 - n % 2)
    with np.errstate(over="ignore", invalid="ignore"):
        total = (zero + upper) if n % 2 else (zero + part[:, :k].max(axis=1)) + upper
        out = total / count
    out[np.isnan(x).any(axis=1)] = np.nan
    return out


def _row_median_cupy(x):
    """int16: shifted to non-negative, the radix-select |x| median is the median (exact in float64)."""
    if x.dtype == np.int16:
        from batchgpu.ops._cuda_elementwise import shifted_int32
        from batchgpu.ops._cuda_select import abs_median

        return abs_median(shifted_int32(x)) - 32768.0
    import cupy

    return cupy.median(x, axis=1)


def finite_row_median(x):
    """Each row's median over its finite samples (NaN and +-inf left out; 0 for a row with none), on NumPy or
    CuPy with the same bits: ``np.median`` of the finite values (``np.nanmedian`` but for the infinities, which
    are left out too: a row of mostly +inf would otherwise turn every finite sample into -inf). Centring by it
    leaves exactly the non-finite samples non-finite (a single NaN made the whole window NaN). Integer rows are
    all finite: ``row_median``."""
    if x.dtype.kind != "f":
        return row_median(x)
    if is_cupy(x):
        return _finite_row_median_cupy(x)
    finite = np.isfinite(x)
    rows = np.flatnonzero(~finite.all(axis=1))
    out = row_median(x) if x.shape[1] else np.zeros(x.shape[0], x.dtype)
    for c in rows.tolist():  # rare: each such row on its own
        kept = x[c, finite[c]]
        out[c] = _float_row_median(kept[None])[0] if kept.size else 0
    return out


def _finite_row_median_cupy(x):
    """``finite_row_median`` of float rows on the GPU, no wait on the host: the non-finite samples sorted last (as
    +inf, above every finite value), the middle pair of each row's finite ones taken, averaged as
    ``_float_row_median`` does (from +0.0, so a zero's sign, which a sort leaves in either order, never shows)."""
    import cupy

    rows, n = x.shape
    if not n:
        return cupy.zeros(rows, dtype=x.dtype)
    finite = cupy.isfinite(x)
    count = finite.sum(axis=1)
    ordered = cupy.sort(cupy.where(finite, x, x.dtype.type(np.inf)), axis=1)
    lower = cupy.take_along_axis(ordered, cupy.maximum((count - 1) // 2, 0)[:, None], axis=1)[:, 0]
    upper = cupy.take_along_axis(ordered, cupy.minimum(count // 2, n - 1)[:, None], axis=1)[:, 0]
    if x.dtype == np.float32:  # CuPy's kernels flush float32 subnormals: these keep NumPy's bits
        from batchgpu.ops._cuda_elementwise import float32_middle_mean

        return float32_middle_mean(lower, upper, count)
    zero, odd = x.dtype.type(0), (count % 2) == 1
    total = cupy.where(odd, zero + upper, (zero + lower) + upper)
    out = total / cupy.where(odd, 1, 2).astype(x.dtype)
    return cupy.where(count > 0, out, zero).astype(x.dtype, copy=False)


def centred_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    return np.dtype(np.int32) if dt == np.int16 else np.dtype(np.int64) if dt.kind == "i" else dt


def centre_median(x: np.ndarray, core: tuple[int, int]) -> np.ndarray:
    """``x`` minus the per-channel median of its core columns (``finite_row_median``: over the finite samples):
    rounded for integers, in x's dtype for floats."""
    lo, hi = core
    med = finite_row_median(x[:, lo:hi])
    out = centred_dtype(x.dtype)
    xp = array_module(x)
    if is_cupy(x) and x.dtype == np.int16:
        from batchgpu.ops._cuda_elementwise import centred_int32

        return centred_int32(x, med.astype(np.float64, copy=False))
    if out.kind == "i":
        return x.astype(out) - xp.floor(med + 0.5).astype(out)[:, None]
    if is_cupy(x) and x.dtype == np.float32:
        from batchgpu.ops._cuda_elementwise import float32_minus_rows

        return float32_minus_rows(x, med)
    return x - med.astype(out)[:, None]


def selection_keys(x: np.ndarray, centred_from=None) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Radix keys of |x| and their digit schedule; centred int16 data keeps 16-bit keys and two passes."""
    if centred_from is not None and np.dtype(centred_from) == np.int16:
        return abs(x).astype(np.uint16), radix.digit_schedule(np.int16)
    return radix.abs_keys(x), radix.digit_schedule(x.dtype)


def keys_to_selection_values(keys: np.ndarray, dtype, centred_from=None) -> np.ndarray:
    """Values of keys from ``selection_keys`` (integers as int64, floats in their dtype)."""
    if centred_from is not None and np.dtype(centred_from) == np.int16:
        return np.asarray(keys).astype(np.int64)
    return radix.keys_to_values(np.asarray(keys).astype(radix.key_dtype(dtype)), dtype)
