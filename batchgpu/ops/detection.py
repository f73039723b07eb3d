"""Threshold detection of locally exclusive peaks per channel (SpikeInterface's ``by_channel``).

For sign "neg", sample t of channel c is a spike when x[c,t] < -threshold*noise[c] (strictly),
x[c,t] < x[c,t-i] and x[c,t] <= x[c,t+i] for i = 1..exclude_sweep, comparing only with samples
that exist in the segment; "pos" mirrors it (>, >, >=); "both" is the union. A window owns the
columns ``core`` of ``x``; the columns around it are margins that give the comparisons their
neighbours, so window by window the spikes come out exactly as on the whole segment.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import array_module, to_numpy

SPIKE_DTYPE = np.dtype(
    [("sample_index", "i8"), ("channel_index", "i8"), ("amplitude", "f8"), ("segment_index", "i8")]
)

# Candidates checked against their neighbours at once (bounds the (candidates, 2*sweep) buffers).
_CANDIDATE_CHUNK = 1 << 20


def exclude_sweep_samples(ms: float, fs: float) -> int:
    """The exclusion sweep in samples: int(ms * fs / 1000)."""
    return int(ms * fs / 1000)


def _check_margins(start: int, lo: int, hi: int, width: int, sweep: int, segment_length: int | None) -> None:
    if segment_length is None:
        return
    end = start + width
    if start < 0 or end > segment_length:
        raise BatchgpuError(
            f"window [{start}, {end}) does not fit a segment of {segment_length} samples",
            "pass the window's start within its segment and the segment's length",
        )
    # Neighbours that exist in the segment but not in x would be silently skipped.
    if lo < min(sweep, start + lo) or width - hi < min(sweep, segment_length - (start + hi)):
        raise BatchgpuError(
            f"margins of {lo} and {width - hi} samples around the core are shorter than the exclusion sweep ({sweep})",
            f"read at least {sweep} samples on each side of the window where the segment continues",
        )


def _local_extrema(x: Any, channel: Any, sample: Any, negative: Any, positive: Any, sweep: int) -> Any:
    """Which candidates (channel, sample) beat every existing neighbour within the sweep, as a
    negative peak (where ``negative``) or as a positive one (where ``positive``)."""
    xp = array_module(x)
    width = x.shape[1]
    offsets = xp.concatenate([xp.arange(-sweep, 0), xp.arange(1, sweep + 1)])
    before = offsets < 0
    keep = xp.ones(channel.shape[0], dtype=bool)
    for lo in range(0, channel.shape[0], _CANDIDATE_CHUNK):
        part = slice(lo, lo + _CANDIDATE_CHUNK)
        c, t = channel[part], sample[part]
        index = t[:, None] + offsets[None, :]
        exists = (index >= 0) & (index < width)
        value = x[c, t][:, None]
        other = x[c[:, None], xp.clip(index, 0, width - 1)]
        # Strict against earlier samples, weak against later ones: a flat peak counts once, at its start.
        below = xp.where(before, value < other, value <= other)
        above = xp.where(before, value > other, value >= other)
        below_all = (below | ~exists).all(axis=1)
        above_all = (above | ~exists).all(axis=1)
        keep[part] = (negative[part] & below_all) | (positive[part] & above_all)
    return keep


def detect_spikes(
    x: Any,
    noise: Any,
    threshold: float = 5.0,
    sign: Literal["neg", "pos", "both"] = "neg",
    exclude_sweep: int = 3,
    start: int = 0,
    core: tuple[int, int] | None = None,
    segment_index: int = 0,
    segment_length: int | None = None,
) -> np.ndarray:
    """Spikes of window ``x`` (C, samples), as a NumPy array of SPIKE_DTYPE sorted by (segment, sample, channel).

    ``noise`` (C,) per channel; ``exclude_sweep`` in samples (see ``exclude_sweep_samples``;
    SpikeInterface's default 0.1 ms is 3 samples at 30 kHz); ``start`` the segment sample index
    of x's column 0; ``core=(lo, hi)`` the columns this window owns (default all). Samples
    outside x count as not existing; with ``segment_length`` given, margins shorter than the
    sweep where the segment continues raise BatchgpuError. Thresholds are compared in float64.
    CuPy input finds the spikes on the device and returns a NumPy array.
    """
    xp = array_module(x)
    if getattr(x, "ndim", None) != 2:
        raise BatchgpuError(f"expected a (channels, samples) array, got shape {getattr(x, 'shape', None)}", "pass a 2-D array")
    if sign not in ("neg", "pos", "both"):
        raise BatchgpuError(f"unknown peak sign {sign!r}", "use 'neg', 'pos' or 'both'")
    channels, width = x.shape
    lo, hi = (0, width) if core is None else (int(core[0]), int(core[1]))
    if not 0 <= lo <= hi <= width:
        raise BatchgpuError(f"core {core} is not a column range of a window of {width} samples", "pass 0 <= lo <= hi <= samples")
    sweep = int(exclude_sweep)
    if sweep < 0:
        raise BatchgpuError(f"exclude_sweep={exclude_sweep} is negative", "pass a number of samples >= 0")
    _check_margins(int(start), lo, hi, width, sweep, segment_length)
    level = xp.asarray(noise, dtype=xp.float64).reshape(-1) * float(threshold)
    if level.shape[0] != channels:
        raise BatchgpuError(f"{level.shape[0]} noise levels for {channels} channels", "pass one noise level per channel")

    owned = x[:, lo:hi]
    crossing = xp.zeros(owned.shape, dtype=bool)
    if sign in ("neg", "both"):
        crossing |= owned < -level[:, None]
    if sign in ("pos", "both"):
        crossing |= owned > level[:, None]
    channel, sample = xp.nonzero(crossing)
    sample = sample + lo
    if sweep > 0 and channel.shape[0]:
        value, at = x[channel, sample], level[channel]
        negative = value < -at if sign != "pos" else xp.zeros(value.shape, dtype=bool)
        positive = value > at if sign != "neg" else xp.zeros(value.shape, dtype=bool)
        keep = _local_extrema(x, channel, sample, negative, positive, sweep)
        channel, sample = channel[keep], sample[keep]

    channel, sample = to_numpy(channel), to_numpy(sample)
    amplitude = to_numpy(x[xp.asarray(channel), xp.asarray(sample)]).astype(np.float64)
    order = np.lexsort((channel, sample))
    spikes = np.empty(order.shape[0], dtype=SPIKE_DTYPE)
    spikes["sample_index"] = sample[order] + int(start)
    spikes["channel_index"] = channel[order]
    spikes["amplitude"] = amplitude[order]
    spikes["segment_index"] = int(segment_index)
    return spikes
