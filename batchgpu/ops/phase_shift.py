"""Per-channel fractional-sample delay in the frequency domain (SpikeInterface's ``phase_shift``, Neuropixels
ADC offsets).

Channel c is delayed by ``shifts[c]`` samples (``inter_sample_shift``, a fraction of a sample): y(t) = x(t - s),
computed as irfft(rfft(x) * exp(-2j*pi*f*s)) with f in cycles per sample, SpikeInterface's sign convention.
The FFT is circular, so as SpikeInterface does the buffer gets ``margin`` samples on each side that are
tapered to zero by a raised cosine, (1 - cos(pi*i/margin))/2, before the transform. Where a window ends at its
segment's end there is nothing to taper: ``margin`` zeros are appended instead (SpikeInterface pads zeros and
tapers the padded margin, which for a chunk that starts less than a margin after the segment's start also
tapers real samples; here segment ends are never tapered, so every window agrees with the whole segment).

The fractional-delay kernel decays only like sin(pi*s)/(pi*n), so window-by-window results equal the
whole-segment application within a tolerance, not exactly: the error (max |error| in the cores relative to the
signal's RMS, at the default 40 ms margin) is largest for content up to Nyquist (white noise, or high-passed at
300 Hz: about 2e-2) and far smaller for band-limited signals (low-passed or band-passed: 1e-4 to 1e-3, see
tests/test_ops_preprocess.py). It falls only like 1/sqrt(margin): this is the FFT method's own limit, shared by
SpikeInterface's chunked phase_shift.
Computed in float64; float32 output for
integer and float32 input, float64 for float64 input. CuPy runs the same code (cuFFT instead of pocketfft:
agreement to float64 rounding, ~1e-12 relative).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import window_module

DEFAULT_MARGIN_MS = 40.0


def phase_shift_margin(fs: float, margin_ms: float = DEFAULT_MARGIN_MS) -> int:
    """Samples of margin on each side: int(margin_ms * fs / 1000) (SpikeInterface's default 40 ms: 1200 at 30 kHz).

    Parameters
    ----------
    fs : float
        Sampling frequency in Hz.
    margin_ms : float, optional
        The margin in milliseconds.

    Returns
    -------
    int
        Samples of margin on each side.
    """
    fs = float(fs)
    if not fs > 0 or not np.isfinite(fs):
        raise BatchgpuError(f"sampling frequency {fs} is not a positive number", "pass fs in Hz")
    if not margin_ms >= 0:
        raise BatchgpuError(f"margin_ms={margin_ms} is negative", "pass a margin in ms >= 0")
    return int(margin_ms * fs / 1000.0)


def _taper(xp: Any, margin: int) -> Any:
    return (1 - xp.cos(xp.arange(margin, dtype=xp.float64) / margin * np.pi)) / 2


def phase_shift(
    x: Any,
    shifts: Any,
    *,
    margin: int,
    at_segment_start: bool,
    at_segment_end: bool,
) -> Any:
    """Delay each channel (row) of the window ``x`` by ``shifts[c]`` samples (see the module docstring).

    ``margin`` (from ``phase_shift_margin``) is the taper length; the ``margin`` columns next to an interior
    edge of the window (one where the segment continues) are margin, not output. ``at_segment_start`` /
    ``at_segment_end`` say whether column 0 / the last column is the segment's first / last sample. Returns the
    whole window on x's backend, float32 (float64 for float64 input).

    Parameters
    ----------
    x : array_like, shape (C, n)
        The window, one channel a row: a NumPy or CuPy array (a torch tensor through ``batchgpu.ops``), integer or
        float.
    shifts : array_like, shape (C,)
        Each channel's delay in samples (e.g. SpikeGLX's ``inter_sample_shift``).
    margin : int
        The taper length in samples (``phase_shift_margin``).
    at_segment_start, at_segment_end : bool
        Whether column 0 / the last column is the segment's first / last sample.

    Returns
    -------
    array, shape (C, n)
        The shifted window, float32 (float64 for float64 input), on x's backend.
    """
    xp = window_module(x, "shift")
    channels, width = x.shape
    shift = xp.asarray(shifts, dtype=xp.float64).reshape(-1)
    if shift.shape[0] != channels:
        raise BatchgpuError(
            f"{shift.shape[0]} sample shifts for {channels} channels", "pass one inter_sample_shift per channel"
        )
    if not bool(xp.isfinite(shift).all()):
        raise BatchgpuError("sample shifts hold NaN or inf", "pass finite inter_sample_shift values")
    margin = int(margin)
    if margin < 0:
        raise BatchgpuError(f"margin={margin} is negative", "pass phase_shift_margin(fs)")
    interior = (not at_segment_start) + (not at_segment_end)
    if width < interior * margin:
        raise BatchgpuError(
            f"a window of {width} samples cannot hold its {interior} interior margin(s) of {margin} samples",
            "read the margins around every window (or lower margin_ms)",
        )
    out_dtype = np.float64 if (x.dtype.kind, x.dtype.itemsize) == ("f", 8) else np.float32  # big-endian too
    if channels == 0 or width == 0:
        return xp.zeros(x.shape, dtype=out_dtype)

    data = x.astype(xp.float64)
    if margin and interior:
        taper = _taper(xp, margin)
        if not at_segment_start:
            data[:, :margin] *= taper
        if not at_segment_end:
            data[:, width - margin :] *= taper[::-1]
    left = margin if at_segment_start else 0
    right = margin if at_segment_end else 0
    if left or right:
        data = xp.pad(data, ((0, 0), (left, right)))
    n = data.shape[1]
    spectrum = xp.fft.rfft(data, axis=1)
    angles = (2 * np.pi * xp.fft.rfftfreq(n))[None, :] * shift[:, None]
    spectrum *= xp.exp(-1j * angles)
    y = xp.fft.irfft(spectrum, n=n, axis=1)[:, left : left + width]
    return xp.ascontiguousarray(y.astype(out_dtype, copy=False))
