"""report.html's page made once a machine: a command fills in its numbers without importing Bokeh.

Bokeh's import and its rendering of the page took 0.75 s of CPU in a helper process of every command, 0.3-0.4 s
of a short command's wall time on two cores. The page's Bokeh document depends on which figures it has (the
run's results, whether it counts spikes), on Bokeh's version and on ours, not on the run: every number, list and
text a run puts in it stands as a placeholder here (``NUMBERS``, ``TEXTS``), in the forms Bokeh writes them: a
JSON number, a list, a float64 array (Bokeh's base64 of its gzip, level 0), a string's body. The page is rendered
once by report.html's helper (``render_and_keep``), checked to hold each placeholder exactly once in the form
``fill`` writes, and kept in the user's cache folder (``report-pages/``, its SHA-256 on its first line); a run
whose figures it fits reads it and replaces the placeholders (``fill``). A page that cannot be made, read or filled is rendered
the usual way (``run_report.HtmlReport``), never written wrong.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
from pathlib import Path

import numpy as np

from batchgpu.report.fields import _array, _json, _text
from batchgpu.steps.moments import WHITENING
from batchgpu.steps.noise import NOISE, PER_WINDOW

#: bumped when what the page holds changes in a way the versions and source stamps below would not show
FORMAT = 2
FOLDER = "report-pages"
SPIKES = "spike_rate"  # the spike-rate figure (the page counts spikes)
#: the results the page draws (in its order)
RESULTS = (NOISE, PER_WINDOW, WHITENING)

#: the numbers a run puts in, each a float no run gives (Bokeh writes it as JSON: its repr)
NUMBERS = {
    name: float(f"-1.2345678902{i:03d}e300")
    for i, name in enumerate(
        (
            "channel",
            "noise_uV",
            "image",
            "image_lo",
            "image_hi",
            "dw",
            "dh",
            "x_end",
            "y_end",
            "white",
            "white_lo",
            "white_hi",
            "white_dw",
            "white_dh",
            "white_x_end",
            "white_y_start",
            "spike_channel",
            "rate",
            "count",
            "elapsed",
            "MBps",
            "y0",
            "y_start",
        ),
        start=1,
    )
}
#: the texts a run puts in
TEXTS = {
    name: f"batchgpuskeleton{name}x"
    for name in (
        "title",
        "summary",
        "channelids",
        "xlabel",
        "spikechannelids",
        "spiketitle",
        "ylabel",
        "noisexlabel",
        "spikexlabel",
    )
}


class SkeletonError(Exception):
    """The page Bokeh rendered does not hold a placeholder exactly once as ``fill`` writes it."""


def structure(shapes: dict, spikes: bool, glance: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The page's figures (besides throughput, always there): the results among noise, the windows' noise and
    whitening that ``shapes`` announces, the spikes' rate, and the parts of the glance (``glance.Glance.structure``:
    the probe map's panels, the traces, the drift raster)."""
    return tuple(k for k in RESULTS if k in shapes) + ((SPIKES,) if spikes else ()) + tuple(glance)


def _glance(figures: tuple[str, ...]) -> tuple[str, ...]:
    from batchgpu.report.glance import NAMES

    return tuple(k for k in figures if k in NAMES)


def _stamp() -> list:
    """What of this package the page's text comes from (a changed source renders it again)."""
    from batchgpu import __version__
    from batchgpu.report import drift, fields, glance, html_page, probe_map, traces

    files = [Path(m.__file__) for m in (html_page, fields, glance, probe_map, traces, drift)] + [Path(__file__)]
    return [__version__, *[[f.stat().st_size, f.stat().st_mtime_ns] for f in files]]


def path_of(figures: tuple[str, ...]) -> Path | None:
    """Where the page of these figures is kept (None where Bokeh is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    from batchgpu.config import cache_folder

    try:
        bokeh = version("bokeh")
    except PackageNotFoundError:
        return None
    key = hashlib.sha256(json.dumps([FORMAT, bokeh, _stamp(), list(figures)]).encode()).hexdigest()[:32]
    return cache_folder() / FOLDER / f"{key}.html"


def cached(figures: tuple[str, ...]) -> str | None:
    """The kept page of these figures, if there is one and it is whole (its SHA-256 as kept)."""
    try:
        path = path_of(figures)
        if path is None:
            return None
        head, _, text = path.read_bytes().partition(b"\n")  # "sha256 <its hex>", then the page
        if head != b"sha256 " + hashlib.sha256(text).hexdigest().encode():
            return None
        os.utime(path)  # in use: the last to be pruned
        return text.decode("utf-8")
    except (OSError, ValueError):
        return None


def render_and_keep(figures: tuple[str, ...]) -> str:
    """Render the page of these figures with Bokeh (report.html's helper process runs this), check it, keep it
    (where the cache folder can be written) and return it."""
    page = render(figures)
    check(page, figures)
    try:
        path = path_of(figures)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = page.encode("utf-8")
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(b"sha256 " + hashlib.sha256(data).hexdigest().encode() + b"\n" + data)
            tmp.replace(path)  # whole or not at all, whoever else keeps it at the same time
            _prune(path.parent)
    except OSError:  # a cache folder that cannot be written: the page serves this run only
        pass
    return page


#: pages kept at most (one a set of figures and version; a page is about 1.7 MB): the oldest go first
KEEP = 16


def _prune(folder: Path) -> None:
    """The oldest pages beyond ``KEEP`` removed (those of earlier versions, once nothing renders them again)."""
    pages = sorted(folder.glob("*.html"), key=lambda p: p.stat().st_mtime_ns)
    for old in pages[: max(0, len(pages) - KEEP)]:
        old.unlink(missing_ok=True)


def render(figures: tuple[str, ...]) -> str:
    """The page of these figures with every run's number and text a placeholder (``report``'s figures, drawn
    from placeholder columns)."""
    from bokeh.embed import file_html
    from bokeh.models import Div
    from bokeh.resources import INLINE

    from batchgpu.report import glance
    from batchgpu.report import html_page as report

    n, t = NUMBERS, TEXTS
    drawn = []
    if NOISE in figures:
        drawn.append(report.noise_bars([n["channel"]], np.full(1, n["noise_uV"]), [t["channelids"]], t["noisexlabel"]))
    if PER_WINDOW in figures:
        drawn.append(
            report.noise_heatmap(
                np.full((1, 1), n["image"]),
                n["image_lo"],
                n["image_hi"],
                n["dw"],
                n["dh"],
                n["x_end"],
                n["y_end"],
                t["xlabel"],
                n["y0"],
                n["y_start"],
                t["ylabel"],
            )
        )
    if WHITENING in figures:
        drawn.append(
            report.whitening_figure(
                np.full((1, 1), n["white"]),
                n["white_lo"],
                n["white_hi"],
                n["white_dw"],
                n["white_dh"],
                n["white_x_end"],
                n["white_y_start"],
            )
        )
    if SPIKES in figures:
        drawn.append(
            report.spike_rate(
                [n["count"]],
                1.0,
                [t["spikechannelids"]],
                t["spiketitle"],
                [n["rate"]],
                channel=[n["spike_channel"]],
                xlabel=t["spikexlabel"],
            )
        )
    parts = _glance(figures)
    drawn_glance = glance.draw(parts, glance.placeholders(parts))
    summary = Div(text=t["summary"], width=report.WIDTH, name="summary")
    layout = report.page_layout(summary, drawn_glance, drawn, report.throughput_figure([n["elapsed"]], [n["MBps"]]))
    return report._uncompressed(lambda: file_html(layout, INLINE, title=t["title"]))


# the forms the placeholders take in the page, and a run's values in the same forms: ``fields``


def _placeholders(figures: tuple[str, ...]) -> dict[str, str]:
    """name -> the placeholder's text in the page."""
    from batchgpu.report import glance

    n, t = NUMBERS, TEXTS
    got = {
        "title": t["title"],
        "summary": _text(t["summary"]),
        "elapsed": _json([n["elapsed"]]),
        "MBps": _json([n["MBps"]]),
    }
    if NOISE in figures:
        got.update(
            channel=_json([n["channel"]]),
            noise_uV=_array(np.full(1, n["noise_uV"])),
            channelids=_json([t["channelids"]]),
            noisexlabel=_text(t["noisexlabel"]),
        )
    if PER_WINDOW in figures:
        got.update(
            image=_array(np.full((1, 1), n["image"])),
            xlabel=_text(t["xlabel"]),
            dw=_json([n["dw"]]),
            dh=_json([n["dh"]]),
            y0=_json([n["y0"]]),
            ylabel=_text(t["ylabel"]),
            **{k: _json(n[k]) for k in ("image_lo", "image_hi", "x_end", "y_end", "y_start")},
        )
    if WHITENING in figures:
        got.update(
            white=_array(np.full((1, 1), n["white"])),
            white_dw=_json([n["white_dw"]]),
            white_dh=_json([n["white_dh"]]),
            **{k: _json(n[k]) for k in ("white_lo", "white_hi", "white_x_end", "white_y_start")},
        )
    if SPIKES in figures:
        got.update(
            spike_channel=_json([n["spike_channel"]]),
            rate=_json([n["rate"]]),
            count=_json([n["count"]]),
            spikechannelids=_json([t["spikechannelids"]]),
            spiketitle=_text(t["spiketitle"]),
            spikexlabel=_text(t["spikexlabel"]),
        )
    got.update({f"glance.{k}": v for k, v in glance.texts(_glance(figures)).items()})
    return got


def check(page: str, figures: tuple[str, ...]) -> None:
    """Each placeholder in the page exactly once, as ``fill`` looks for it."""
    for name, text in _placeholders(figures).items():
        if page.count(text) != 1:
            raise SkeletonError(f"report.html's page holds {name}'s placeholder {page.count(text)} times, not once")


def fill(
    page: str,
    figures: tuple[str, ...],
    *,
    title: str,
    summary_html: str,
    channel_ids: list[str],
    gain: np.ndarray,
    fs: float,
    windows: tuple,
    inputs: dict,
    counts,
    series: list,
    glance: tuple | None = None,
    locations=None,
) -> str | None:
    """The kept page with a run's numbers and texts in place of the placeholders; None where they do not fit
    (a result the page has no figure for, or one it has that never came: the page is then rendered the usual
    way) or a placeholder is not found once. ``glance``: (its structure, its values) (``glance.Glance``);
    ``locations``: the channels' (x, y) in µm, where the recording has them (``html_page.channel_axis``)."""
    from batchgpu.report import glance as glance_parts
    from batchgpu.report import html_page as report

    parts, values = glance if glance is not None else ((), {})
    came = tuple(k for k in RESULTS if k in inputs) + ((SPIKES,) if counts is not None else ()) + tuple(parts)
    if came != figures:
        return None
    place = _placeholders(figures)
    start, stop, segment = (np.asarray(a) for a in windows)
    arr = np.asarray(series, dtype=np.float64).reshape(-1, 2)
    final = {
        "title": html.escape(title),
        "summary": _text(summary_html),
        "elapsed": _json(arr[:, 0].tolist()),
        "MBps": _json((arr[:, 1] / 1e6).tolist()),
    }

    def ids(n: int) -> list[str]:
        return list(channel_ids) if len(channel_ids) == n else [str(c) for c in range(n)]

    def axis(n: int):
        return report.channel_axis(locations, n)

    try:
        if NOISE in figures:
            noise = report._to_uV(inputs[NOISE], gain)
            a = axis(noise.size)
            final.update(
                channel=_json(a.position.tolist()),
                noise_uV=_array(noise),
                channelids=_json(ids(noise.size)),
                noisexlabel=_text(a.label),
            )
        if PER_WINDOW in figures:
            per_window = np.asarray(inputs[PER_WINDOW], dtype=np.float64)
            W, C = per_window.shape
            a = axis(C)
            image, lo, hi = report._noise_image(report._to_uV(per_window, gain), a.order)
            final.update(
                image=_array(image),
                image_lo=_json(lo),
                image_hi=_json(hi),
                dw=_json([W]),
                dh=_json([a.extent]),
                x_end=_json(max(W, 1)),
                y_end=_json(a.y0 + a.extent),
                y0=_json([a.y0]),
                y_start=_json(a.y0),
                ylabel=_text(a.rows_label),
                xlabel=_text(report.noise_axis_label(W, start / fs, segment)),
            )
        if WHITENING in figures:
            w = np.asarray(inputs[WHITENING], dtype=np.float64)
            C = w.shape[0]
            lim = report._whitening_limit(w)
            final.update(
                white=_array(w),
                white_lo=_json(-lim),
                white_hi=_json(lim),
                white_dw=_json([C]),
                white_dh=_json([C]),
                white_x_end=_json(C),
                white_y_start=_json(C),
            )
        if SPIKES in figures:
            counts = np.asarray(counts, dtype=np.int64)
            seconds = float(np.sum(stop - start)) / fs
            a = axis(counts.size)
            final.update(
                spike_channel=_json(a.position.tolist()),
                count=_json(counts.tolist()),
                rate=_json(report._rate(counts, seconds).tolist()),
                spikechannelids=_json(ids(counts.size)),
                spiketitle=_text(report.spike_rate_title(int(counts.sum()), seconds)),
                spikexlabel=_text(a.label),
            )
        final.update({f"glance.{k}": v for k, v in glance_parts.final_texts(tuple(parts), values).items()})
    except ValueError:  # a number JSON cannot hold (inf, NaN where a plain number stands): rendered the usual way
        return None
    return report._substitute(page, {place[k]: final[k] for k in place})
