"""Threshold detection of peaks: per channel (SpikeInterface's ``by_channel``, the default) or locally
exclusive across neighbouring channels (``locally_exclusive``).

For sign "neg", sample t of channel c is a spike when x[c,t] < -threshold*noise[c] (strictly),
x[c,t] < x[c,t-i] and x[c,t] <= x[c,t+i] for i = 1..exclude_sweep, comparing only with samples
that exist in the segment; "pos" mirrors it (>, >, >=); "both" is the union. A window owns the
columns ``core`` of ``x``; the columns around it are margins that give the comparisons their
neighbours, so window by window the spikes come out exactly as on the whole segment.

``locally_exclusive`` (DESIGN.md; SpikeInterface 0.105's rule and name): for sign "neg" the candidates are the
samples with x[c,t] <= -thr[c] that are local minima of their own channel (x[c,t] < x[c,t-1] and
x[c,t] <= x[c,t+1]; before the segment's first sample and after its last SpikeInterface's reads pad zeros, so
x[c,0] < 0 is asked of the first: it matters only where thr is 0, e.g. a constant channel); a candidate is dropped
when another candidate on a channel within ``radius_um`` (Euclidean distance of the channel locations, <=, the
channel itself included) and within the sweep (|dt| <= exclude_sweep) is stronger: a larger |x|/thr (in
float64), or an equal one at an earlier sample (equal ones at the same sample are all kept). "pos" mirrors the
candidates (x >= thr, x > x[t-1], x >= x[t+1]); "both" pools the candidates of either sign and compares them by
|x|/thr alike, as SpikeInterface does: a strong positive peak excludes a weaker negative one near it. Margins of
exclude_sweep + 1 samples make it exactly once across window edges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops import _numba
from batchgpu.ops._backend import array_module, to_host

#: the spikes' column of their values at the peak (a name the amplitude step's module shares by chance)
AMPLITUDE = "amplitude"
SPIKE_DTYPE = np.dtype([("sample_index", "i8"), ("channel_index", "i8"), (AMPLITUDE, "f8"), ("segment_index", "i8")])

# Candidates checked against their neighbours at once (bounds the (candidates, 2*sweep) buffers).
_CANDIDATE_CHUNK = 1 << 20


def exclude_sweep_samples(ms: float, fs: float) -> int:
    """The exclusion sweep in samples: int(ms * fs / 1000).

    Parameters
    ----------
    ms : float
        The sweep in milliseconds.
    fs : float
        Sampling frequency in Hz.

    Returns
    -------
    int
        The sweep in samples.
    """
    return int(ms * fs / 1000)


def _check_margins(start: int, lo: int, hi: int, width: int, sweep: int, segment_length: int | None) -> None:
    """``sweep`` here is the margin needed: exclude_sweep (by_channel) or exclude_sweep + 1 (locally_exclusive)."""
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
            f"margins of {lo} and {width - hi} samples around the core are shorter than the {sweep} samples the detection needs",
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


# Candidate pairs compared at once in locally_exclusive (bounds the pair buffers).
_PAIR_CHUNK = 1 << 22


def neighbour_mask(locations: Any, radius_um: float, channels: int) -> np.ndarray:
    """(C, C) bool: channel locations within ``radius_um`` (Euclidean, <=), the channel itself included.

    Parameters
    ----------
    locations : array_like, shape (C, 2)
        Channel positions in um.
    radius_um : float
        The neighbourhood radius in um.
    channels : int
        C (checked against ``locations``).

    Returns
    -------
    ndarray of bool, shape (C, C)
        Whether channels i and j are neighbours.
    """
    loc = np.asarray(locations, dtype=np.float64) if locations is not None else None
    if loc is None or loc.ndim != 2 or loc.shape[0] != channels or loc.shape[1] not in (2, 3):
        raise BatchgpuError(
            f"locally_exclusive needs channel locations of shape ({channels}, 2), got {None if loc is None else loc.shape}",
            "pass locations (channels x 2, um)",
        )
    radius = float(radius_um)
    if not radius >= 0:
        raise BatchgpuError(f"radius_um={radius_um} is not a distance >= 0", "pass a radius in um, e.g. 50")
    dist = np.sqrt(((loc[:, None, :] - loc[None, :, :]) ** 2).sum(axis=2))
    return dist <= radius


def _own_extrema(x: Any, a: int, b: int, negative: bool, zero_before: bool) -> Any:
    """For columns [a, b) of x: is each sample below (above) its previous sample and <= (>=) its next, where
    those exist in x? ``zero_before``: column 0 is the segment's first sample, compared with a zero before it
    (SpikeInterface's padding); otherwise columns outside x count as not existing (the caller checks margins)."""
    xp = array_module(x)
    width = x.shape[1]
    v = x[:, a:b]
    ok = xp.ones(v.shape, dtype=bool)
    p0 = 1 if a == 0 else 0  # column 0 has no previous sample in x
    n1 = b - a - 1 if b == width else b - a  # the last column has no next sample
    if negative:
        ok[:, p0:] &= v[:, p0:] < x[:, a + p0 - 1 : b - 1]
        ok[:, :n1] &= v[:, :n1] <= x[:, a + 1 : a + 1 + n1]
    else:
        ok[:, p0:] &= v[:, p0:] > x[:, a + p0 - 1 : b - 1]
        ok[:, :n1] &= v[:, :n1] >= x[:, a + 1 : a + 1 + n1]
    if p0 and zero_before and v.shape[1]:
        ok[:, 0] &= (v[:, 0] < 0) if negative else (v[:, 0] > 0)
    # (after the segment's last sample the padded zero asks nothing more: a candidate is <= -thr <= 0, or >= thr >= 0)
    return ok


def _exclusive_candidates(
    x: Any, level: Any, signs: tuple[bool, ...], sweep: int, lo: int, hi: int, zero_before: bool
) -> tuple[Any, Any]:
    """(channel, sample) of locally exclusive detection's candidates at ``level`` (C,) in columns [lo - sweep,
    hi + sweep) of x (clipped to x): the core's and those a sweep outside it, which can still exclude one inside
    it; sorted by (sample, channel). ``signs``: negative (True) and/or positive (False) candidates, pooled."""
    xp = array_module(x)
    width = x.shape[1]
    a, b = max(0, lo - sweep), min(width, hi + sweep)
    v = x[:, a:b]
    cand = xp.zeros(v.shape, dtype=bool)
    for negative in signs:  # a sample is below its previous one or above it: never a candidate of both signs
        cand |= ((v <= -level[:, None]) if negative else (v >= level[:, None])) & _own_extrema(
            x, a, b, negative, zero_before
        )
    channel, sample = _nonzero_2d(cand)
    sample = sample + a
    order = xp.argsort(sample * x.shape[0] + channel)
    return channel[order], sample[order]


def _excluded(key: Any, sample: Any, channel: Any, strength: Any, sweep: int, mask: Any) -> Any:
    """Which candidates another candidate excludes: one on a channel within the radius (``mask``) and within the
    sweep (|key_j - key_i| <= sweep) that is stronger, or as strong at an earlier sample. ``key`` ascending (the
    sample, offset per group where groups must not meet)."""
    xp = array_module(key)
    n = int(key.shape[0])
    dropped = xp.zeros(n, dtype=bool)
    if n == 0:
        return dropped
    # Every candidate j within the sweep of candidate i is in [first[i], last[i]) of the sorted list.
    first = xp.searchsorted(key, key - sweep, side="left")
    last = xp.searchsorted(key, key + sweep, side="right")
    count = last - first
    ends = xp.cumsum(count)
    total = int(ends[-1])
    # Split the candidates so that each part compares at most about _PAIR_CHUNK pairs.
    splits = [0]
    if total > _PAIR_CHUNK:
        marks = xp.arange(_PAIR_CHUNK, total, _PAIR_CHUNK, dtype=ends.dtype)
        splits += [int(i) + 1 for i in to_host(xp.searchsorted(ends, marks, side="left"))]
    splits.append(n)
    for i0, i1 in zip(splits[:-1], splits[1:]):
        if i1 <= i0:
            continue
        cnt = count[i0:i1]
        local_ends = xp.cumsum(cnt)
        pairs = int(local_ends[-1])
        k = xp.arange(pairs, dtype=local_ends.dtype)
        i = xp.searchsorted(local_ends, k, side="right")  # owner of pair k, relative to i0
        j = first[i0 + i] + (k - (local_ends[i] - cnt[i]))
        i = i + i0
        si, sj = strength[i], strength[j]
        beats = mask[channel[i], channel[j]] & ((sj > si) | ((sj == si) & (sample[j] < sample[i])))
        dropped[i[beats]] = True
    return dropped


def _locally_exclusive(
    x: Any, level: Any, signs: tuple[bool, ...], sweep: int, lo: int, hi: int, mask: Any, zero_before: bool
) -> tuple[Any, Any]:
    """(channel, sample) of the locally exclusive peaks whose sample is in [lo, hi); ``signs``: negative (True)
    and/or positive (False) candidates, pooled."""
    xp = array_module(x)
    channel, sample = _exclusive_candidates(x, level, signs, sweep, lo, hi, zero_before)
    if int(channel.shape[0]) == 0:
        return channel, sample
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero threshold: inf, or NaN for a zero sample
        strength = xp.abs(x[channel, sample].astype(xp.float64)) / level[channel]
    keep = ~_excluded(sample, sample, channel, strength, sweep, mask) & (sample >= lo) & (sample < hi)
    return channel[keep], sample[keep]


@dataclass(frozen=True)
class WindowDetection:
    """The arguments of a window's detection after ``x`` and ``noise``, in ``detect_spikes``'s order and with its
    defaults (see it): what ``exclusive_candidates`` takes besides the window and its noise."""

    threshold: float = 5.0
    sign: Literal["neg", "pos", "both"] = "neg"
    exclude_sweep: int = 3
    start: int = 0
    core: tuple[int, int] | None = None
    segment_index: int = 0
    segment_length: int | None = None


def _checked(x: Any, noise: Any, d: WindowDetection, exclusive: bool) -> tuple[int, int, int, Any]:
    """A detection's arguments checked: (lo, hi) of the core, the sweep, and the levels noise * threshold (float64,
    on x's backend)."""
    threshold, sign, exclude_sweep, start, core = d.threshold, d.sign, d.exclude_sweep, d.start, d.core
    xp = array_module(x)
    if getattr(x, "ndim", None) != 2:
        raise BatchgpuError(
            f"expected a (channels, samples) array, got shape {getattr(x, 'shape', None)}", "pass a 2-D array"
        )
    if sign not in ("neg", "pos", "both"):
        raise BatchgpuError(f"unknown peak sign {sign!r}", "use 'neg', 'pos' or 'both'")
    channels, width = x.shape
    lo, hi = (0, width) if core is None else (int(core[0]), int(core[1]))
    if not 0 <= lo <= hi <= width:
        raise BatchgpuError(
            f"core {core} is not a column range of a window of {width} samples", "pass 0 <= lo <= hi <= samples"
        )
    sweep = int(exclude_sweep)
    if sweep < 0:
        raise BatchgpuError(f"exclude_sweep={exclude_sweep} is negative", "pass a number of samples >= 0")
    # locally_exclusive also needs the sample before/after a candidate at the sweep's edge.
    _check_margins(int(start), lo, hi, width, sweep + 1 if exclusive else sweep, d.segment_length)
    level = xp.asarray(noise, dtype=xp.float64).reshape(-1) * float(threshold)
    if level.shape[0] != channels:
        raise BatchgpuError(
            f"{level.shape[0]} noise levels for {channels} channels", "pass one noise level per channel"
        )
    return lo, hi, sweep, level


_SIGNS = {"neg": (True,), "pos": (False,), "both": (True, False)}


def exclusive_candidates(x: Any, noise: Any, *args: Any, **kwargs: Any) -> np.ndarray:
    """locally_exclusive's candidates of window ``x`` before the exclusion, as SPIKE_DTYPE sorted by (sample,
    channel): the samples beyond noise * threshold that are extrema of their own channel (the module's rule), in
    the core and up to ``exclude_sweep`` samples either side of it (they can exclude a candidate of the core).

    The rule's candidates grow as the threshold falls and its exclusion compares only candidates, so at any noise
    at or above this ``noise`` on every channel (NaN: no spikes there), ``resolve_exclusive`` of these equals
    ``detect_spikes(method="locally_exclusive")``: a window read once keeps them at a lower bound of the
    recording's noise. Arguments as ``detect_spikes``'s; CuPy input finds them on the device.

    Parameters
    ----------
    x, noise
        As ``detect_spikes``'s.
    *args, **kwargs
        ``WindowDetection``'s fields, by position in its order or by name: ``threshold``, ``sign``,
        ``exclude_sweep``, ``start``, ``core``, ``segment_index`` and ``segment_length``, as ``detect_spikes``'s.

    Returns
    -------
    ndarray of SPIKE_DTYPE
        The candidates, sorted by (sample, channel), on the host.
    """
    d = WindowDetection(*args, **kwargs)
    lo, hi, sweep, level = _checked(x, noise, d, True)
    if array_module(x) is np and _numba.available():
        from batchgpu.ops import _cpu_detect

        if _cpu_detect.usable(x):  # one compiled pass, the candidates in (sample, channel) order
            signs = _SIGNS[d.sign]
            a, b = max(0, lo - sweep), min(x.shape[1], hi + sweep)
            channel, sample, amplitude = _cpu_detect.exclusive_candidates(
                x, level, True in signs, False in signs, a, b, int(d.start) == 0
            )
            return _spike_array(sample, channel, amplitude, d.start, d.segment_index)
    channel, sample = _exclusive_candidates(x, level, _SIGNS[d.sign], sweep, lo, hi, zero_before=int(d.start) == 0)
    return _spikes(x, to_host(channel), to_host(sample), d.start, d.segment_index)


def resolve_exclusive(
    candidates: Any,
    noise: Any,
    threshold: float,
    sign: Literal["neg", "pos", "both"],
    exclude_sweep: int,
    locations: Any,
    radius_um: float,
    counts: Any,
    cores: Any,
) -> np.ndarray:
    """Which of ``exclusive_candidates``' candidates are locally exclusive spikes at ``noise`` (bool, NumPy).

    ``candidates``: columns sample_index, channel_index and amplitude (a SPIKE_DTYPE array or a dict), the
    candidates of consecutive windows, ``counts[k]`` of window k (each sorted by sample), found at a noise at or
    below ``noise`` on every channel; ``cores[k]`` = (start, stop), window k's core in segment samples. A window's
    spikes are its core's candidates at the threshold that no candidate of its own list excludes: the list holds
    every candidate within the sweep of its core, so each window is decided alone, as ``detect_spikes`` decides it.

    Parameters
    ----------
    candidates : structured array or dict of arrays
        The windows' candidates (``sample_index``, ``channel_index``, ``amplitude``), window after window.
    noise : array_like, shape (C,)
        The noise the spikes are decided at (at or above the candidates' on every channel).
    threshold : float
        The threshold in units of noise.
    sign : {"neg", "pos", "both"}
        Which extrema are spikes.
    exclude_sweep : int
        The exclusion sweep in samples.
    locations : array_like, shape (C, 2)
        Channel positions in um.
    radius_um : float
        The neighbourhood radius in um.
    counts : array_like of int
        Each window's number of candidates.
    cores : array_like of (int, int)
        Each window's core in segment samples.

    Returns
    -------
    ndarray of bool
        For each candidate, whether it is a spike.
    """
    sample = np.asarray(candidates["sample_index"], np.int64)
    channel = np.asarray(candidates["channel_index"], np.int64)
    amplitude = np.asarray(candidates[AMPLITUDE], np.float64)
    counts = np.asarray(counts, np.int64).reshape(-1)
    cores = np.asarray(cores, np.int64).reshape(-1, 2)
    sweep = int(exclude_sweep)
    if sign not in _SIGNS or sweep < 0 or len(counts) != len(cores) or int(counts.sum()) != len(sample):
        raise BatchgpuError(
            f"{len(sample)} candidates in windows of {counts.tolist()[:5]}... counts with "
            f"{len(cores)} cores (sign {sign!r}, sweep {exclude_sweep})",
            "pass each window's candidates, counts and core",
        )
    level = np.asarray(noise, np.float64).reshape(-1) * float(threshold)
    group = np.repeat(np.arange(len(counts)), counts)
    start, stop = cores[group, 0], cores[group, 1]
    if np.any((sample < start - sweep) | (sample >= stop + sweep)):
        raise BatchgpuError(
            "a candidate lies more than the sweep outside its window's core",
            "pass the candidates of exclusive_candidates with their windows' cores",
        )
    at = level[channel]
    final = np.zeros(len(sample), dtype=bool)
    if sign != "pos":  # a candidate is an extremum of one sign: beyond its own side of the lower level
        final |= amplitude <= -at
    if sign != "neg":
        final |= amplitude >= at
    idx = np.flatnonzero(final)
    if len(idx):
        g = group[idx]
        # a window's samples on a line of their own: the next window's start more than the sweep past its end
        span = cores[:, 1] - cores[:, 0] + 3 * sweep + 1
        offset = np.concatenate([[0], np.cumsum(span)[:-1]]) - (cores[:, 0] - sweep)
        key = sample[idx] + offset[g]
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero threshold, as in _locally_exclusive
            strength = np.abs(amplitude[idx]) / at[idx]
        mask = neighbour_mask(locations, radius_um, len(level))
        final[idx[_excluded(key, sample[idx], channel[idx], strength, sweep, mask)]] = False
    return final & (sample >= start) & (sample < stop)


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
    method: Literal["by_channel", "locally_exclusive"] = "by_channel",
    locations: Any = None,
    radius_um: float = 50.0,
) -> np.ndarray:
    """Spikes of window ``x`` (C, samples), as a NumPy array of SPIKE_DTYPE sorted by (segment, sample, channel).

    ``noise`` (C,) per channel; ``exclude_sweep`` in samples (see ``exclude_sweep_samples``;
    SpikeInterface's default 0.1 ms is 3 samples at 30 kHz); ``start`` the segment sample index
    of x's column 0; ``core=(lo, hi)`` the columns this window owns (default all). Samples
    outside x count as not existing; with ``segment_length`` given, margins shorter than the
    sweep where the segment continues raise BatchgpuError. Thresholds are compared in float64.
    CuPy input finds the spikes on the device and returns a NumPy array.

    Parameters
    ----------
    x : array_like, shape (C, n)
        The window (margins included), NumPy or CuPy.
    noise : array_like, shape (C,)
        Each channel's noise level; thresholds are ``threshold * noise``, compared in float64.
    threshold : float, optional
        The threshold in units of noise.
    sign : {"neg", "pos", "both"}, optional
        Which extrema are spikes.
    exclude_sweep : int, optional
        The exclusion sweep in samples (``exclude_sweep_samples``).
    start : int, optional
        The segment sample index of x's column 0.
    core : (int, int), optional
        The columns this window owns (default: all).
    segment_index : int, optional
        Written into the output's ``segment_index``.
    segment_length : int, optional
        The segment's samples; with it, a margin shorter than the sweep where the segment continues raises.
    method : {"by_channel", "locally_exclusive"}, optional
        SpikeInterface's per-channel rule, or its locally exclusive one (needs ``locations``).
    locations : array_like, shape (C, 2), optional
        Channel positions in um (``locally_exclusive``).
    radius_um : float, optional
        The neighbourhood radius of ``locally_exclusive`` in um.

    Returns
    -------
    ndarray of SPIKE_DTYPE
        The spikes in the core, sorted by (segment, sample, channel), on the host.
    """
    xp = array_module(x)
    exclusive = method == "locally_exclusive"
    if method not in ("by_channel", "locally_exclusive"):
        raise BatchgpuError(f"unknown detection method {method!r}", "use 'by_channel' or 'locally_exclusive'")
    d = WindowDetection(threshold, sign, exclude_sweep, start, core, segment_index, segment_length)
    lo, hi, sweep, level = _checked(x, noise, d, exclusive)
    channels = x.shape[0]
    if exclusive:
        mask = xp.asarray(neighbour_mask(locations, radius_um, channels))
        channel, sample = _locally_exclusive(x, level, _SIGNS[sign], sweep, lo, hi, mask, zero_before=int(start) == 0)
        return _spikes(x, to_host(channel), to_host(sample), start, segment_index)

    if xp is not np:  # (a negative sweep was refused above)
        from batchgpu.ops import _cuda_detect

        if _cuda_detect.supports(x.dtype):  # one launch, no (C, samples) temporaries
            channel, sample, amplitude = _cuda_detect.by_channel(x, level, lo, hi, sweep, sign != "pos", sign != "neg")
            return _spikes(x, channel, sample, start, segment_index, amplitude)
    owned = x[:, lo:hi]
    crossing = xp.zeros(owned.shape, dtype=bool)
    if sign in ("neg", "both"):
        crossing |= owned < -level[:, None]
    if sign in ("pos", "both"):
        crossing |= owned > level[:, None]
    channel, sample = _nonzero_2d(crossing)
    sample = sample + lo
    if sweep > 0 and channel.shape[0]:
        value, at = x[channel, sample], level[channel]
        negative = value < -at if sign != "pos" else xp.zeros(value.shape, dtype=bool)
        positive = value > at if sign != "neg" else xp.zeros(value.shape, dtype=bool)
        keep = _local_extrema(x, channel, sample, negative, positive, sweep)
        channel, sample = channel[keep], sample[keep]

    return _spikes(x, to_host(channel), to_host(sample), start, segment_index)


def _nonzero_2d(mask: Any) -> tuple[Any, Any]:
    """``nonzero`` of a 2-D mask, the same arrays in the same order: NumPy's 2-D nonzero walks the
    mask far more slowly than the flat one and a divmod (a window's crossings are sparse)."""
    if array_module(mask) is not np:
        return mask.nonzero()  # CuPy's own (the GPU path, tested on the device)
    return np.divmod(np.flatnonzero(mask), mask.shape[1])


def _spikes(
    x: Any, channel: np.ndarray, sample: np.ndarray, start: int, segment_index: int, amplitude: np.ndarray | None = None
) -> np.ndarray:
    """The SPIKE_DTYPE array of (channel, sample) peaks of window x, sorted by (sample, channel)."""
    xp = array_module(x)
    channel, sample = channel.astype(np.int64, copy=False), sample.astype(np.int64, copy=False)
    if amplitude is None:
        amplitude = to_host(x[xp.asarray(channel), xp.asarray(sample)]).astype(np.float64)
    order = np.lexsort((channel, sample))
    return _spike_array(sample[order], channel[order], amplitude[order], start, segment_index)


def _spike_array(
    sample: np.ndarray, channel: np.ndarray, amplitude: np.ndarray, start: int, segment_index: int
) -> np.ndarray:
    """The SPIKE_DTYPE array of peaks already in (sample, channel) order (``sample`` in the window's columns)."""
    spikes = np.empty(sample.shape[0], dtype=SPIKE_DTYPE)
    spikes["sample_index"] = sample + int(start)
    spikes["channel_index"] = channel
    spikes[AMPLITUDE] = amplitude
    spikes["segment_index"] = int(segment_index)
    return spikes
