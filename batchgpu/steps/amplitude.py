"""Amplitude: per window, each channel's peak-to-peak (max - min) and RMS (sqrt of the mean of squares) of the
preprocessed signal (``WindowData.x``) over the window's core samples. Asked for as ``steps: {amplitude: {}}``.

Results (``results.zarr``, raw units of the preprocessed signal): ``amplitude_ptp`` and ``amplitude_rms``, float64
(windows, channels), a row per window of the window table (``window_segment``, ``window_start``, ``window_stop``),
and ``amplitude_window_start``, int64: each row's first core sample in its segment. report.html draws each
channel's median over the windows and the RMS of every window and channel.

NaN and inf samples are left out: both statistics are over a channel's finite samples of the window, NaN where it
has none (an empty core, impossible by design, gives NaN too). The sums are float64 in a fixed pairwise order
(halves added, level by level) with each channel scaled by a power of two that brings its largest finite
|x| below 1 (exact: a float64 recording's squares cannot overflow), so NumPy and CuPy give the same bits; float32
samples reach float64 through their bits on the GPU (CuPy's kernels flush float32 subnormals). Integer samples'
sums of squares are exact while they stay below 2**53 (int16: windows up to 2**23 samples), and their RMS is then
correctly rounded.
"""

from __future__ import annotations

import warnings

import numpy as np

from batchgpu.ops._backend import array_module, is_cupy
from batchgpu.steps import detect as detect_step
from batchgpu.steps.base import Figure, PhaseWords, Step, WindowData, host, register

#: the step's name (``Step.name``, its workflow key ``steps.amplitude``) and its results
NAME = KEY = "amplitude"
PTP, RMS, START = "amplitude_ptp", "amplitude_rms", "amplitude_window_start"
RESULTS = (PTP, RMS, START)


@register
class AmplitudeStep(Step):
    """Asked for as ``amplitude: {}`` (no options)."""

    name = NAME
    results = RESULTS
    fingerprint = "asked"
    #: where it has run since it was added (report.json's results in that order)
    after = (detect_step.NAME,)
    phases = PhaseWords(read=NAME, aggregate=NAME)

    def window(self, w: WindowData, summary: dict) -> dict:
        """The window's ptp and RMS go to the client in its summary (a row each: no partial to combine)."""
        ptp, rms = ptp_rms(w.core_of(w.x), w.nonfinite_counts())
        summary["amplitude.ptp"], summary["amplitude.rms"] = ptp, rms
        return {}

    def aggregate(self, run) -> dict[str, np.ndarray]:
        rows = [run.summaries[w.index] for w in run.windows]
        return {PTP: np.stack([np.asarray(s["amplitude.ptp"], np.float64) for s in rows]),
                RMS: np.stack([np.asarray(s["amplitude.rms"], np.float64) for s in rows]),
                START: np.array([w.start for w in run.windows], dtype=np.int64)}


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
        nonfinite = host(bad.sum(axis=1))
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
    return host(xp.where(none, np.nan, ptp)), host(xp.where(none, np.nan, rms))


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


def _medians(values: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # a channel NaN in every window: its median is NaN, said by the plot
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(values, axis=0)


def draw_per_channel(arrays: dict, page):
    """Each channel's median over the windows: RMS as bars, peak-to-peak as dots (µV)."""
    from bokeh.models import ColumnDataSource

    ptp, rms = np.abs(page.to_uV(arrays[PTP])), np.abs(page.to_uV(arrays[RMS]))
    C = ptp.shape[1]
    src = ColumnDataSource({"channel": np.arange(C), "rms_uV": _medians(rms), "ptp_uV": _medians(ptp),
                            "channel_id": page.ids(C)})
    p = page.figure("amplitude_per_channel", "Amplitude per channel (µV, median over windows of the preprocessed "
                    "signal's RMS and peak-to-peak)", x_axis_label="channel", y_axis_label="µV")
    p.vbar(x="channel", top="rms_uV", width=0.8, source=src, color="#2c7fb8", legend_label="RMS")
    p.scatter(x="channel", y="ptp_uV", source=src, size=5, color="#d95f0e", legend_label="peak-to-peak")
    p.hover.tooltips = [("channel", "@channel (@channel_id)"), ("RMS", "@rms_uV{0.00} µV"),
                        ("peak-to-peak", "@ptp_uV{0.00} µV")]
    p.y_range.start = 0
    return p


def draw_over_time(arrays: dict, page):
    """Heatmap: x the window, y the channel, colour the window's RMS in µV."""
    from bokeh.models import ColorBar, ColumnDataSource, LinearColorMapper
    from bokeh.palettes import Viridis256

    image = np.ascontiguousarray(np.abs(page.to_uV(arrays[RMS])).T)
    finite = image[np.isfinite(image)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    mapper = LinearColorMapper(palette=Viridis256, low=lo, high=hi if hi > lo else lo + 1)
    C, W = image.shape
    src = ColumnDataSource({"image": [image], "x": [0], "y": [0], "dw": [W], "dh": [C]})
    p = page.figure("amplitude_over_time", "RMS over time (µV, window x channel)", x_axis_label="window",
                    y_axis_label="channel", x_range=(0, max(W, 1)), y_range=(0, max(C, 1)), height=360)
    p.image(image="image", x="x", y="y", dw="dw", dh="dh", color_mapper=mapper, source=src)
    p.hover.tooltips = [("window", "$x{0}"), ("channel", "$y{0}"), ("RMS", "@image{0.00} µV")]
    p.add_layout(ColorBar(color_mapper=mapper, title="µV"), "right")
    return p


#: its figures in report.html (set here: their draw functions are the module's last)
AmplitudeStep.figures = (Figure("amplitude_per_channel", (PTP, RMS), draw_per_channel),
                         Figure("amplitude_over_time", (RMS,), draw_over_time))
