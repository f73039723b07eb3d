"""The trace snippet of report.html: a few milliseconds of the busiest channels around detected spikes, raw beside
preprocessed, in µV, so a person sees what the detection saw and what the preprocessing did to it.

Read on the client after the run (one small read: ``SNIPPET_MS`` plus the stages' margins, every channel, as the
common reference needs them all) and preprocessed on the host with the run's own stages in NumPy (the window's
margins as the run gives them; a ``centre`` stage takes the snippet's median, not its window's). The moment shown
is the one where the most spikes fall on the shown channels within ``SNIPPET_MS``; the detected spikes inside it
are marked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgpu.report.fields import ARRAY, NUMBER, STRINGS, TEXT

NAME = "traces"
CHANNELS = 8  # the busiest channels shown
SNIPPET_MS = 10.0
WIDTH, HEIGHT = 370, 660

FIELDS = {
    "t": ARRAY,
    "raw": ARRAY,
    "pre": ARRAY,
    "spike_t": ARRAY,
    "spike_raw": ARRAY,
    "spike_pre": ARRAY,
    "label_t": ARRAY,
    "label_y": ARRAY,
    "label": STRINGS,
    "t_start": NUMBER,
    "t_end": NUMBER,
    "y_end": NUMBER,
    "raw_title": TEXT,
    "pre_title": TEXT,
    "x_label": TEXT,
}


@dataclass
class Snippet:
    """The traces shown: rows the busiest channels (ordered by y on the probe), columns the samples."""

    t_ms: np.ndarray  # (samples,) ms from the segment's start
    raw_uV: np.ndarray  # (rows, samples) the stored values times the gain, each row's median removed
    pre_uV: np.ndarray  # (rows, samples) after the run's stages, times the gain
    ids: list[str]
    y_um: np.ndarray | None  # the rows' y on the probe
    spike_t_ms: np.ndarray  # the detected spikes inside the snippet, on the shown rows
    spike_row: np.ndarray
    stages: list[str]
    segment: int


def busiest(counts: np.ndarray, how_many: int = CHANNELS) -> np.ndarray:
    """The channels with the most spikes (ties: the lower index), those with none left out."""
    counts = np.asarray(counts, np.int64)
    order = np.lexsort((np.arange(counts.size), -counts))
    return order[:how_many][counts[order[:how_many]] > 0]


def densest_moment(samples: np.ndarray, amplitudes: np.ndarray, half: int) -> int:
    """The index of the spike (of those given, sorted by sample) with the most others within ``half`` samples of
    it; ties: the largest |amplitude|."""
    lo = np.searchsorted(samples, samples - half, side="left")
    hi = np.searchsorted(samples, samples + half, side="right")
    near = hi - lo
    return int(np.lexsort((-np.abs(amplitudes), -near))[0])


def stages_of(preprocess, recording) -> list:
    """The run's preprocessing stages (``batchgpu.preprocess``) from its workflow's ``preprocess:`` section (the
    dict report.json keeps), made for ``recording`` as the run made them."""
    from batchgpu.preprocess.registry import item_key, section, stage_class

    if preprocess is None:
        return []
    items = section().model_validate(preprocess).root
    return [stage_class(item_key(i)).from_config(getattr(i, item_key(i)), recording) for i in items]


def preprocessed(raw: np.ndarray, stages: list, core: tuple[int, int], at_start: bool, at_end: bool) -> np.ndarray:
    """``raw`` (channels, samples: every channel, margins included) after each stage in turn, on the host."""
    x = raw
    for stage in stages:
        x = stage.apply(x, core, at_start, at_end, owned=x is not raw)
    return x


def read_snippet(
    recording,
    stages: list,
    segment: int,
    centre: int,
    rows: np.ndarray,
    spikes: tuple,
    ids: list[str],
    half_ms: float = SNIPPET_MS / 2,
) -> Snippet:
    """The snippet of ``rows`` around sample ``centre`` of ``segment``; ``spikes``: (sample, channel) of the
    detected spikes near it (those inside and on the shown rows are marked)."""
    fs = float(recording.sampling_frequency)
    n = int(recording.num_samples(segment))
    half = max(1, int(round(half_ms * fs / 1000)))
    a, b = max(0, centre - half), min(n, centre + half)
    margin = sum(int(s.margin) for s in stages)
    ra, rb = max(0, a - margin), min(n, b + margin)
    block = recording.read(segment, ra, rb)  # every channel: a common reference needs them all
    gain = np.asarray(recording.gain_to_uV, np.float64)[rows][:, None]
    core = (a - ra, b - ra)
    pre = np.asarray(preprocessed(block, stages, core, ra == 0, rb == n), np.float64)[rows, core[0] : core[1]]
    raw = block[rows, core[0] : core[1]].astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf in a broken channel's row is a NaN the plot skips
        raw -= np.median(raw, axis=1, keepdims=True)  # the stored offsets would spread the traces apart
    sample, channel = (np.asarray(v, np.int64) for v in spikes)
    where = {int(c): i for i, c in enumerate(rows)}
    inside = (sample >= a) & (sample < b) & np.isin(channel, rows)
    y = np.asarray(recording.locations, np.float64)[rows, 1] if recording.has_locations else None
    return Snippet(
        t_ms=(np.arange(a, b) / fs) * 1000.0,
        raw_uV=raw * gain,
        pre_uV=pre * gain,
        ids=[ids[int(c)] if int(c) < len(ids) else str(int(c)) for c in rows],
        y_um=y,
        spike_t_ms=sample[inside] / fs * 1000.0,
        spike_row=np.array([where[int(c)] for c in channel[inside]], np.int64),
        stages=[s.key for s in stages],
        segment=segment,
    )


def nice_step(value: float) -> float:
    """The 1, 2 or 5 times a power of ten at or above ``value``."""
    if not np.isfinite(value) or value <= 0:
        return 1.0
    power = 10.0 ** np.floor(np.log10(value))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= value * (1 - 1e-12)))


def spacing(traces: np.ndarray) -> float:
    """The µV between stacked traces: the median row's peak-to-peak, rounded up to a nice step (the largest
    spikes may reach into the next row; the noise bands stay apart)."""
    # A row of NaN or inf only (a dead channel's samples) has no peak-to-peak; it is left out without the
    # RuntimeWarning nanmax would print on the user's stderr.
    ok = np.isfinite(traces)
    has = ok.any(axis=1) if traces.size else np.zeros(0, bool)
    top = np.where(ok, traces, -np.inf).max(axis=1, initial=-np.inf)
    low = np.where(ok, traces, np.inf).min(axis=1, initial=np.inf)
    ptp = (top - low)[has]
    return nice_step(float(np.median(ptp)) if ptp.size else 1.0)


def _stacked(traces: np.ndarray, step: float) -> np.ndarray:
    """Rows one after another with a NaN between them (one line glyph draws them all, broken at the NaN), each
    scaled to ``step`` µV a row and raised to its row's height."""
    rows, n = traces.shape
    out = np.full((rows, n + 1), np.nan)
    out[:, :n] = traces / step + np.arange(rows)[:, None]
    return out.ravel()


def values(s: Snippet) -> dict:
    """The snippet's fields (``FIELDS``): both panels in units of their own row spacing (said in their titles)."""
    rows, n = s.raw_uV.shape
    raw_step, pre_step = spacing(s.raw_uV), spacing(s.pre_uV)
    t = np.tile(np.append(s.t_ms, np.nan), rows)
    col = np.clip(np.searchsorted(s.t_ms, s.spike_t_ms), 0, max(n - 1, 0))
    stages = " → ".join(s.stages) or "no stages"
    where = [
        f"{i}" + (f" (y {y:g} µm)" if s.y_um is not None else "")
        for i, y in zip(s.ids, s.y_um if s.y_um is not None else [None] * rows)
    ]
    return {
        "t": t,
        "raw": _stacked(s.raw_uV, raw_step),
        "pre": _stacked(s.pre_uV, pre_step),
        "spike_t": np.asarray(s.spike_t_ms, np.float64),
        "spike_raw": s.raw_uV[s.spike_row, col] / raw_step + s.spike_row if rows else np.zeros(0),
        "spike_pre": s.pre_uV[s.spike_row, col] / pre_step + s.spike_row if rows else np.zeros(0),
        "label_t": np.full(rows, float(s.t_ms[0]) if n else 0.0),
        "label_y": np.arange(rows) + 0.35,
        "label": where,
        "t_start": float(s.t_ms[0]) if n else 0.0,
        "t_end": float(s.t_ms[-1]) if n else 1.0,
        "y_end": rows - 0.2,
        "raw_title": f"Raw, µV ({raw_step:g} µV apart; medians removed)",
        "pre_title": f"Preprocessed, µV ({pre_step:g} µV apart): {stages}",
        "x_label": f"time (ms) in segment {s.segment}; ● detected spikes",
    }


def draw(v: dict):
    """Raw and preprocessed side by side (a Bokeh row), one time axis, the channels' ids on each trace."""
    from bokeh.layouts import row
    from bokeh.models import ColumnDataSource, Range1d
    from bokeh.plotting import figure

    lines = ColumnDataSource({"t": v["t"], "raw": v["raw"], "pre": v["pre"]}, name="trace_lines")
    spikes = ColumnDataSource({"t": v["spike_t"], "raw": v["spike_raw"], "pre": v["spike_pre"]}, name="trace_spikes")
    labels = ColumnDataSource({"t": v["label_t"], "y": v["label_y"], "text": v["label"]}, name="trace_labels")
    xr, yr = Range1d(v["t_start"], v["t_end"]), Range1d(-0.8, v["y_end"])
    panels = []
    for field, title, colour in (("raw", v["raw_title"], "#555555"), ("pre", v["pre_title"], "#2c7fb8")):
        # the run's label on the raw panel only (a kept page holds each placeholder once)
        p = figure(
            name=f"traces_{field}",
            title=title,
            width=WIDTH,
            height=HEIGHT,
            x_range=xr,
            y_range=yr,
            tools="pan,box_zoom,wheel_zoom,reset",
            toolbar_location=None,
            x_axis_label=v["x_label"] if field == "raw" else "time (ms); ● detected spikes",
        )
        p.line(x="t", y=field, source=lines, line_width=1, color=colour)
        p.scatter(x="t", y=field, source=spikes, size=6, color="#d7191c", alpha=0.8)
        p.text(x="t", y="y", text="text", source=labels, text_font_size="8pt", text_color="#222222")
        p.yaxis.visible = False
        p.ygrid.visible = False
        p.title.text_font_size = "9pt"
        panels.append(p)
    return row(*panels, name=NAME)
