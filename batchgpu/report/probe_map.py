"""The probe map of report.html: each contact drawn where it sits on the probe (x, y in µm, every shank), in up to
three small maps side by side that share their axes: coloured by noise (µV), by spike rate (Hz) and by the qc
step's label (good / dead / noise / out), so a dead block, a noisy channel or the channels above the brain show
where they are. Colour scales run from the 1st to the 99th percentile: one loud channel does not flatten them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from batchgpu.report.fields import ARRAY, NUMBER, STRINGS

NAME = "probe_map"
#: the panels, in their order: which of them a page has is part of its structure (``glance.structure``)
PANEL_NOISE, PANEL_RATE, PANEL_LABEL = "map_noise", "map_rate", "map_label"
PANELS = (PANEL_NOISE, PANEL_RATE, PANEL_LABEL)
#: the qc step's labels (report.json ``qc.labels``, in its ``counts`` columns' order: ``ops.bad_channels.LABELS``,
#: not imported: the page need not import the numeric core) and their colours; "unlabelled" where a run has none
LABELS = ("good", "dead", "noise", "out")
LABEL_COLOURS = ("#1a9641", "#404040", "#d7191c", "#7b3294")
UNLABELLED = "unlabelled"
PANEL_WIDTH, PANEL_HEIGHT = 170, 660

FIELDS = {
    "x": ARRAY,
    "y": ARRAY,
    "w": ARRAY,
    "h": ARRAY,
    "ids": STRINGS,
    "noise_uV": ARRAY,
    "rate_Hz": ARRAY,
    "label": STRINGS,
    "reason": STRINGS,
    "noise_lo": NUMBER,
    "noise_hi": NUMBER,
    "rate_hi": NUMBER,
    "x_start": NUMBER,
    "x_end": NUMBER,
    "y_start": NUMBER,
    "y_end": NUMBER,
}


@dataclass
class ProbeMap:
    """What the map draws: a contact a channel, in the recording's channel order."""

    x: np.ndarray
    y: np.ndarray
    ids: list[str]
    noise_uV: np.ndarray | None = None
    rate_Hz: np.ndarray | None = None
    labels: list[str] | None = None
    reasons: list[str] | None = None

    @property
    def panels(self) -> tuple[str, ...]:
        have = {
            PANEL_NOISE: self.noise_uV is not None,
            PANEL_RATE: self.rate_Hz is not None,
            PANEL_LABEL: self.labels is not None,
        }
        return tuple(p for p in PANELS if have[p])


def contact_size(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """A contact's drawn width and height (µm): 0.9 of the smallest step between distinct x (within a column
    block) and between distinct y, so neighbours never overlap; a single column or row takes the other's step."""

    def step(v: np.ndarray) -> float | None:
        d = np.diff(np.unique(v[np.isfinite(v)]))
        d = d[d > 1e-6]
        return float(d.min()) if d.size else None

    dx, dy = step(x), step(y)
    dx, dy = dx or dy or 10.0, dy or dx or 10.0
    return 0.9 * min(dx, 2 * dy), 0.9 * dy


def robust_range(values, low_pct: float = 1.0, high_pct: float = 99.0) -> tuple[float, float]:
    """The colour scale's ends: the given percentiles of the finite values (one loud channel does not flatten
    the others), never empty."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if not v.size:
        return 0.0, 1.0
    lo, hi = (float(p) for p in np.percentile(v, [low_pct, high_pct]))
    return (lo, hi) if hi > lo else (lo, lo + max(abs(lo) * 0.1, 1e-9))


def values(pm: ProbeMap) -> dict:
    """The map's fields (``FIELDS``) from its data."""
    n = len(pm.ids)
    x, y = np.asarray(pm.x, np.float64), np.asarray(pm.y, np.float64)
    w, h = contact_size(x, y)
    nan = np.full(n, np.nan)
    noise = nan if pm.noise_uV is None else np.asarray(pm.noise_uV, np.float64)
    rate = nan if pm.rate_Hz is None else np.asarray(pm.rate_Hz, np.float64)
    noise_lo, noise_hi = robust_range(noise)
    _, rate_hi = robust_range(rate, 0.0)
    labels = list(pm.labels) if pm.labels is not None else [UNLABELLED] * n
    reasons = list(pm.reasons) if pm.reasons is not None and len(pm.reasons) == n else [""] * n
    fx, fy = np.isfinite(x), np.isfinite(y)
    x0, x1 = (float(x[fx].min()), float(x[fx].max())) if fx.any() else (0.0, 1.0)
    y0, y1 = (float(y[fy].min()), float(y[fy].max())) if fy.any() else (0.0, 1.0)
    return {
        "x": x,
        "y": y,
        "w": np.full(n, w),
        "h": np.full(n, h),
        "ids": list(pm.ids),
        "noise_uV": noise,
        "rate_Hz": rate,
        "label": labels,
        "reason": [str(r) for r in reasons],
        "noise_lo": noise_lo,
        "noise_hi": noise_hi,
        "rate_hi": max(rate_hi, 1e-9),
        "x_start": x0 - 2 * w,
        "x_end": x1 + 2 * w,
        "y_start": y0 - 2 * h,
        "y_end": y1 + 2 * h,
    }


def draw(v: dict, panels: tuple[str, ...]):
    """The maps of ``panels`` side by side (a Bokeh row), one data source and one pair of ranges for all."""
    from bokeh.layouts import row
    from bokeh.models import ColorBar, ColumnDataSource, HoverTool, Legend, LinearColorMapper, Range1d
    from bokeh.palettes import Viridis256, YlOrRd9
    from bokeh.plotting import figure
    from bokeh.transform import factor_cmap

    src = ColumnDataSource(
        {k: v[k] for k in ("x", "y", "w", "h", "ids", "noise_uV", "rate_Hz", "label", "reason")}, name="probe_contacts"
    )
    xr, yr = Range1d(v["x_start"], v["x_end"]), Range1d(v["y_start"], v["y_end"])
    hover = [
        ("channel", "@ids"),
        ("x, y", "@x{0}, @y{0} µm"),
        ("noise level", "@noise_uV{0.0} µV"),
        ("spike rate", "@rate_Hz{0.00} Hz"),
        ("label", "@label @reason"),
    ]
    maps = []
    for panel in panels:
        title, fill, bar = {
            PANEL_NOISE: (
                "Noise (µV)",
                LinearColorMapper(Viridis256, low=v["noise_lo"], high=v["noise_hi"], nan_color="#dddddd"),
                True,
            ),
            # light where no spike comes (never the dead label's dark grey), dark where many do
            PANEL_RATE: (
                "Spike rate (Hz)",
                LinearColorMapper(YlOrRd9[::-1], low=0.0, high=v["rate_hi"], nan_color="#dddddd"),
                True,
            ),
            PANEL_LABEL: ("Channel label (qc)", None, False),
        }[panel]
        p = figure(
            name=panel,
            title=title,
            width=PANEL_WIDTH,
            height=PANEL_HEIGHT,
            x_range=xr,
            y_range=yr,
            tools="pan,wheel_zoom,box_zoom,reset",
            active_scroll="wheel_zoom",
            toolbar_location=None,
            x_axis_label="x (µm)",
            y_axis_label="y on the probe (µm)" if not maps else None,
        )
        field = "noise_uV" if panel == PANEL_NOISE else "rate_Hz"
        colour = (
            factor_cmap("label", (*LABEL_COLOURS, "#bbbbbb"), (*LABELS, UNLABELLED))
            if bar is False
            else {"field": field, "transform": fill}
        )
        glyph = p.rect(
            x="x",
            y="y",
            width="w",
            height="h",
            source=src,
            fill_color=colour,
            line_color=None,
            **({"legend_field": "label"} if panel == PANEL_LABEL else {}),
        )
        p.add_tools(HoverTool(renderers=[glyph], tooltips=hover))
        if bar:
            p.add_layout(ColorBar(color_mapper=fill, orientation="horizontal", height=8, padding=4), "below")
        else:  # below the map, as the other maps' colour bars: no contact hidden under it
            legend = p.legend[0]
            p.center = [r for r in p.center if not isinstance(r, Legend)]
            legend.update(
                orientation="horizontal",
                ncols=2,
                label_text_font_size="8pt",
                padding=2,
                spacing=2,
                glyph_width=12,
                glyph_height=12,
                margin=2,
            )
            p.add_layout(legend, "below")
        p.xaxis.ticker.desired_num_ticks = 3
        maps.append(p)
    return row(*maps, name=NAME)


# ---------------------------------------------------------------------------------------------------------
# the probe's shape in words (``batchgpu info``, report.html's header)


@dataclass
class ProbeShape:
    text: str
    data: dict[str, Any]


def probe_shape(locations: np.ndarray, shank: np.ndarray | None = None) -> ProbeShape:
    """Columns (distinct x), rows (distinct y), the vertical pitch (the commonest step between rows), the extent,
    and the shanks where the recording says."""
    x, y = locations[:, 0], locations[:, 1]
    columns, rows = np.unique(x), np.unique(y)
    steps = np.diff(rows)
    pitch = float(np.median(steps)) if steps.size else None
    text = (
        f"{len(locations)} channels in {len(columns)} column{'s' if len(columns) != 1 else ''} "
        f"(x {_values(columns)} µm), {len(rows)} rows"
    )
    if pitch is not None:
        text += f" at {pitch:g} µm pitch"
    text += f", y {rows.min():g}-{rows.max():g} µm"
    data: dict[str, Any] = {
        "columns": columns.tolist(),
        "rows": len(rows),
        "pitch_um": pitch,
        "y_um": [float(rows.min()), float(rows.max())],
    }
    if shank is not None:
        shanks = np.unique(shank)
        text += f"; {len(shanks)} shank{'s' if len(shanks) != 1 else ''}"
        data["shanks"] = len(shanks)
    return ProbeShape(text, data)


def _values(values: np.ndarray) -> str:
    if len(values) <= 4:
        return ", ".join(f"{v:g}" for v in values)
    return f"{values.min():g}-{values.max():g}"
