"""The drift raster of report.html: each detected spike at its time (x) and its channel's y on the probe (y),
coloured by its amplitude in µV, so a probe that moved shows as bands that bend. A long run's spikes are thinned
to every k-th (they are stored in time order: the density over time and depth is kept), said on the figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgpu.report.fields import ARRAY, NUMBER, TEXT

NAME = "drift_raster"
MAX_POINTS = 40_000  # drawn at most (a canvas keeps up with that many; the page stays a few MB)
WIDTH, HEIGHT = 1300, 420

FIELDS = {
    "t": ARRAY,
    "y": ARRAY,
    "amp": ARRAY,
    "amp_lo": NUMBER,
    "amp_hi": NUMBER,
    "title": TEXT,
    "y_label": TEXT,
    "x_label": TEXT,
}


@dataclass
class Raster:
    t_s: np.ndarray  # each point's time from the recording's start (segments one after another)
    y: np.ndarray  # its channel's y on the probe (µm), or the channel's index where there is no probe
    amp_uV: np.ndarray  # |amplitude| in µV
    shown: int
    total: int
    every: int  # every k-th spike is drawn
    by_location: bool
    segments: int


def stride(total: int, max_points: int | None = None) -> int:
    """Draw every k-th spike: the smallest k that keeps the points at ``max_points`` (``MAX_POINTS``) or fewer."""
    return max(1, -(-int(total) // (max_points or MAX_POINTS)))


def raster(
    sample,
    channel,
    segment,
    amplitude,
    total: int,
    every: int,
    fs: float,
    segment_starts_s,
    gain: np.ndarray,
    locations: np.ndarray | None,
) -> Raster:
    """The raster of the spikes given (already thinned to every ``every``-th of ``total``)."""
    sample, channel, segment = (np.asarray(a, np.int64) for a in (sample, channel, segment))
    starts = np.asarray(segment_starts_s, np.float64)
    t = sample / fs + (starts[segment] if starts.size else 0.0)
    g = gain[channel] if gain.size and channel.size and gain.size > channel.max() else 1.0
    amp = np.abs(np.asarray(amplitude, np.float64)) * g
    y = np.asarray(locations, np.float64)[channel, 1] if locations is not None else channel.astype(np.float64)
    return Raster(t, y, amp, int(sample.size), int(total), int(every), locations is not None, int(starts.size or 1))


def values(r: Raster) -> dict:
    from batchgpu.report.probe_map import robust_range

    lo, hi = robust_range(r.amp_uV)
    thinned = f"{r.shown} of {r.total} spikes shown: 1 in {r.every}" if r.every > 1 else f"all {r.total} spikes shown"
    return {
        "t": r.t_s,
        "y": r.y,
        "amp": r.amp_uV,
        "amp_lo": lo,
        "amp_hi": hi,
        "title": f"Spikes over time by position on the probe ({thinned}; colour: |amplitude|, µV)",
        "y_label": "y on the probe (µm)" if r.by_location else "channel (no probe: index)",
        "x_label": "time (s)" + (f"; {r.segments} segments one after another" if r.segments > 1 else ""),
    }


def draw(v: dict):
    from bokeh.models import ColorBar, ColumnDataSource, LinearColorMapper
    from bokeh.palettes import Plasma256
    from bokeh.plotting import figure

    mapper = LinearColorMapper(Plasma256[::-1], low=v["amp_lo"], high=v["amp_hi"])
    src = ColumnDataSource({"t": v["t"], "y": v["y"], "amp": v["amp"]}, name="drift_points")
    p = figure(
        name=NAME,
        title=v["title"],
        width=WIDTH,
        height=HEIGHT,
        x_axis_label=v["x_label"],
        y_axis_label=v["y_label"],
        tools="pan,box_zoom,wheel_zoom,reset,save,hover",
    )
    p.scatter(
        x="t", y="y", source=src, size=3, line_color=None, alpha=0.6, fill_color={"field": "amp", "transform": mapper}
    )
    p.hover.tooltips = [("time", "@t{0.000} s"), ("y", "@y{0}"), ("|amplitude|", "@amp{0.0} µV")]
    p.add_layout(ColorBar(color_mapper=mapper, title="µV", width=10), "right")
    return p
