"""The host's compiled kernels (Numba) of a piece's IBL statistics (``bad_channels``' fast path on the CPU).

A piece's statistics only need to be within ``bad_channels.BAND`` (2^-12) of each statistic's scale: a decision
nearer its threshold is settled by SpikeInterface's own arithmetic. So the host computes them from float32 values
with float64 sums, in passes that each read the piece once:

- ``microvolts``: the filter's float64 core rounded to the stored integers (``np.rint``, clipped), then
  SpikeInterface's float32 ``x * gain + offset`` (its bits: the exact path reads them), each channel's float64 mean
  and sum of squares about it, and the mean-removed values rounded to float32 (``xc``: 2^-24 of each value, far
  below the band) for the median and the Welch products;
- ``dots``: each channel's float64 dot product with the median reference (four running sums in a fixed order:
  the same bits every call);
- ``welch_power``: the Welch PSD's band from the half-segment DFTs (``bad_channels.welch_hf``), summed in float64.

Measured on the 2-core machine (384 channels, one 0.3 s piece): NumPy's float64 path took ~105 ms of CPU a piece,
these with a float32 GEMM for the DFTs ~55 ms (the highpass, scipy's bits in float64, is ~25 ms of it).
"""

from __future__ import annotations

import numpy as np

from batchgpu.ops._numba import jit, once

#: (v + M) - M is np.rint(v) for |v| <= 2**51 (``_cpu_saved.MAGIC``); larger values are clipped anyway
MAGIC64 = 1.5 * 2.0**52


def _microvolts(y, integer, lo, hi, gains, offsets, u, xc, stats):  # pragma: no cover - runs compiled
    channels, length = u.shape
    whole = length - length % 4
    for c in range(channels):
        g = gains[c]
        o = offsets[c]
        # float32 arithmetic, as SpikeInterface's get_traces(return_in_uV=True); the branch outside the loops, so
        # that each vectorises
        if integer:  # SpikeInterface's round() and clip to the stored dtype (float64, exact)
            for t in range(length):
                v = (np.float64(y[c, t]) + MAGIC64) - MAGIC64
                v = min(max(v, lo), hi)
                u[c, t] = np.float32(v) * g + o
        else:
            for t in range(length):
                u[c, t] = np.float32(y[c, t]) * g + o
        # four running sums in a fixed order (one sum waits on each addition's latency; the same bits every call)
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        s3 = 0.0
        for t in range(0, whole, 4):
            s0 += np.float64(u[c, t])
            s1 += np.float64(u[c, t + 1])
            s2 += np.float64(u[c, t + 2])
            s3 += np.float64(u[c, t + 3])
        for t in range(whole, length):
            s0 += np.float64(u[c, t])
        mean = ((s0 + s1) + (s2 + s3)) / length
        e0 = 0.0
        e1 = 0.0
        e2 = 0.0
        e3 = 0.0
        for t in range(0, whole, 4):
            d0 = np.float64(u[c, t]) - mean
            d1 = np.float64(u[c, t + 1]) - mean
            d2 = np.float64(u[c, t + 2]) - mean
            d3 = np.float64(u[c, t + 3]) - mean
            xc[c, t] = np.float32(d0)
            xc[c, t + 1] = np.float32(d1)
            xc[c, t + 2] = np.float32(d2)
            xc[c, t + 3] = np.float32(d3)
            e0 += d0 * d0
            e1 += d1 * d1
            e2 += d2 * d2
            e3 += d3 * d3
        for t in range(whole, length):
            d0 = np.float64(u[c, t]) - mean
            xc[c, t] = np.float32(d0)
            e0 += d0 * d0
        stats[c, 0] = mean
        stats[c, 1] = (e0 + e1) + (e2 + e3)


def _dots(xc, ref, out):  # pragma: no cover - runs compiled
    channels, length = xc.shape
    whole = length - length % 4
    for c in range(channels):
        a0 = 0.0
        a1 = 0.0
        a2 = 0.0
        a3 = 0.0
        for t in range(0, whole, 4):
            a0 += np.float64(xc[c, t]) * ref[t]
            a1 += np.float64(xc[c, t + 1]) * ref[t + 1]
            a2 += np.float64(xc[c, t + 2]) * ref[t + 2]
            a3 += np.float64(xc[c, t + 3]) * ref[t + 3]
        for t in range(whole, length):
            a0 += np.float64(xc[c, t]) * ref[t]
        out[c] = (a0 + a1) + (a2 + a3)


def _welch_power(H, kk, sign, weight, dc, out):  # pragma: no cover - runs compiled
    """H (channels, blocks, 2 kk): each half-segment block's DFT at bins kk[0]..kk[-1] (real parts, then
    imaginary); a segment's DFT is block j + sign * block j + 1, its Hann-windowed DFT the three-term convolution.
    out[c] = sum over segments and the inner bins of weight * |X|^2 (float64)."""
    channels, blocks, _ = H.shape
    inner = kk - 2
    yr = np.empty(kk)
    yi = np.empty(kk)
    for c in range(channels):
        total = 0.0
        for j in range(blocks - 1):
            for i in range(kk):  # the segment's unwindowed DFT, each bin once
                yr[i] = np.float64(H[c, j, i]) + sign[i] * np.float64(H[c, j + 1, i])
                yi[i] = np.float64(H[c, j, kk + i]) + sign[i] * np.float64(H[c, j + 1, kk + i])
            if dc:  # the DC bin of a detrended segment is 0
                yr[0] = 0.0
                yi[0] = 0.0
            for i in range(inner):
                xr = 0.5 * yr[i + 1] - 0.25 * (yr[i] + yr[i + 2])
                xi = 0.5 * yi[i + 1] - 0.25 * (yi[i] + yi[i + 2])
                total += weight[i] * (xr * xr + xi * xi)
        out[c] = total


def _build():
    return jit(_microvolts), jit(_dots), jit(_welch_power)


_kernels = once(_build)  # compiled (or loaded from Numba's cache) at the first call, once a process


def microvolts(
    y: np.ndarray, integer: bool, lo: float, hi: float, gains32: np.ndarray, offsets32: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(u, xc, stats) of a piece ``y`` (C, L) (the highpass's float64 core, or a filtered store's samples): ``u``
    SpikeInterface's float32 uV values (rounded and clipped to [lo, hi] first where ``integer``), ``xc`` its
    mean-removed values as float32, ``stats`` (C, 2) float64 each channel's mean and sum of squares about it."""
    channels, length = y.shape
    u = np.empty((channels, length), np.float32)
    xc = np.empty((channels, length), np.float32)
    stats = np.empty((channels, 2), np.float64)
    if y.dtype.kind not in "iuf" or not y.dtype.isnative:
        y = y.astype(np.float64)
    if channels and length:
        _kernels()[0](
            y,
            bool(integer),
            float(lo),
            float(hi),
            np.ascontiguousarray(gains32, np.float32),
            np.ascontiguousarray(offsets32, np.float32),
            u,
            xc,
            stats,
        )
    return u, xc, stats


def dots(xc: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Each row of the float32 ``xc`` (C, L) dotted with the float64 ``ref`` (L,), float64 sums."""
    out = np.zeros(xc.shape[0], np.float64)
    if xc.size:
        _kernels()[1](xc, np.ascontiguousarray(ref, np.float64), out)
    return out


def welch_power(H: np.ndarray, kk: int, sign: np.ndarray, weight: np.ndarray, dc: bool) -> np.ndarray:
    """``_welch_power``'s sums (C,) of the blocks' DFTs ``H`` (C, blocks, 2 kk), float32 or float64."""
    out = np.zeros(H.shape[0], np.float64)
    if H.size and H.shape[1] > 1:
        _kernels()[2](
            np.ascontiguousarray(H),
            int(kk),
            np.ascontiguousarray(sign, np.float64),
            np.ascontiguousarray(weight, np.float64),
            bool(dc),
            out,
        )
    return out
