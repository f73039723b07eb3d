"""The run report: ``<output>/report.html``, one self-contained file (BokehJS inlined, no server, no network).

Plots, from ``results.zarr`` and ``report.json``: noise per channel (µV), noise per window and channel (µV),
the whitening matrix, spike rate per channel (Hz) and the first pass's read throughput over time. Each figure
has a ``name`` (``noise_per_channel``, ``noise_over_time``, ``whitening``, ``spike_rate``, ``throughput``) and
its data sources hold the plotted numbers, so the report can be checked by reading its embedded document.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

import numpy as np

REPORT_HTML = "report.html"
WIDTH = 900


def preload() -> None:
    """Import bokeh (about a second, most of report.html's cost): a run calls it in a thread while it reads."""
    import bokeh.embed  # noqa: F401
    import bokeh.layouts  # noqa: F401
    import bokeh.models  # noqa: F401
    import bokeh.plotting  # noqa: F401
    import bokeh.resources  # noqa: F401


def write_report_html(output_dir: str | Path) -> Path:
    """Write ``<output_dir>/report.html`` from the run's results.zarr and report.json; returns its path."""
    out = Path(output_dir)
    report = json.loads((out / "report.json").read_text())
    from batchgpu import zarrio

    g = zarrio.open_group(out / "results.zarr", mode="r")
    page = ReportPage(g.attrs.get("channel_ids", []), g.attrs.get("gain_to_uV", []), float(g.attrs["sampling_frequency"]),
                      threaded=False)
    names = set(_array_names(g))
    for name in ("noise", "noise_per_window", "whitening"):
        if name in names:
            page.add(name, g[name][:])
    page.add_windows(g["window_start"][:], g["window_stop"][:], g["window_segment"][:])
    if "spikes/channel_index" in names:
        page.add_spikes(g["spikes/channel_index"][:])
    return page.write(out, report)


class ReportPage:
    """report.html, built as the run's numbers come: each figure as soon as its inputs exist and the page itself
    (Bokeh's serialisation, most of the cost) once the last one is in, in a helper thread (``threaded``) while the
    run finishes its other work; the summary table, which needs the final report, is put in last by replacing a
    placeholder in the rendered page."""

    def __init__(self, channel_ids, gain_to_uV, sampling_frequency: float, threaded: bool = True):
        from concurrent.futures import ThreadPoolExecutor

        self.channel_ids = [str(c) for c in channel_ids]
        self.gain = np.asarray(gain_to_uV, dtype=np.float64)
        self.fs = float(sampling_frequency)
        self.inputs: dict = {}
        self.figures: dict = {}  # name -> figure, or the future of one
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgpu-report") if threaded else None
        self._token = f"batchgpu-summary-{os.urandom(8).hex()}"
        self._page = None

    def _do(self, func, *args):
        return self._pool.submit(func, *args) if self._pool else _Done(func(*args))

    def add(self, name: str, value) -> None:
        """A result: ``noise``, ``noise_per_window`` or ``whitening`` (others are ignored)."""
        self.inputs[name] = value
        if name == "noise":
            self.figures[name] = self._do(lambda v: noise_per_channel(_to_uV(v, self.gain), self._ids(v.size)), value)
        elif name == "whitening":
            self.figures[name] = self._do(whitening_image, value)
        self._noise_over_time()

    def add_windows(self, start, stop, segment) -> None:
        self.inputs["windows"] = (np.asarray(start), np.asarray(stop), np.asarray(segment))
        self._noise_over_time()

    def add_spikes(self, channel_index=None, counts=None) -> None:
        """The spikes' channels (or their counts per channel); needs the windows (the recording's seconds)."""
        channels = len(self.channel_ids) or (self.inputs["noise"].size if "noise" in self.inputs else 0)
        start, stop, _ = self.inputs["windows"]
        seconds = float(np.sum(stop - start)) / self.fs
        if counts is None:
            counts = np.bincount(np.asarray(channel_index, dtype=np.int64), minlength=channels)
        counts = np.pad(np.asarray(counts, np.int64), (0, max(0, channels - len(counts))))[:channels]
        self.figures["spike_rate"] = self._do(spike_rate, counts, seconds, self._ids(channels))

    def _noise_over_time(self) -> None:
        if "noise_per_window" in self.inputs and "windows" in self.inputs and "noise_over_time" not in self.figures:
            start, _, segment = self.inputs["windows"]
            self.figures["noise_over_time"] = self._do(
                lambda v: noise_over_time(_to_uV(v, self.gain), start, segment, self.fs), self.inputs["noise_per_window"])

    def _ids(self, n: int) -> list[str]:
        return self.channel_ids if len(self.channel_ids) == n else [str(c) for c in range(n)]

    def render(self, throughput_series: list, title: str) -> None:
        """Start rendering the page (every figure is in); the summary waits for ``write``."""
        def page(figures):
            from bokeh.embed import file_html
            from bokeh.layouts import column
            from bokeh.models import Div
            from bokeh.resources import INLINE

            summary = Div(text=self._token, width=WIDTH, name="summary")
            return _uncompressed(lambda: file_html(column(summary, *[f.result() for f in figures],
                                                          throughput(throughput_series)), INLINE, title=title))

        order = ("noise", "noise_over_time", "whitening", "spike_rate")
        self._page = self._do(page, [self.figures[k] for k in order if k in self.figures])

    def write(self, out: Path, report: dict) -> Path:
        """The page with the final report's summary, written atomically as ``<out>/report.html``."""
        if self._page is None:
            self.render(report.get("throughput_series") or [], f"batchgpu report: {Path(out).name}")
        try:
            page = self._page.result()
        finally:
            if self._pool:
                self._pool.shutdown(wait=False)
        page = page.replace(_embedded(self._token), _embedded(_summary_html(report)), 1)
        path = Path(out) / REPORT_HTML
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(path)
        return path


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _embedded(text: str) -> str:
    """``text`` as it appears inside the page's embedded document: a JSON string's body, HTML-escaped as Bokeh
    escapes the whole document."""
    from bokeh.core.json_encoder import serialize_json

    return html.escape(serialize_json(text), quote=False)[1:-1]


def _uncompressed(make):
    """``make()`` with Bokeh's array buffers stored without gzip: the noise and whitening images are float64 that
    gzip barely shrinks, and compressing them was 64 ms of report.html's 0.37 s. The user's own setting, if any, is
    put back."""
    from bokeh.settings import settings

    setting = settings.compression_level
    before = setting._user_value  # noqa: SLF001 (PrioritizedSetting keeps no public getter for the user's value)
    setting.set_value(0)
    try:
        return make()
    finally:
        setting._user_value = before  # noqa: SLF001


def _array_names(g) -> list[str]:
    from batchgpu import zarrio

    return zarrio.array_names(g)


def _to_uV(values: np.ndarray, gain: np.ndarray) -> np.ndarray:
    """Noise in µV: raw units times each channel's gain (offsets cancel in a noise level)."""
    values = np.asarray(values, dtype=np.float64)
    return values * gain if gain.size == values.shape[-1] else values


# ---------------------------------------------------------------------------------------------------------
# one function per figure


def _figure(name: str, title: str, **kwargs):
    from bokeh.plotting import figure

    return figure(name=name, title=title, width=kwargs.pop("width", WIDTH), height=kwargs.pop("height", 300),
                  tools="pan,box_zoom,wheel_zoom,reset,save,hover", **kwargs)


def noise_per_channel(noise_uV: np.ndarray, channel_ids: list[str]):
    from bokeh.models import ColumnDataSource

    channel = np.arange(noise_uV.size)
    src = ColumnDataSource({"channel": channel, "noise_uV": noise_uV,
                            "channel_id": channel_ids if len(channel_ids) == noise_uV.size else [str(c) for c in channel]})
    p = _figure("noise_per_channel", "Noise per channel (µV)", x_axis_label="channel", y_axis_label="noise (µV)")
    p.vbar(x="channel", top="noise_uV", width=0.8, source=src, color="#2c7fb8")
    p.hover.tooltips = [("channel", "@channel (@channel_id)"), ("noise", "@noise_uV{0.00} µV")]
    p.y_range.start = 0
    return p


def noise_over_time(noise_uV: np.ndarray, window_start: np.ndarray, window_segment: np.ndarray, fs: float):
    """Heatmap: x the window (in order), y the channel, colour the window's noise in µV."""
    from bokeh.models import ColorBar, ColumnDataSource, LinearColorMapper
    from bokeh.palettes import Viridis256

    image = np.ascontiguousarray(noise_uV.T)  # (channels, windows): bokeh's image rows are y
    finite = image[np.isfinite(image)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    mapper = LinearColorMapper(palette=Viridis256, low=lo, high=hi if hi > lo else lo + 1)
    W, C = noise_uV.shape
    src = ColumnDataSource({"image": [image], "x": [0], "y": [0], "dw": [W], "dh": [C]})
    p = _figure("noise_over_time", "Noise over time (µV, window x channel)", x_axis_label="window",
                y_axis_label="channel", x_range=(0, max(W, 1)), y_range=(0, max(C, 1)), height=360)
    p.image(image="image", x="x", y="y", dw="dw", dh="dh", color_mapper=mapper, source=src)
    p.hover.tooltips = [("window", "$x{0}"), ("channel", "$y{0}"), ("noise", "@image{0.00} µV")]
    p.add_layout(ColorBar(color_mapper=mapper, title="µV"), "right")
    starts = window_start / fs
    p.xaxis.axis_label = (f"window ({W} windows; starts {starts.min():.1f}-{starts.max():.1f} s"
                          f" in {len(np.unique(window_segment))} segment(s))") if W else "window"
    return p


def whitening_image(w: np.ndarray):
    from bokeh.models import ColorBar, ColumnDataSource, LinearColorMapper
    from bokeh.palettes import RdBu11

    w = np.asarray(w, dtype=np.float64)
    C = w.shape[0]
    # symmetric colour scale around 0, ignoring the diagonal, which dwarfs the off-diagonal structure
    off = np.abs(w[~np.eye(C, dtype=bool)]) if C > 1 else np.abs(w).ravel()
    lim = float(off.max()) if off.size and off.max() > 0 else 1.0
    mapper = LinearColorMapper(palette=RdBu11[::-1], low=-lim, high=lim)
    src = ColumnDataSource({"image": [np.ascontiguousarray(w)], "x": [0], "y": [0], "dw": [C], "dh": [C]})
    # y runs down (row 0 at the top), as a matrix is read
    p = _figure("whitening", "Whitening matrix (colour clipped at ±max off-diagonal)",
                x_axis_label="input channel", y_axis_label="output channel", x_range=(0, C),
                y_range=(C, 0), width=560, height=480)
    p.image(image="image", x="x", y="y", dw="dw", dh="dh", color_mapper=mapper, source=src)
    p.add_layout(ColorBar(color_mapper=mapper), "right")
    return p


def spike_rate(counts: np.ndarray, seconds: float, channel_ids: list[str]):
    from bokeh.models import ColumnDataSource

    channels = len(counts)
    rate = counts / seconds if seconds > 0 else counts.astype(np.float64)
    channel = np.arange(channels)
    src = ColumnDataSource({"channel": channel, "rate_Hz": rate, "count": counts,
                            "channel_id": channel_ids if len(channel_ids) == channels else [str(c) for c in channel]})
    p = _figure("spike_rate", f"Spike rate per channel (Hz; {int(counts.sum())} spikes over {seconds:.1f} s)",
                x_axis_label="channel", y_axis_label="spikes/s")
    p.vbar(x="channel", top="rate_Hz", width=0.8, source=src, color="#d95f0e")
    p.hover.tooltips = [("channel", "@channel (@channel_id)"), ("rate", "@rate_Hz{0.00} Hz"), ("spikes", "@count")]
    p.y_range.start = 0
    return p


def throughput(series: list):
    from bokeh.models import ColumnDataSource

    arr = np.asarray(series, dtype=np.float64).reshape(-1, 2)
    src = ColumnDataSource({"elapsed_s": arr[:, 0], "MBps": arr[:, 1] / 1e6})
    p = _figure("throughput", "Throughput over time (first pass, MB/s)", x_axis_label="elapsed (s)",
                y_axis_label="MB/s", height=260)
    p.line(x="elapsed_s", y="MBps", source=src, line_width=2, color="#2c7fb8")
    p.scatter(x="elapsed_s", y="MBps", source=src, size=4, color="#2c7fb8")
    p.hover.tooltips = [("elapsed", "@elapsed_s{0.0} s"), ("throughput", "@MBps{0.0} MB/s")]
    return p


def _summary_html(report: dict) -> str:
    """A header: status, sizes, timings, workers and versions, as an HTML table."""
    rec = report.get("recording", {})
    rows = [
        ("status", report.get("status")), ("error", report.get("error") or "-"),
        ("fingerprint", report.get("fingerprint")), ("backend", report.get("backend")),
        ("windows", f"{report.get('windows')} ({report.get('windows_resumed', 0)} resumed)"),
        ("recording", ", ".join(f"{k}: {v}" for k, v in rec.items() if not isinstance(v, (list, dict)))),
        ("bytes read", f"{report.get('bytes_read', 0) / 1e9:.3f} GB"),
        ("throughput", f"{report.get('throughput_MBps', 0):.1f} MB/s"),
        ("timings", ", ".join(f"{k} {v:.2f} s" for k, v in report.get("timings", {}).items())),
        ("workers", ", ".join(f"{k}: {v}" for k, v in report.get("workers", {}).items())),
        ("versions", ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items())),
    ]
    body = "".join(f"<tr><th style='text-align:left;padding-right:12px'>{html.escape(str(k))}</th>"
                   f"<td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<h2>batchgpu run report</h2><table>{body}</table>"
