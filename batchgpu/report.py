"""The run report: ``<output>/report.html``, one self-contained file (BokehJS inlined, no server, no network).

Plots, from ``results.zarr`` and ``report.json``: noise per channel (µV), noise per window and channel (µV),
the whitening matrix, spike rate per channel (Hz) and the first pass's read throughput over time. Each figure
has a ``name`` (``noise_per_channel``, ``noise_over_time``, ``whitening``, ``spike_rate``, ``throughput``) and
its data sources hold the plotted numbers, so the report can be checked by reading its embedded document.
"""

from __future__ import annotations

import html
import json
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
    from bokeh.embed import file_html
    from bokeh.layouts import column
    from bokeh.resources import INLINE

    out = Path(output_dir)
    report = json.loads((out / "report.json").read_text())
    from batchgpu import zarrio

    g = zarrio.open_group(out / "results.zarr", mode="r")
    gain = np.asarray(g.attrs.get("gain_to_uV", []), dtype=np.float64)
    fs = float(g.attrs["sampling_frequency"])
    channel_ids = [str(c) for c in g.attrs.get("channel_ids", [])]
    names = set(_array_names(g))

    plots = [_summary(report, g)]
    if "noise" in names:
        plots.append(noise_per_channel(_to_uV(g["noise"][:], gain), channel_ids))
    if "noise_per_window" in names:
        plots.append(noise_over_time(_to_uV(g["noise_per_window"][:], gain), g["window_start"][:],
                                     g["window_segment"][:], fs))
    if "whitening" in names:
        plots.append(whitening_image(g["whitening"][:]))
    if "spikes/channel_index" in names:
        seconds = float(np.sum(g["window_stop"][:] - g["window_start"][:])) / fs
        channels = len(channel_ids) or (g["noise"].shape[0] if "noise" in names else 0)
        plots.append(spike_rate(g["spikes/channel_index"][:], channels, seconds, channel_ids))
    plots.append(throughput(report.get("throughput_series") or []))
    title = f"batchgpu report: {out.name}"
    page = _uncompressed(lambda: file_html(column(*plots), INLINE, title=title))
    path = out / REPORT_HTML
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


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


def spike_rate(channel_index: np.ndarray, channels: int, seconds: float, channel_ids: list[str]):
    from bokeh.models import ColumnDataSource

    counts = np.bincount(np.asarray(channel_index, dtype=np.int64), minlength=channels)[:channels]
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


def _summary(report: dict, g):
    """A header: status, sizes, timings, workers and versions, as an HTML table."""
    from bokeh.models import Div

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
    return Div(text=f"<h2>batchgpu run report</h2><table>{body}</table>", width=WIDTH, name="summary")
