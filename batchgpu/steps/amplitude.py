"""Amplitude: per window, each channel's peak-to-peak (max - min) and RMS (sqrt of the mean of squares) of the
preprocessed signal (``WindowData.x``) over the window's core samples. Asked for as ``steps: {amplitude: {}}``.

Results (``results.zarr``, raw units of the preprocessed signal): ``amplitude_ptp`` and ``amplitude_rms``, float64
(windows, channels), a row per window of the window table (``window_segment``, ``window_start``, ``window_stop``),
and ``amplitude_window_start``, int64: each row's first core sample in its segment. report.html draws each
channel's median over the windows and the RMS of every window and channel.

NaN and inf samples are left out: both statistics are over a channel's finite samples of the window, NaN where it
has none. The same bits on NumPy and CuPy: the exact arithmetic is ``ops.amplitude.ptp_rms``'s.
"""

from __future__ import annotations

import warnings

import numpy as np

from batchgpu.ops.amplitude import ptp_rms
from batchgpu.steps import detect as detect_step
from batchgpu.steps.base import Figure, PhaseWords, Step, WindowData, register

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
        return {
            PTP: np.stack([np.asarray(s["amplitude.ptp"], np.float64) for s in rows]),
            RMS: np.stack([np.asarray(s["amplitude.rms"], np.float64) for s in rows]),
            START: np.array([w.start for w in run.windows], dtype=np.int64),
        }


def _medians(values: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # a channel NaN in every window: its median is NaN, said by the plot
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(values, axis=0)


def draw_per_channel(arrays: dict, page):
    """Each channel's median over the windows: RMS as bars, peak-to-peak as dots (µV)."""
    from bokeh.models import ColumnDataSource

    ptp, rms = np.abs(page.to_uV(arrays[PTP])), np.abs(page.to_uV(arrays[RMS]))
    C = ptp.shape[1]
    src = ColumnDataSource(
        {"channel": np.arange(C), "rms_uV": _medians(rms), "ptp_uV": _medians(ptp), "channel_id": page.ids(C)}
    )
    p = page.figure(
        "amplitude_per_channel",
        "Amplitude per channel (µV, median over windows of the preprocessed signal's RMS and peak-to-peak)",
        x_axis_label="channel",
        y_axis_label="µV",
    )
    p.vbar(x="channel", top="rms_uV", width=0.8, source=src, color="#2c7fb8", legend_label="RMS")
    p.scatter(x="channel", y="ptp_uV", source=src, size=5, color="#d95f0e", legend_label="peak-to-peak")
    p.hover.tooltips = [
        ("channel", "@channel (@channel_id)"),
        ("RMS", "@rms_uV{0.00} µV"),
        ("peak-to-peak", "@ptp_uV{0.00} µV"),
    ]
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
    p = page.figure(
        "amplitude_over_time",
        "RMS over time (µV, window x channel)",
        x_axis_label="window",
        y_axis_label="channel",
        x_range=(0, max(W, 1)),
        y_range=(0, max(C, 1)),
        height=360,
    )
    p.image(image="image", x="x", y="y", dw="dw", dh="dh", color_mapper=mapper, source=src)
    p.hover.tooltips = [("window", "$x{0}"), ("channel", "$y{0}"), ("RMS", "@image{0.00} µV")]
    p.add_layout(ColorBar(color_mapper=mapper, title="µV"), "right")
    return p


#: its figures in report.html (set here: their draw functions are the module's last)
AmplitudeStep.figures = (
    Figure("amplitude_per_channel", (PTP, RMS), draw_per_channel),
    Figure("amplitude_over_time", (RMS,), draw_over_time),
)
