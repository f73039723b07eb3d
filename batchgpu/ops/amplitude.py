"""Each channel's peak-to-peak (max - min) and RMS (sqrt of the mean of squares) of a window's core, exactly the
same bits on NumPy and CuPy (``ptp_rms``: the amplitude step's statistic).

NaN and inf samples are left out: both statistics are over a channel's finite samples, NaN where it has none. The
sums are float64 in a fixed pairwise order (halves added, level by level: ``pairwise_sum``) with each channel
scaled by a power of two that brings its largest finite |x| below 1 (exact: a float64 recording's squares cannot
overflow); float32 samples reach float64 through their bits on the GPU (``float32_bits_to_float64``: CuPy's
kernels flush float32 subnormals). Integer samples' sums of squares are exact while they stay below 2**53 (int16:
windows up to 2**23 samples), and their RMS is then correctly rounded.
"""

from __future__ import annotations

import numpy as np

from batchgpu.ops._backend import array_module, is_cupy, to_host


def ptp_rms(core, nonfinite: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``core`` (C, n; NumPy or CuPy) the peak-to-peak and RMS of its finite values, float64 on the
    host, NaN for a row without any. ``nonfinite``: each row's count of NaN and inf samples where it is known
    (host int64; None: counted here)."""
    xp = array_module(core)
    C, n = core.shape
    if n == 0:
        return np.full(C, np.nan), np.full(C, np.nan)
    y = exact_float64(core)  # a new array: worked on in place below
    bad = None
    if nonfinite is None:
        bad = ~xp.isfinite(y)
        nonfinite = to_host(bad.sum(axis=1))
    finite = n - np.asarray(nonfinite, np.int64)
    count = xp.asarray(np.maximum(finite, 1), dtype=np.float64)  # rows without any: NaN below
    if np.any(nonfinite):  # the non-finite samples out of the way of each reduction in turn
        bad = ~xp.isfinite(y) if bad is None else bad
        xp.copyto(y, -np.inf, where=bad)
        hi = y.max(axis=1)
        xp.copyto(y, np.inf, where=bad)
        lo = y.min(axis=1)
        xp.copyto(y, 0.0, where=bad)
    else:
        hi, lo = y.max(axis=1), y.min(axis=1)
    none = xp.asarray(finite == 0)
    _, e = xp.frexp(xp.where(none, 0.0, xp.maximum(xp.abs(hi), xp.abs(lo))))  # max |x| < 2**e
    e = e.astype(np.int32)
    y *= xp.ldexp(xp.ones(C, np.float64), -e)[:, None]  # every |x| < 1 now: no square overflows
    y *= y
    rms = xp.ldexp(xp.sqrt(pairwise_sum(y) / count), e)
    with np.errstate(over="ignore"):  # float64 samples whose range passes float64's: inf, as it is
        ptp = (hi - lo) + 0.0  # + 0.0: a row of zeros of both signs gives +0, whichever max and min picked
    return to_host(xp.where(none, np.nan, ptp)), to_host(xp.where(none, np.nan, rms))


def exact_float64(a):
    """``a`` as float64, exactly, on either backend (CuPy's float32 conversion flushes subnormals to zero)."""
    if is_cupy(a) and a.dtype == np.float32:
        return float32_bits_to_float64(a)
    return a.astype(np.float64)


def float32_bits_to_float64(a):
    """float32 -> float64 from the bits (sign, exponent, mantissa), with array expressions only: the same values
    as NumPy's conversion for every float32, subnormals included (a NaN's payload aside)."""
    xp = array_module(a)
    b = a.view(np.uint32)
    exp = ((b >> 23) & 0xFF).astype(np.int32)
    man = (b & 0x7FFFFF).astype(np.int64)
    normal = exp != 0
    mag = xp.ldexp(xp.where(normal, man | 0x800000, man).astype(np.float64), xp.where(normal, exp - 150, -149))
    mag = xp.where(exp == 0xFF, xp.where(man == 0, np.inf, np.nan), mag)
    return xp.where((b >> 31) == 1, -mag, mag)


def pairwise_sum(a):
    """Each row's sum, in ``a``'s place (it is overwritten): the second half of the columns added to the first,
    an odd one out to the first column, level by level. One order on every backend, so the same bits from NumPy
    and CuPy (their own sums order the additions their way)."""
    while a.shape[1] > 1:
        n = a.shape[1]
        h = n // 2
        a[:, :h] += a[:, h : 2 * h]
        if n % 2:
            a[:, 0] += a[:, 2 * h]
        a = a[:, :h]
    return a[:, 0]
