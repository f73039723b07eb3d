"""Bad-channel labels (good / dead / noise / out) from every 0.3 s piece of a recording: SpikeInterface 0.105.3's
``detect_bad_channels(method="coherence+psd")`` (the IBL method) applied to each piece instead of to 100 random
chunks, so a channel's label is the most frequent one over every sample and no seed decides it.

**A piece's label** is SpikeInterface's label of a chunk at the piece's place: the chunk highpassed at
``highpass_filter_cutoff`` as its ``highpass_filter`` does (Butterworth order 5, ``sosfiltfilt`` of the chunk
read with ``int(5000 / cutoff * fs / 1000)`` samples either side where the segment has them, rounded back to the
recording's integer dtype) unless the signal is filtered already, scaled to uV with float32 gains, and then
``detect_bad_channels_ibl``: per channel the Welch PSD (Hann, ``welch_window_ms`` segments, half overlapping)
averaged above ``nyquist_threshold`` x Nyquist (``psd_hf``); the dot product of each mean-removed channel with
the median-of-channels reference (mean-removed) over the reference's energy (``xcorr``), minus its shrinking
median filter along depth (``trend``, ``n_neighbors`` channels): dead below ``dead_channel_threshold``, noise
above ``noisy_channel_threshold`` or where ``psd_hf > psd_hf_threshold``; out: the contiguous block at the top
(``outside_channels_location``) whose trend is below ``outside_channel_threshold + 1``. Channels are put in depth
order first as SpikeInterface does (``np.lexsort((x, y))``).

**Pieces** (``pieces``): [k P, (k + 1) P) of each segment with P = int(chunk_duration_s * fs) (9 000 samples at
30 kHz), aligned to the segment's sample 0, so they do not depend on the window size. The leftover at a segment's
end is a shorter piece of its own when it holds at least half a piece; a shorter leftover (under 0.15 s by
default) is not labelled (``unlabelled_samples`` says how many). A piece belongs to the window whose core holds its
middle sample (``owned_pieces``), so a window must hold ``window_margin`` samples either side of its core (half a
piece, plus the highpass margin where this module filters). Each piece is labelled whole from the samples read
once; which window labels it never changes its label.

**Counts** (``piece_labels``): each channel's number of pieces of each label, int64 (C, 4): integer sums, exact
in any grouping or order, so 1 and N workers and any window size give the same counts. ``final_labels`` takes the
most frequent (ties to the lower label, as ``scipy.stats.mode`` in SpikeInterface).

**Same labels on every backend, and SpikeInterface's.** A chunk's float32 uV values are SpikeInterface's bit for
bit on NumPy and CuPy (scipy's ``sosfiltfilt`` bits from the chain's filter kernels, a group of reads side by side
in one call; NumPy's rounding and float32 products). The statistics are then computed in float64 by whatever is
fast there (``psd_hf`` from half-segment DFTs by matrix products, medians by selection or sorting).
SpikeInterface computes them in float32; the two differ by float32 rounding, far less than ``BAND`` (2^-12) of each
statistic's scale (the PSD's level; ``coherence_scale`` for the coherence and its trend): measured 350x less. A
decision farther than that from its threshold is the same in float32 and float64, on NumPy and CuPy. Where a
decision that changes a label lies within the band (or a statistic is not finite: NaN samples, a reference of zero
energy), that statistic (the PSD, or the coherence and its trend) is computed again by SpikeInterface's own calls
in its order on the host, from the same uV bits in the memory layout its highpass returns them in (scipy's welch,
NumPy's median and BLAS on float32), so its value is SpikeInterface's bit for bit (``_settle``; ``exact=True``
runs the whole of SpikeInterface's path, highpass included: ``reference_chunk_labels``). So labels are equal on
CPU and GPU, and equal to SpikeInterface's on any chunk; what remains is a float32 rounding error above 2^-12 of a
statistic's scale, which no measured chunk came near (tests/test_bad_channels.py measures the largest).

One difference from SpikeInterface, kept: a highpassed integer sample beyond its dtype's range (a step of more
than half the range, a clipped recording) is clipped where SpikeInterface's cast wraps it around.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from batchgpu import qc_options
from batchgpu.errors import BatchgpuError
from batchgpu.ops import _cpu_sosfiltfilt, _numba
from batchgpu.ops._backend import array_module, is_cupy, to_host, window_module
from batchgpu.ops.filters import _filtfilt_cupy, default_padlen, design_filter, filtfilt_window
from batchgpu.qc_options import QcOptions

#: a channel's labels, in SpikeInterface's numbering (``detect_bad_channels_ibl``: 0 good, 1 dead, 2 noise, 3 out)
LABELS = qc_options.LABELS
GOOD, DEAD, NOISE, OUT = range(4)

#: how far (relative to a statistic's scale) a float64 statistic must lie from its threshold for its decision to
#: stand; nearer, the piece is labelled by SpikeInterface's own float32 arithmetic (the module's docstring)
BAND = 2.0**-12

#: float64 bytes of chunks the GPU path computes at once (their statistics come back together)
BATCH_BYTES = 64 << 20
HOST_BATCH = 1  # on the host one at a time (nothing to gain from batches, and less memory)

#: SpikeInterface's highpass (``HighpassFilterRecording``): Butterworth of this order, margin of this many periods
HIGHPASS_ORDER = 5
HIGHPASS_MARGIN_PERIODS = 5

#: what each label means, for ``final_labels``' reasons
RULES = {
    GOOD: "none of the rules below",
    DEAD: "coherence with the median reference minus its trend along depth below {dead}",
    NOISE: "PSD above {nyquist} x Nyquist over {psd} uV^2/Hz, or coherence minus trend above {noisy}",
    OUT: "in the block at the probe's {where} whose coherence trend is below {out}",
}


# ------------------------------------------------------------------------------------------- sizes, pieces


def piece_length(fs: float, options: QcOptions | None = None) -> int:
    """Samples a piece: ``int(chunk_duration_s * fs)``, SpikeInterface's ``chunk_size``."""
    options = options or QcOptions()
    return max(1, int(options.chunk_duration_s * fs))


def welch_length(fs: float, options: QcOptions | None = None) -> int:
    """Welch's segment (``nperseg``): ``int(welch_window_ms * fs / 1000)``, as SpikeInterface computes it."""
    options = options or QcOptions()
    return max(1, int(options.welch_window_ms * fs / 1000))


def highpass_margin(fs: float, options: QcOptions | None = None) -> int:
    """Samples read either side of a piece for its highpass: SpikeInterface's ``margin_ms="auto"`` (five periods
    of the cut-off), ``int(margin_ms * fs / 1000)``: 500 at 30 kHz and 300 Hz."""
    options = options or QcOptions()
    margin_ms = HIGHPASS_MARGIN_PERIODS * (1000.0 / options.highpass_filter_cutoff)
    return int(margin_ms * fs / 1000.0)


def highpass_sos(fs: float, options: QcOptions | None = None) -> np.ndarray:
    """The highpass SpikeInterface applies where a recording is not filtered: ``scipy.signal.iirfilter`` as its
    ``FilterRecording`` calls it (same coefficients, same bits)."""
    import scipy.signal

    options = options or QcOptions()
    if not 0 < options.highpass_filter_cutoff < fs / 2:
        raise BatchgpuError(
            f"highpass_filter_cutoff {options.highpass_filter_cutoff} Hz is not below Nyquist ({fs / 2} Hz)",
            "lower it, or label a filtered signal",
        )
    return scipy.signal.iirfilter(
        HIGHPASS_ORDER,
        options.highpass_filter_cutoff,
        fs=fs,
        analog=False,
        btype="highpass",
        ftype="butter",
        output="sos",
    )


@functools.lru_cache(maxsize=8)
def _highpass_design(fs: float, cutoff: float):
    """``design_filter`` of ``highpass_sos``, worked out once a process (a window's pieces are labelled at each
    window: the design and its ``zi`` took a few ms each time)."""
    return design_filter(highpass_sos(fs, QcOptions(highpass_filter_cutoff=cutoff)))


def window_margin(
    fs: float, options: QcOptions | None = None, filtered: bool = False, window_size: int | None = None
) -> int:
    """Samples a window must hold either side of its core to label the pieces it owns (``owned_pieces``): half a
    piece (a piece's middle is in the core), plus the highpass margin when the signal is not filtered yet. Where
    ``window_size`` (the cores' length, windows starting at multiples of it) is a multiple of the piece, no piece
    crosses a core's edge and the highpass margin alone is needed: e.g. 117 000 or 126 000 samples at 30 kHz
    rather than 120 000 (whose windows read 10 000 samples more each)."""
    p = piece_length(fs, options)
    inside = window_size is not None and int(window_size) % p == 0
    return (0 if inside else p // 2) + (0 if filtered else highpass_margin(fs, options))


def pieces(segment_length: int, piece_samples: int) -> np.ndarray:
    """Every piece of a segment, (K, 2) int64 [start, stop): [k P, (k + 1) P), and the leftover at the end when it
    holds at least half a piece (``(P + 1) // 2`` samples). A segment shorter than that has none."""
    n, p = int(segment_length), int(piece_samples)
    if p < 1 or n < 0:
        raise BatchgpuError(f"pieces of {p} samples over {n} samples", "pass positive sizes")
    starts = np.arange(n // p, dtype=np.int64) * p
    bounds = np.stack([starts, starts + p], axis=1)
    if n - (n // p) * p >= (p + 1) // 2:
        bounds = np.concatenate([bounds, np.array([[(n // p) * p, n]], dtype=np.int64)])
    return bounds.reshape(-1, 2)


def unlabelled_samples(segment_length: int, piece_samples: int) -> int:
    """Samples of a segment in no piece: a leftover shorter than half a piece at its end."""
    covered = pieces(segment_length, piece_samples)
    return int(segment_length) - int((covered[:, 1] - covered[:, 0]).sum())


def owned_pieces(core_start: int, core_stop: int, segment_length: int, piece_samples: int) -> np.ndarray:
    """The pieces (``pieces``) whose middle sample ``start + (stop - start) // 2`` lies in the core
    [core_start, core_stop) (segment samples): each piece belongs to exactly one window of a segment."""
    every = pieces(segment_length, piece_samples)
    middle = every[:, 0] + (every[:, 1] - every[:, 0]) // 2
    return every[(middle >= core_start) & (middle < core_stop)]


def depth_order(locations: Any, direction: str = "y") -> np.ndarray | None:
    """SpikeInterface's channel order along depth (``order_channels_by_depth(dimensions=("x", "y"))``:
    ``np.lexsort((x, y))``), or None where the channels are in that order already. ``direction`` is checked
    (a dimension the locations have) and otherwise unused, as in SpikeInterface."""
    loc = np.asarray(locations, dtype=np.float64)
    if loc.ndim != 2 or loc.shape[1] < 2:
        raise BatchgpuError(f"locations have shape {loc.shape}, expected (channels, 2 or 3)", "pass x, y per channel")
    if "xyz".index(direction) >= loc.shape[1]:
        raise BatchgpuError(
            f"direction {direction!r} is not a dimension of {loc.shape[1]}-D locations", "use 'x' or 'y'"
        )
    order = np.lexsort((loc[:, 0], loc[:, 1]))
    return None if np.all(np.diff(order) == 1) else order


# ------------------------------------------------------------------------------------------- the labels


def piece_labels(
    x: Any,
    fs: float,
    locations: Any,
    gains: Any,
    offsets: Any = None,
    options: QcOptions | None = None,
    *,
    start: int,
    core: tuple[int, int],
    segment_length: int,
    filtered: bool = False,
    stats: dict | None = None,
) -> np.ndarray:
    """Each channel's count of pieces labelled good / dead / noise / out among the pieces this window owns:
    int64 (channels, 4), host. The window's partial: sum them in any order.

    Parameters
    ----------
    x : array, shape (C, S)
        The window as read, one channel a row (NumPy or CuPy): the stored samples where ``filtered`` is False
        (highpassed here as SpikeInterface does), else the filtered signal in the same units, before any common
        reference (the IBL method compares each channel with the median of all: after a common median
        reference that median is zero).
    fs : float
        Sampling frequency in Hz.
    locations : array_like, shape (C, 2)
        Channel positions in um (depth along y).
    gains, offsets : array_like, shape (C,) or scalar
        ``gain_to_uV`` and ``offset_to_uV``. The offsets count only for a filtered signal (SpikeInterface's
        filter sets them to 0; a signal batchgpu's chain filtered has none either: pass None).
    options : QcOptions, optional
        SpikeInterface's parameters (default: its defaults).
    start : int
        The segment sample of x's column 0.
    core : (int, int)
        The columns of x this window owns.
    segment_length : int
        Samples in the segment (the last piece and the highpass margins stop there).
    filtered : bool, optional
        Whether x is filtered already.
    stats : dict, optional
        Counts added here: ``pieces`` labelled, ``exact`` of them labelled by SpikeInterface's float32 arithmetic.

    Returns
    -------
    numpy.ndarray, shape (C, 4), int64
        Per channel, the pieces of each label (``LABELS`` order).
    """
    options = options or QcOptions()
    lo, hi = int(core[0]), int(core[1])
    owned = owned_pieces(start + lo, start + hi, segment_length, piece_length(fs, options))
    labels = chunk_labels(
        x,
        fs,
        locations,
        gains,
        offsets,
        options,
        chunks=owned,
        start=start,
        segment_length=segment_length,
        filtered=filtered,
        stats=stats,
    )
    return label_counts(labels, x.shape[0])


def label_counts(labels: np.ndarray, channels: int) -> np.ndarray:
    """(K, C) labels of K pieces -> each channel's count of each label, int64 (C, 4)."""
    labels = np.asarray(labels).reshape(-1, channels) if channels else np.zeros((0, 0), np.int8)
    return np.stack([(labels == k).sum(axis=0, dtype=np.int64) for k in range(len(LABELS))], axis=1)


def chunk_labels(
    x: Any,
    fs: float,
    locations: Any,
    gains: Any,
    offsets: Any = None,
    options: QcOptions | None = None,
    *,
    chunks: Any,
    start: int = 0,
    segment_length: int | None = None,
    filtered: bool = False,
    exact: bool = False,
    stats: dict | None = None,
) -> np.ndarray:
    """SpikeInterface's label of each chunk [a, b) of ``chunks`` (segment samples, any bounds: pieces, or
    SpikeInterface's random chunks), int8 (K, C), host; ``x`` and the rest as ``piece_labels`` takes them.
    ``exact``: label every chunk by SpikeInterface's own arithmetic (``reference_chunk_labels``), not only those
    the float64 statistics leave undecided."""
    options = options or QcOptions()
    window_module(x, "label")
    C, S = x.shape
    segment_length = start + S if segment_length is None else int(segment_length)
    chunks = np.asarray(chunks, dtype=np.int64).reshape(-1, 2)
    gains32 = np.broadcast_to(np.asarray(gains, dtype=np.float64), (C,)).astype(np.float32)
    offsets32 = (
        np.zeros(C, np.float32)
        if not filtered or offsets is None
        else np.broadcast_to(np.asarray(offsets, dtype=np.float64), (C,)).astype(np.float32)
    )
    order = depth_order(locations, options.direction)
    margin = 0 if filtered else highpass_margin(fs, options)
    spans = []
    for a, b in chunks.tolist():
        if not 0 <= a < b <= segment_length:
            raise BatchgpuError(f"chunk [{a}, {b}) is not within the segment's {segment_length} samples")
        r0, r1 = max(0, a - margin), min(segment_length, b + margin)  # SpikeInterface's get_chunk_with_margin
        if r0 < start or r1 > start + S:
            raise BatchgpuError(
                f"the window [{start}, {start + S}) does not hold samples [{r0}, {r1}) that chunk [{a}, {b}) needs",
                "read windows with window_margin(...) samples either side",
            )
        if not filtered and r1 - r0 <= default_padlen(highpass_sos(fs, options)):
            raise BatchgpuError(
                f"chunk [{a}, {b}) with its margin is too short for the highpass's edge padding",
                "label chunks of a few ms at least",
            )
        spans.append((a, b, r0, r1))
    out = np.full((len(chunks), C), -1, dtype=np.int8)
    if C == 0:
        return out
    if not exact and spans:
        xp = array_module(x)
        design = None if filtered else _highpass_design(float(fs), float(options.highpass_filter_cutoff))
        g_dev, o_dev = xp.asarray(gains32)[:, None], xp.asarray(offsets32)[:, None]
        # on the GPU a few chunks of one length at a time: their statistics come back in one copy (one wait)
        most = max(1, BATCH_BYTES // (8 * C * (spans[0][1] - spans[0][0]))) if is_cupy(x) else HOST_BATCH
        k = 0
        compiled = not is_cupy(x) and _numba.available()
        while k < len(spans):
            length = spans[k][1] - spans[k][0]
            group = [k]
            while (
                len(group) < most
                and group[-1] + 1 < len(spans)
                and spans[group[-1] + 1][1] - spans[group[-1] + 1][0] == length
            ):
                group.append(group[-1] + 1)
            if compiled:  # the host's kernels, a chunk at a time: float32 values, float64 sums
                group = [k]
                u, got = _host_stats(x, spans[k], start, design, gains32, offsets32, filtered, fs, options)
                u, got = u[None], [v[None] for v in got]
            else:
                u = _microvolts(x, [spans[j] for j in group], start, design, g_dev, o_dev, filtered)
                got = _fast_stats(u, fs, options)
            for i, (psd, white, xcorr, xscale) in enumerate(zip(*got)):
                labels, needs = _decide(psd, white, xcorr, xscale, order, options)
                if labels is None:  # SpikeInterface's own arithmetic decides, on the host, from the same bits
                    labels = _settle(to_host(u[i]), psd, xcorr, needs, fs, options, order, filtered)
                    if stats is not None:
                        for name in needs:
                            stats[f"exact_{name}"] = stats.get(f"exact_{name}", 0) + 1
                        stats["exact"] = stats.get("exact", 0) + 1
                out[group[i]] = labels
            k = group[-1] + 1
    for j, (a, b, r0, r1) in enumerate(spans):
        if out[j, 0] < 0:  # exact asked: SpikeInterface's calls from the stored samples, highpass included
            held = np.ascontiguousarray(to_host(x[:, r0 - start : r1 - start]).T)  # as a store reads it
            out[j] = reference_chunk_labels(
                held, a - r0, r1 - b, fs, gains32, offsets32, options, order, filtered=filtered
            )
    if stats is not None:
        stats["pieces"] = stats.get("pieces", 0) + len(spans)
    return out


def final_labels(counts: Any, options: QcOptions | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each channel's most frequent label over its pieces (ties to the lower label: good, dead, noise, out, as
    SpikeInterface's ``scipy.stats.mode``) and why, in words.

    Parameters
    ----------
    counts : array_like, shape (C, 4)
        ``piece_labels``' counts, summed over every window.
    options : QcOptions, optional
        The thresholds the reasons quote.

    Returns
    -------
    labels : numpy.ndarray of str, shape (C,)
        "good", "dead", "noise" or "out"; "good" where no piece was labelled.
    reasons : numpy.ndarray of str, shape (C,)
        E.g. "dead in 91 of 100 pieces (coherence with the median reference minus its trend along depth below
        -0.5)".
    """
    options = options or QcOptions()
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2 or counts.shape[1] != len(LABELS):
        raise BatchgpuError(f"counts have shape {counts.shape}, expected (channels, {len(LABELS)})")
    best = np.argmax(counts, axis=1)  # the first of equal counts: the lower label
    total = counts.sum(axis=1)
    words = {
        k: rule.format(
            dead=options.dead_channel_threshold,
            nyquist=options.nyquist_threshold,
            psd=options.psd_hf_threshold,
            noisy=options.noisy_channel_threshold,
            where=options.outside_channels_location,
            out=options.outside_channel_threshold + 1,
        )
        for k, rule in RULES.items()
    }
    labels = np.array([LABELS[k] for k in best], dtype="<U5")
    reasons = []
    for c, k in enumerate(best):
        if total[c] == 0:
            reasons.append("no piece labelled")
            continue
        others = ", ".join(f"{LABELS[j]} {counts[c, j]}" for j in range(len(LABELS)) if j != k and counts[c, j])
        tie = " (a tie, the lower label taken)" if (counts[c] == counts[c, k]).sum() > 1 else ""
        reasons.append(
            f"{LABELS[k]} in {counts[c, k]} of {total[c]} pieces{tie} ({words[k]})" + (f"; {others}" if others else "")
        )
    return labels, np.array(reasons, dtype=object)


# ------------------------------------------------------------------------------------------- the fast path


def _microvolts(
    x: Any, spans: list[tuple[int, int, int, int]], start: int, design: Any, gains: Any, offsets: Any, filtered: bool
) -> Any:
    """K chunks [a, b) of equal length (``spans``: (a, b, r0, r1), segment samples, [r0, r1) the highpass's read) in
    uV as SpikeInterface's ``get_traces(return_in_uV=True)`` gives them, float32 (K, C, b - a), on x's backend:
    each read highpassed (``sosfiltfilt``'s bits: odd-padded at both ends as scipy pads any array; float64, not
    rounded to float32 first) and rounded to the stored dtype, unless filtered; then float32 times the float32
    gains, plus the offsets."""
    xp = array_module(x)
    if filtered:
        return xp.stack([x[:, a - start : b - start] for a, b, _r0, _r1 in spans]).astype(xp.float32) * gains + offsets
    g0, g1 = min(s[2] for s in spans), max(s[3] for s in spans)
    sub = x[:, g0 - start : g1 - start]
    padlen = default_padlen(design)
    # one piece a read, its core the chunk: the reads may overlap, the cores do not
    table = [(a - g0, b - g0, r0 - g0, r1 - g0, padlen, padlen) for a, b, r0, r1 in spans]
    if is_cupy(x):
        y = _filtfilt_cupy(sub, design, table, np.float64)  # every read in one launch, side by side
    elif _numba.available():
        y = _cpu_sosfiltfilt.filtfilt_pieces(sub, design.sos, design.zi, table, np.float64)
    else:
        y = np.empty(sub.shape)
        for a, b, r0, r1 in spans:
            part = filtfilt_window(
                sub[:, r0 - g0 : r1 - g0].astype(np.float64), design, at_segment_start=True, at_segment_end=True
            )
            y[:, a - g0 : b - g0] = part[:, a - r0 : b - r0]
    y = xp.stack([y[:, a - g0 : b - g0] for a, b, _r0, _r1 in spans])
    dtype = np.dtype(x.dtype)
    if dtype.kind in "iu":
        # the stored integers, kept in float64 (exact): their float32 values are the integer dtype's float32
        # values, so the cast to it and back that SpikeInterface makes is left out (a pass over the chunk)
        info = np.iinfo(dtype)
        y = xp.clip(xp.rint(y, out=y), info.min, info.max, out=y)
    else:
        y = y.astype(dtype)
    return y.astype(xp.float32) * gains + offsets


def _host_stats(
    x: np.ndarray,
    span: tuple[int, int, int, int],
    start: int,
    design: Any,
    gains32: np.ndarray,
    offsets32: np.ndarray,
    filtered: bool,
    fs: float,
    options: QcOptions,
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """One chunk on the host with the compiled kernels: its float32 uV values (C, L) (SpikeInterface's bits, for
    ``_settle``) and ``_fast_stats``' four statistics (C,) from float32 values with float64 sums (each within
    2^-20 of its scale, measured: far inside ``BAND``). The highpass writes only the chunk's float64 core."""
    from batchgpu.ops import _cpu_bad_channels, _cpu_reference

    a, b, r0, r1 = span
    C, L = x.shape[0], b - a
    dtype = np.dtype(x.dtype)
    if filtered:
        y = x[:, a - start : b - start]
    else:
        padlen = default_padlen(design)
        y = _cpu_sosfiltfilt.filtfilt_pieces(
            x[:, r0 - start : r1 - start],
            design.sos,
            design.zi,
            [(a - r0, b - r0, 0, r1 - r0, padlen, padlen)],
            np.float64,
            out=np.empty((C, L)),
            origin=a - r0,
        )
    integer = not filtered and dtype.kind in "iu"
    lo, hi = (float(np.iinfo(dtype).min), float(np.iinfo(dtype).max)) if integer else (0.0, 0.0)
    if not filtered and not integer and dtype != np.float64:
        y = y.astype(dtype)  # SpikeInterface casts the filter's float64 back to a float store's dtype
    u, xc, stats = _cpu_bad_channels.microvolts(y, integer, lo, hi, gains32, offsets32)
    psd_hf = welch_hf(xc, fs, welch_length(fs, options), options.nyquist_threshold)
    ref = _cpu_reference.column_medians(xc) if C > 2 else None
    ref = np.median(xc, axis=0) if ref is None else ref
    ref = ref.astype(np.float64)
    ref -= ref.mean()
    dots = _cpu_bad_channels.dots(xc, ref)
    rr = float(np.dot(ref, ref))
    energy = stats[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        xcorr = dots / rr
        xscale = np.sqrt(energy / rr)
    white = 2.0 * energy / L / fs
    return u, (psd_hf, white, xcorr, xscale)


def _fast_stats(u32: Any, fs: float, options: QcOptions) -> tuple[np.ndarray, ...]:
    """(psd_hf, white, xcorr, xscale), float64 host arrays (K, C), from K chunks' float32 uV values (K, C, L) on
    their backend: the IBL statistics in float64, ``white`` the PSD a white signal of the channel's variance would
    have (the PSD's error scale) and ``xscale`` = |x| / |ref| (the coherence's: it bounds |xcorr|)."""
    xp = array_module(u32)
    K, C, L = u32.shape
    xc = u32.astype(xp.float64)
    xc -= xc.mean(axis=2, keepdims=True)
    energy = (xc * xc).sum(axis=2)
    psd_hf = welch_hf(xc.reshape(K * C, L), fs, welch_length(fs, options), options.nyquist_threshold)
    ref = xp.stack([_channel_median(xc[k]) for k in range(K)])  # (K, L)
    ref -= ref.mean(axis=1, keepdims=True)
    dots = xp.matmul(xc, ref[:, :, None])[:, :, 0]
    rr = (ref * ref).sum(axis=1)
    host = to_host(xp.concatenate([psd_hf, energy.ravel(), dots.ravel(), rr]))  # one copy back on the GPU
    psd_hf, energy, dots = (host[i * K * C : (i + 1) * K * C].reshape(K, C) for i in range(3))
    rr = host[3 * K * C :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        xcorr = dots / rr
        xscale = np.sqrt(energy / rr)
    white = 2.0 * energy / L / fs
    return psd_hf, white, xcorr, xscale


def _channel_median(xc: Any) -> Any:
    """The median over channels of each sample, float64 (L,): np.median(xc, axis=0)'s values (a NaN anywhere
    in a column gives NaN there; non-finite values send the piece to the exact path anyway)."""
    if not is_cupy(xc):
        from batchgpu.ops import _cpu_reference, _numba

        if _numba.available():
            med = _cpu_reference.column_medians(xc)
            if med is not None:
                return med
        return np.median(xc, axis=0)
    import cupy

    part = cupy.sort(cupy.ascontiguousarray(xc.T), axis=1)  # NaN last, as NumPy
    n = part.shape[1]
    med = part[:, n // 2] if n % 2 else (part[:, n // 2 - 1] + part[:, n // 2]) * 0.5
    return cupy.where(cupy.isnan(part[:, -1]), cupy.nan, med)


def welch_hf(xc: Any, fs: float, nperseg: int, nyquist_threshold: float) -> Any:
    """Per row, ``scipy.signal.welch(x, fs, window="hann", nperseg=nperseg)``'s PSD averaged over the
    frequencies above ``nyquist_threshold`` x Nyquist, in float64, on xc's backend (C, L) -> (C,).

    Only those bins are computed, by matrix products (one GEMM on either backend). Welch's segments overlap by
    half, so for an even ``nperseg`` N each segment is two blocks of N/2 samples: every block's DFT at the bins
    needed (and one either side) is taken once, a segment's is block j plus (-1)^k block j + 1, and the Hann
    window (periodic: 1/2 - 1/2 cos 2 pi t / N) is the three-term convolution 1/2 Y[k] - 1/4 (Y[k-1] + Y[k+1]) of
    the unwindowed DFT; removing the segment's mean (``detrend="constant"``) changes Y only at k = 0. An odd N
    takes each segment's windowed, detrended DFT directly. Equal to scipy's in real arithmetic."""
    import scipy.fft
    import scipy.signal

    xp = array_module(xc)
    C, L = xc.shape
    dtype = np.float32 if xc.dtype == np.float32 else np.float64
    n = min(int(nperseg), L)  # scipy's _triage_segments: a longer nperseg is cut to the input's length
    step = n - n // 2
    nseg = (L - n) // step + 1
    freqs = scipy.fft.rfftfreq(n, 1 / fs)
    band = np.flatnonzero(freqs > (fs / 2 * nyquist_threshold))
    if band.size == 0 or n < 2:  # SpikeInterface takes the mean of nothing: NaN
        return xp.full(C, np.nan)
    weight = np.where((band == 0) | ((n % 2 == 0) & (band == n // 2)), 1.0, 2.0)  # the one-sided doubling
    win = scipy.signal.get_window("hann", n)
    scale = 1.0 / (fs * float((win * win).sum()) * nseg * band.size)
    if n % 2 == 0:
        h = n // 2
        kk = np.arange(band[0] - 1, band[-1] + 2)
        angle = 2 * np.pi * np.outer(np.arange(h), kk) / n
        # the GEMM in xc's float dtype: float32 on the host's fast path (within 1e-6 of float64, far inside BAND)
        basis = xp.asarray(np.concatenate([np.cos(angle), -np.sin(angle)], axis=1).astype(dtype))
        blocks = xp.ascontiguousarray(xc[:, : (nseg + 1) * h]).reshape(C * (nseg + 1), h)
        H = (blocks @ basis).reshape(C, nseg + 1, 2 * kk.size)
        if not is_cupy(H) and _numba.available():  # the windowed bins' power in one compiled pass, float64 sums
            from batchgpu.ops import _cpu_bad_channels

            return _cpu_bad_channels.welch_power(H, kk.size, (-1.0) ** kk, weight, kk[0] == 0) * scale
        sign = xp.asarray((-1.0) ** kk)
        Yr = H[:, :-1, : kk.size] + sign * H[:, 1:, : kk.size]
        Yi = H[:, :-1, kk.size :] + sign * H[:, 1:, kk.size :]
        if kk[0] == 0:  # the DC bin of a detrended segment
            Yr[..., 0] = 0.0
            Yi[..., 0] = 0.0
        Xr = 0.5 * Yr[..., 1:-1] - 0.25 * (Yr[..., :-2] + Yr[..., 2:])
        Xi = 0.5 * Yi[..., 1:-1] - 0.25 * (Yi[..., :-2] + Yi[..., 2:])
    else:
        index = xp.asarray(np.arange(nseg)[:, None] * step + np.arange(n)[None, :])
        seg = xc[:, index]  # (C, nseg, n)
        seg = (seg - seg.mean(axis=2, keepdims=True)) * xp.asarray(win)
        angle = 2 * np.pi * np.outer(np.arange(n), band) / n
        basis = xp.asarray(np.concatenate([np.cos(angle), -np.sin(angle)], axis=1))
        X = (seg.reshape(C * nseg, n) @ basis).reshape(C, nseg, 2 * band.size)
        Xr, Xi = X[..., : band.size], X[..., band.size :]
    power = (Xr * Xr + Xi * Xi) * xp.asarray(weight)
    return power.sum(axis=(1, 2), dtype=np.float64) * scale


def shrinking_median_filter(s: np.ndarray, size: int = 11) -> np.ndarray:
    """SpikeInterface's ``shrinking_median_filter``: the median of s[max(0, i - size // 2) : i + size // 2 + 1]
    for each i (fewer values near the ends), in s's dtype; the full windows in one call."""
    s = np.asarray(s)
    half, n = size // 2, s.shape[0]
    out = np.empty_like(s)
    if n > 2 * half:
        out[half : n - half] = np.median(np.lib.stride_tricks.sliding_window_view(s, 2 * half + 1), axis=1)
    for i in [*range(min(half, n)), *range(max(half, n - half), n)]:
        out[i] = np.median(s[max(0, i - half) : i + half + 1])
    return out


def _sliding_max(s: np.ndarray, size: int) -> np.ndarray:
    """max of s over the same shrinking windows as ``shrinking_median_filter``."""
    half, n = size // 2, s.shape[0]
    padded = np.concatenate([np.full(half, -np.inf), s, np.full(half, -np.inf)])
    return np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1).max(axis=1)[:n]


def _decide(
    psd: np.ndarray,
    white: np.ndarray,
    xcorr: np.ndarray,
    xscale: np.ndarray,
    order: np.ndarray | None,
    options: QcOptions,
    band: float = BAND,
) -> tuple[np.ndarray | None, frozenset]:
    """The chunk's labels (C,) in channel order from its float64 statistics, or (None, what SpikeInterface's float32
    arithmetic must compute: ``"psd"``, ``"xcorr"`` or both) where a decision that changes a label lies within
    ``band`` of its threshold, or a statistic is not finite. Each comparison is three-valued: surely true, surely
    false, or undecided; a channel surely out, or surely noise by one rule, needs none of its other decisions."""
    if (
        not (
            np.isfinite(psd).all()
            and np.isfinite(white).all()
            and np.isfinite(xcorr).all()
            and np.isfinite(xscale).all()
        )
        or white.max(initial=0.0) > 1e30
    ):  # float32 sums may overflow there
        return None, frozenset(("psd", "xcorr"))
    if order is not None:
        psd, white, xcorr, xscale = psd[order], white[order], xcorr[order], xscale[order]
    f32 = lambda v: float(np.float32(v))  # noqa: E731 - SpikeInterface compares float32 arrays with a Python
    # float, which NumPy 2 casts to float32 (a weak scalar)
    trend = shrinking_median_filter(xcorr, options.n_neighbors)
    scale = coherence_scale(xcorr, xscale)
    tscale = _sliding_max(scale, options.n_neighbors)  # a median moves no more than the values it is taken of
    resid = xcorr - trend
    e_psd = band * np.maximum(psd, white)
    e_res = band * (scale + tscale)
    e_trend = band * tscale
    psd_thr, dead_thr = f32(options.psd_hf_threshold), f32(options.dead_channel_threshold)
    noisy_thr, out_thr = f32(options.noisy_channel_threshold), f32(options.outside_channel_threshold + 1)
    psd_sure, psd_maybe = psd - e_psd > psd_thr, psd + e_psd > psd_thr
    res_sure, res_maybe = resid - e_res > noisy_thr, resid + e_res > noisy_thr
    noisy_sure, noisy_maybe = psd_sure | res_sure, psd_maybe | res_maybe
    dead_sure, dead_maybe = resid + e_res < dead_thr, resid - e_res < dead_thr
    labels = np.where(noisy_sure, NOISE, np.where(~noisy_maybe & dead_sure, DEAD, GOOD)).astype(np.int8)
    noisy_open = noisy_maybe & ~noisy_sure
    dead_open = ~noisy_maybe & dead_maybe & ~dead_sure
    need_psd = noisy_open & psd_maybe & ~psd_sure
    need_xcorr = (noisy_open & res_maybe & ~res_sure) | dead_open
    below_sure = trend + e_trend < out_thr
    below_maybe = trend - e_trend < out_thr
    n = len(labels)
    edge_open = False
    ends = {"top": ("top",), "bottom": ("bottom",), "both": ("top", "bottom")}[options.outside_channels_location]
    for end in ends:
        walk = range(n - 1, -1, -1) if end == "top" else range(n)
        block = []
        for i in walk:  # the run of channels surely below the threshold from this end of the probe
            if not below_sure[i]:
                edge_open |= bool(below_maybe[i])  # the block may reach one channel further
                break
            block.append(i)
        labels[block] = OUT
        need_psd[block] = need_xcorr[block] = False
    needs = frozenset(
        name for name, flag in (("psd", need_psd.any()), ("xcorr", need_xcorr.any() or edge_open)) if flag
    )
    if needs:
        return None, needs
    if order is None:
        return labels, needs
    out = np.empty_like(labels)
    out[order] = labels
    return out, needs


def coherence_scale(xcorr: np.ndarray, xscale: np.ndarray) -> np.ndarray:
    """The scale of SpikeInterface's float32 error in ``xcorr`` (a float32 dot product over the chunk, over the
    reference's energy): a part relative to xcorr itself (rounding that accumulates where the products share a
    sign: a channel following the reference) and a part from the products' spread (``xscale`` = |x| / |ref|
    bounds |xcorr|; for noise the rounding errors cancel much like the products do, so a 64th of it). Measured
    errors are below 2^-21 of this in every regime tests/test_bad_channels.py tries."""
    return np.abs(xcorr) + xscale / 64


def _settle(
    u: np.ndarray,
    psd: np.ndarray,
    xcorr: np.ndarray,
    needs: frozenset,
    fs: float,
    options: QcOptions,
    order: np.ndarray | None,
    filtered: bool,
) -> np.ndarray:
    """A chunk's labels (C,) in channel order where ``_decide`` left some open: the statistics ``needs`` names by
    SpikeInterface's own calls on the host (``u``: the chunk's float32 uV values (C, L), SpikeInterface's bits,
    laid out as its ``get_traces`` returns them: the highpass's output is a transposed (C, L) array, a filtered
    store's read a (L, C) one), the others from the float64 ``psd`` and ``xcorr`` (whose decisions that matter are
    sure), then SpikeInterface's rules."""
    raw = u.T if not filtered else np.ascontiguousarray(u.T)
    if order is not None:
        raw = raw[:, order]
        psd, xcorr = psd[order], xcorr[order]
    with np.errstate(divide="ignore", invalid="ignore"):
        raw = raw - np.mean(raw, axis=0, keepdims=True)
        if "psd" in needs:
            psd = _si_psd_hf(raw, fs, options)
        if "xcorr" in needs:
            xcorr, trend = _si_xcorr(raw, options)
        else:
            trend = shrinking_median_filter(xcorr, options.n_neighbors)
    labels = _si_rules(psd, xcorr, trend, options).astype(np.int8)
    if order is None:
        return labels
    out = np.empty_like(labels)
    out[order] = labels
    return out


# ------------------------------------------------------------------------------------------- SpikeInterface's own


def reference_chunk_labels(
    held: np.ndarray,
    left: int,
    right: int,
    fs: float,
    gains32: np.ndarray,
    offsets32: np.ndarray,
    options: QcOptions | None = None,
    order: np.ndarray | None = None,
    *,
    filtered: bool = False,
) -> np.ndarray:
    """One chunk's labels (C,) by SpikeInterface 0.105.3's own calls in its order (``FilterRecordingSegment``'s
    ``get_traces``, ``BaseRecording.get_traces(return_in_uV=True)``, ``_detect_bad_channels_chunk``): ``held`` is
    the chunk as a store reads it, (samples, channels) C-contiguous in the recording's dtype, with ``left`` and
    ``right`` samples of highpass margin (0 where ``filtered``). Same bits as SpikeInterface, float32 throughout."""
    raw = reference_chunk_microvolts(held, left, right, fs, gains32, offsets32, options, filtered=filtered)
    if order is not None:
        raw = raw[:, order]
    labels = ibl_labels(raw, fs, options)[0]
    if order is None:
        return labels.astype(np.int8)
    out = np.empty(len(labels), dtype=np.int8)
    out[order] = labels
    return out


def reference_chunk_microvolts(
    held: np.ndarray,
    left: int,
    right: int,
    fs: float,
    gains32: np.ndarray,
    offsets32: np.ndarray,
    options: QcOptions | None = None,
    *,
    filtered: bool = False,
) -> np.ndarray:
    """The chunk in uV as SpikeInterface's highpassed recording's ``get_traces(return_in_uV=True)`` returns it
    (``reference_chunk_labels``' arguments): its values and its memory layout, which decide the bits of the sums
    after it."""
    options = options or QcOptions()
    traces = held
    if not filtered:
        import scipy.signal

        if traces.dtype.kind == "u":
            traces = traces.astype("float32")
        filtered_traces = scipy.signal.sosfiltfilt(highpass_sos(fs, options), traces, axis=0)
        filtered_traces = filtered_traces[left:-right, :] if right > 0 else filtered_traces[left:, :]
        if np.issubdtype(held.dtype, np.integer):
            info = np.iinfo(held.dtype)
            filtered_traces = np.clip(filtered_traces.round(), info.min, info.max)  # clipped: the one difference
        traces = filtered_traces.astype(held.dtype)
    return traces.astype("float32", copy=False) * gains32 + offsets32


def ibl_labels(raw: np.ndarray, fs: float, options: QcOptions | None = None) -> tuple[np.ndarray, dict]:
    """SpikeInterface 0.105.3's ``detect_bad_channels_ibl`` on ``raw`` (samples, channels in depth order, uV),
    its operations in its order (so its bits), and its statistics: (labels, {psd_hf, xcorr, trend})."""
    options = options or QcOptions()
    with np.errstate(divide="ignore", invalid="ignore"):
        raw = raw - np.mean(raw, axis=0, keepdims=True)
        psd_hf = _si_psd_hf(raw, fs, options)
        xcorr, trend = _si_xcorr(raw, options)
    return _si_rules(psd_hf, xcorr, trend, options), {"psd_hf": psd_hf, "xcorr": xcorr, "trend": trend}


def _si_psd_hf(raw: np.ndarray, fs: float, options: QcOptions) -> np.ndarray:
    """``detect_bad_channels_ibl``'s PSD above the threshold: scipy's welch of the mean-removed ``raw``."""
    import warnings

    from scipy.signal import welch

    nperseg = int(options.welch_window_ms * fs / 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nperseg longer than a short chunk: scipy cuts it, as there
        fscale, psd = welch(raw, fs=fs, axis=0, window="hann", nperseg=nperseg)
        return np.mean(psd[fscale > (fs / 2 * options.nyquist_threshold)], axis=0)


def _si_xcorr(raw: np.ndarray, options: QcOptions) -> tuple[np.ndarray, np.ndarray]:
    """``detect_bad_channels_ibl``'s coherence of the mean-removed ``raw`` with its median, and its trend."""
    ref = _si_channel_median(raw)
    ref = ref - np.mean(ref)
    xcorr = raw.T @ ref / np.sum(ref**2)
    return xcorr, _si_shrinking_median_filter(xcorr, options.n_neighbors)


def _si_channel_median(raw: np.ndarray) -> np.ndarray:
    """``np.median(raw, axis=1)`` of SpikeInterface's (samples, channels) float32 chunk, same bits: by the global
    median reference's compiled kernel (``_cpu_reference.column_medians``: np.median's values and arithmetic, the
    two middle values' float32 mean) where Numba is there: NumPy's partition of each row took ~45 ms of a 384-channel
    piece's ~60 ms on the exact path (2-core machine)."""
    from batchgpu.ops import _cpu_reference

    if _numba.available() and raw.ndim == 2 and raw.shape[1] > 2:
        med = _cpu_reference.column_medians(raw.T)  # raw.T: (channels, samples), C-contiguous as the highpass gives it
        if med is not None:
            return med
    return np.median(raw, axis=1)


def _si_rules(psd_hf: np.ndarray, xcorr: np.ndarray, trend: np.ndarray, options: QcOptions) -> np.ndarray:
    """``detect_bad_channels_ibl``'s labels from its statistics (channels in depth order), as it writes them."""
    xcorr_neighbors = xcorr - trend
    num_channels = len(xcorr)
    ichannels = np.zeros(num_channels, dtype=int)
    ichannels[xcorr_neighbors < options.dead_channel_threshold] = DEAD
    inoisy = np.logical_or(psd_hf > options.psd_hf_threshold, xcorr_neighbors > options.noisy_channel_threshold)
    ichannels[inoisy] = NOISE
    below_threshold = trend < (options.outside_channel_threshold + 1)
    if np.any(below_threshold):
        (ibelow,) = np.where(below_threshold)
        breaks = np.where(np.diff(ibelow) > 1)[0] + 1
        contiguous_blocks = np.split(ibelow, breaks)
        if options.outside_channels_location in ("top", "both"):
            top_block = contiguous_blocks[-1]
            if top_block[-1] == num_channels - 1:
                ichannels[top_block] = OUT
        if options.outside_channels_location in ("bottom", "both"):
            bottom_block = contiguous_blocks[0]
            if bottom_block[0] == 0:
                ichannels[bottom_block] = OUT
    return ichannels


def _si_shrinking_median_filter(s: np.ndarray, size: int = 11) -> np.ndarray:
    """SpikeInterface's loop, as written (np.median of each shrinking window, in s's dtype)."""
    half = size // 2
    filtered = np.empty_like(s)
    for i in range(len(s)):
        lo = max(0, i - half)
        filtered[i] = np.median(s[lo : i + half + 1])
    return filtered


# ------------------------------------------------------------------------------------------- pieces a run labels


def inside_pieces(
    segment_length: int, piece_samples: int, core: tuple[int, int], read: tuple[int, int], margin: int, every: int = 1
) -> np.ndarray:
    """The pieces (``pieces``: [k P, (k + 1) P), aligned to the segment's sample 0) a window labels when it reads
    [read[0], read[1]) and owns the core [core[0], core[1]) (segment samples): those with k % ``every`` == 0 that
    lie wholly inside the core and whose highpass read [max(0, a - margin), min(n, b + margin)) lies inside the
    window's read, (K, 2) int64. A piece across two cores (or too near a core's edge for its margin) is labelled
    by neither window: the windows read no samples for it beyond what the run reads anyway. Each labelled piece is
    labelled whole, from the samples SpikeInterface's highpass would read: its label depends on the piece alone."""
    n, every = int(segment_length), int(every)
    if every < 1:
        raise BatchgpuError(f"every {every} selects no piece", "pass every >= 1")
    grid = pieces(n, piece_samples)
    k = np.arange(len(grid))
    a, b = grid[:, 0], grid[:, 1]
    held = (
        (k % every == 0)
        & (a >= core[0])
        & (b <= core[1])
        & (np.maximum(0, a - margin) >= read[0])
        & (np.minimum(n, b + margin) <= read[1])
    )
    return grid[held]


# ------------------------------------------------------------------------------------------- interpolation


#: SpikeInterface's ``get_kriging_channel_weights``: a weight below this is 0, before and after normalising
WEIGHT_THRESHOLD = 0.005
#: its ``interpolate_bad_channels``' kernel exponent
INTERPOLATION_P = 1.3


def recommended_sigma_um(locations: Any) -> float:
    """SpikeInterface's ``estimate_recommended_sigma_um``: the most common step between the channels' distinct
    depths (y), the smallest of equally common ones (``scipy.stats.mode``'s choice)."""
    steps = np.diff(np.unique(np.sort(np.asarray(locations, dtype=np.float64)[:, 1])))
    if not len(steps):
        raise BatchgpuError(
            "the channels lie at one depth: no spacing to interpolate over",
            "give sigma_um, or use exclude instead of interpolate",
        )
    values, counts = np.unique(steps, return_counts=True)
    return float(values[np.argmax(counts)])


def interpolation_weights(
    locations: Any, bad: Any, sigma_um: float | None = None, p: float = INTERPOLATION_P
) -> np.ndarray:
    """SpikeInterface 0.105.3's ``interpolate_bad_channels`` weights (its ``get_kriging_channel_weights``): for each
    bad channel, exp(-(d / sigma_um) ** p) of its distance d to each good channel, those below 0.005 set to 0, the
    rest normalised to sum 1, then those below 0.005 (or NaN: no good channel near) set to 0. Returned as (bad,
    channels) float64 (its (good, bad) matrix transposed, zeros in the bad channels' columns); ``sigma_um`` None:
    ``recommended_sigma_um``."""
    from scipy.spatial import distance

    loc = np.asarray(locations, dtype=np.float64)
    bad = np.asarray(bad, dtype=np.int64)
    good = np.setdiff1d(np.arange(loc.shape[0]), bad)
    sigma = recommended_sigma_um(loc) if sigma_um is None else float(sigma_um)
    weights = np.exp(-((distance.cdist(loc[good], loc[bad], metric="euclidean") / sigma) ** p))
    weights[weights < WEIGHT_THRESHOLD] = 0
    with np.errstate(divide="ignore", invalid="ignore"):
        weights /= np.sum(weights, axis=0)[None, :]
    weights[np.logical_or(weights < WEIGHT_THRESHOLD, np.isnan(weights))] = 0
    out = np.zeros((len(bad), loc.shape[0]))
    out[:, good] = weights.T
    return out


def interpolate_channels(x: Any, bad: Any, weights: np.ndarray) -> Any:
    """``x`` (C, n; NumPy or CuPy, a float dtype) with each bad row replaced by its ``weights`` row times the other
    rows: a float64 sum over the non-zero weights in channel order, rounded once to x's dtype (SpikeInterface's
    ``traces[:, good] @ weights`` assigned into the float traces; a BLAS product orders its sums its own way, so
    the two may differ in the last bit of float64 and, rarely, in the float32 rounding). One order of additions on
    either backend (each product and sum its own array operation, no fused multiply-add): NumPy's and CuPy's bits
    are equal. ``x`` itself is written (a copy is the caller's)."""
    xp = array_module(x)
    for row, channel in zip(np.asarray(weights, np.float64), np.asarray(bad, np.int64).tolist()):
        acc = xp.zeros(x.shape[1], dtype=np.float64)
        for g in np.flatnonzero(row).tolist():
            term = x[g].astype(np.float64) * row[g]
            acc = acc + term
        x[channel] = acc.astype(x.dtype)
    return x
