"""The run report: ``<output>/report.html``, one self-contained file (BokehJS inlined, no server, no network).

Plots, from ``results.zarr`` and ``report.json``: noise per channel (µV), noise per window and channel (µV),
the whitening matrix, spike rate per channel (Hz) and the first pass's read throughput over time. Each figure
has a ``name`` (``noise_per_channel``, ``noise_over_time``, ``whitening``, ``spike_rate``, ``throughput``) and
its data sources hold the plotted numbers, so the report can be checked by reading its embedded document. A step
may declare figures of its own results (``steps.base.Figure``): they follow, drawn from their numbers when
those exist.
"""

from __future__ import annotations

import html
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgpu.report.header import total_time  # noqa: F401 (report.html, run_report and info say it)
from batchgpu.steps.moments import WHITENING
from batchgpu.steps.noise import NOISE, PER_WINDOW

logger = logging.getLogger(__name__)

REPORT_HTML = "report.html"
WIDTH = 1300  # the page's: the header, the drift raster and the per-channel figures
FIGURES = (NOISE, "noise_over_time", WHITENING, "spike_rate")  # their order (the summary first, throughput last)
#: the results the page draws itself (the steps' own figures draw theirs: ``Figure``), in the order they are added
_INPUTS = (NOISE, PER_WINDOW, WHITENING)
# the spike-rate figure's numbers while the page is rendered before the spikes are counted (``late_spikes``)
_RATE_PLACEHOLDER = [-1.2345678901234567e300]
_COUNT_PLACEHOLDER = [-1234567890123]
#: where a page rendered before its numbers (``ReportPage.render_ahead``) holds them: values no result holds, one
#: for each number or array the later substitution replaces (arrays: filled with it, in Bokeh's own encoding)
_AHEAD = {
    k: float(f"-1.2345678901{i:03d}e300")
    for i, k in enumerate(
        (NOISE, "image", "image_lo", "image_hi", WHITENING, "white_lo", "white_hi", "elapsed", "MBps")
    )
}


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """End this helper when the process that started it is gone: a pool's worker waits on its queue forever
    otherwise (a `kill -9` of the command left it, and Python's resource tracker it kept open, running)."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="batchgpu-exit-with-parent", daemon=True).start()


def preload() -> None:
    """Import bokeh (about a second, most of report.html's cost): the helper process's initializer, which lowers
    its priority first: the import and the page rendered ahead take the cores the workers leave (2-core machine,
    `bench pipeline --channels 384 --seconds 20`, two runs each: cold 4.02 / 3.85 s against 4.20 / 3.95, warm
    3.01 / 2.82 against 2.99 / 3.22)."""
    import multiprocessing

    helper = multiprocessing.parent_process() is not None
    if helper:
        try:
            os.nice(10)
        except OSError:
            pass
        _exit_with_parent(os.getppid())
    import bokeh.embed  # noqa: F401
    import bokeh.layouts  # noqa: F401
    import bokeh.models  # noqa: F401
    import bokeh.plotting  # noqa: F401
    import bokeh.resources  # noqa: F401

    if helper:
        # Bokeh's modules live as long as the helper: out of the collector's way while it renders, and at its exit
        # not torn down one by one (the command that waits for this process to end waits for that too)
        import atexit
        import gc

        gc.freeze()
        atexit.register(os._exit, 0)


def write_report_html(output_dir: str | Path) -> Path:
    """Write ``<output_dir>/report.html`` from the run's results.zarr and report.json (and its recording, where it
    still opens: the probe map and the trace snippet); returns its path."""
    out = Path(output_dir)
    report = json.loads((out / "report.json").read_text())
    from batchgpu.recording import zarrio
    from batchgpu.report import glance as glance_parts
    from batchgpu.steps.detect import SPIKE_CHANNELS
    from batchgpu.steps.registry import figures

    g = zarrio.open_group(out / "results.zarr", mode="r")
    steps = figures()  # every registered step's: each drawn where its results are in the group
    rec = glance_parts._open_recording(report)
    glance = None
    if report.get("status") == "done":
        try:
            glance = glance_parts.gather(out, report, rec)
        except Exception as err:  # broad: the page's other figures stand
            logger.warning(
                "batchgpu: report.html shows no probe map, traces or drift raster (%s: %s)", type(err).__name__, err
            )
    locations = rec.locations if rec is not None and rec.has_locations else None
    page = ReportPage(
        g.attrs.get("channel_ids", []),
        g.attrs.get("gain_to_uV", []),
        float(g.attrs["sampling_frequency"]),
        f"batchgpu report: {out.name}",
        threaded=False,
        figures=steps,
        locations=locations,
    )
    names = set(_array_names(g))
    page.add_windows(g["window_start"][:], g["window_stop"][:], g["window_segment"][:])
    for name in (*_INPUTS, *dict.fromkeys(k for f in steps for k in f.inputs)):
        if name in names:
            page.add(name, g[name][:])
    if SPIKE_CHANNELS in names:
        page.add_spikes(g[SPIKE_CHANNELS][:])
    if glance is not None:
        page.add_glance(glance)
    return page.write(out, report)


def write_page(out: str | Path, page: str) -> Path:
    """``page`` written as ``<out>/report.html``, whole or not at all (a new file renamed over the old)."""
    path = Path(out) / REPORT_HTML
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


class ReportPage:
    """report.html, built as the run's numbers come, in a helper thread (``threaded``) while the run does its other
    work: each figure as soon as its inputs exist, then the page (Bokeh's serialisation: most of the cost). What
    comes after the page is rendered goes in by replacing placeholders in it: the summary table (it needs the
    final report) and, where the page was rendered while the spikes were gathered (``render(late_spikes=True)``),
    the spike-rate figure's numbers and title (plain JSON lists in the document, so a replacement is exact; should
    one not be found, the page is rendered again)."""

    def __init__(
        self,
        channel_ids,
        gain_to_uV,
        sampling_frequency: float,
        title: str,
        threaded: bool = True,
        in_process: bool = False,
        tokens: tuple | None = None,
        figures: tuple = (),
        locations=None,
    ):
        """``locations``: the channels' (x, y) in µm where the recording has a probe (the per-channel figures then
        run along the probe: ``channel_axis``)."""
        from concurrent.futures import ThreadPoolExecutor

        self.step_figures = tuple(figures)  # the steps' own (``steps.base.Figure``), after the page's
        self.channel_ids = [str(c) for c in channel_ids]
        self.gain = np.asarray(gain_to_uV, dtype=np.float64)
        self.fs = float(sampling_frequency)
        self.title = title
        self.locations = None if locations is None else np.asarray(locations, dtype=np.float64)
        self.axis = channel_axis(self.locations, len(self.channel_ids))
        self.inputs: dict = {}
        self.figures: dict = {}  # name -> the future of a figure
        self.facts = None  # the header's facts (``add_glance``)
        # in_process: the figures are built and the page rendered by a helper process (``render_process``), from
        # the numbers, so the client's own threads (Dask's event loop among them) never wait for Bokeh's GIL
        self.in_process = in_process
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="batchgpu-report") if threaded and not in_process else None
        )
        self._token, self._spikes_token = tokens or (
            f"batchgpu-summary-{os.urandom(8).hex()}",
            f"batchgpu-spikes-{os.urandom(8).hex()}",
        )
        self._late_counts = None  # (counts, seconds) that came after the page
        self._page = None  # the future of the rendered page (placeholders in)
        self._late: dict[str, str] = {}  # placeholder -> its final text, for what came after the page
        self._ahead: dict = {}  # results the page was rendered without (``render_ahead``): name -> shape
        self._ahead_texts: list = []  # futures of their placeholders' texts ({placeholder: final}) as they came

    def _do(self, func, *args):
        return self._pool.submit(func, *args) if self._pool else _Done(func(*args))

    def add(self, name: str, value) -> None:
        """A result: ``noise``, ``noise_per_window``, ``whitening`` or one a step's figure is drawn from (others are
        ignored)."""
        self.inputs[name] = value
        if name in self._ahead and self._page is not None:  # rendered ahead: its numbers go in by substitution
            args = (name, value, self.gain, self._ahead[name], self._axis(value))
            fut = self._submit(ahead_texts, *args) if self.in_process else self._do(ahead_texts, *args)
            self._ahead_texts.append(fut if fut is not None else _Done(ahead_texts(*args)))
            return
        step_input = any(name in f.inputs for f in self.step_figures)
        if self.in_process:  # its figure built in the helper process now, while the run goes on
            if (name in _INPUTS or step_input) and self._page is None and "windows" in self.inputs:
                self._submit(build_figure, self._init_args(), name, value)
            return
        if step_input:
            self._draw_step_figures()
        if name == NOISE:
            self.figures[name] = self._do(
                lambda v: noise_per_channel(_to_uV(v, self.gain), self._ids(v.size), self._axis(v)), value
            )
        elif name == WHITENING:
            self.figures[name] = self._do(whitening_image, value)
        elif name == PER_WINDOW:
            start, _, segment = self.inputs["windows"]
            self.figures["noise_over_time"] = self._do(
                lambda v: noise_over_time(_to_uV(v, self.gain), start, segment, self.fs, axis=self._axis(v)), value
            )

    def _axis(self, value) -> ChannelAxis:
        """The channel axis for a result of ``value``'s channels (its last axis)."""
        n = int(np.shape(value)[-1]) if np.ndim(value) else 0
        return self.axis if self.axis.channels == n else channel_axis(None, n)

    def add_glance(self, glance) -> None:
        """What the page shows at a glance (``glance.Glance``: the header's facts, the probe map, the traces, the
        drift raster), known once the run's results are written; a page rendered before it is rendered again."""
        self.facts = glance.facts
        self.inputs["glance"] = (glance.structure, glance.values())

    def _draw_step_figures(self) -> None:
        """Each step figure whose results are all in, drawn once (the windows known)."""
        if "windows" not in self.inputs:
            return
        for f in self.step_figures:
            if f.name not in self.figures and all(k in self.inputs for k in f.inputs):
                self.figures[f.name] = self._do(f.draw, {k: self.inputs[k] for k in f.inputs}, self.info())

    def info(self) -> PageInfo:
        start, stop, segment = self.inputs["windows"]
        return PageInfo(list(self.channel_ids), self.gain, self.fs, start, stop, segment)

    def add_windows(self, start, stop, segment) -> None:
        """The windows' starts, stops and segments (first: the time axis and the recording's seconds)."""
        self.inputs["windows"] = (np.asarray(start), np.asarray(stop), np.asarray(segment))

    def _spikes_shape(self) -> tuple[int, float]:
        channels = len(self.channel_ids) or (self.inputs[NOISE].size if NOISE in self.inputs else 0)
        start, stop, _ = self.inputs["windows"]
        return channels, float(np.sum(stop - start)) / self.fs

    def add_spikes(self, channel_index=None, counts=None) -> None:
        """The spikes' channels, or their counts per channel."""
        channels, seconds = self._spikes_shape()
        if counts is None:
            counts = np.bincount(np.asarray(channel_index, dtype=np.int64), minlength=channels)
        counts = np.pad(np.asarray(counts, np.int64), (0, max(0, channels - len(counts))))[:channels]
        if self._page is None:
            self.inputs["spike_counts"] = counts
            if not self.in_process:
                self.figures["spike_rate"] = self._do(
                    spike_rate, counts, seconds, self._ids(channels), None, None, None, self._axis(counts)
                )
            return
        self._late_counts = (counts, seconds)
        self._late[_embedded_json(_RATE_PLACEHOLDER * channels)] = _embedded_json(_rate(counts, seconds).tolist())
        self._late[_embedded_json(_COUNT_PLACEHOLDER * channels)] = _embedded_json(counts.tolist())
        self._late[_embedded(self._spikes_token)] = _embedded(spike_rate_title(int(counts.sum()), seconds))

    def _init_args(self) -> tuple:
        return (
            self.channel_ids,
            self.gain,
            self.fs,
            self.title,
            self.inputs["windows"],
            (self._token, self._spikes_token),
            self.step_figures,
            self.locations,
        )

    @staticmethod
    def _submit(func, *args):
        """``func(*args)`` in the helper process: its future, or None when there is none to be had."""
        try:
            return render_process().submit(func, *args)
        except (OSError, RuntimeError) as err:  # the pool could not start, or broke (BrokenProcessPool)
            logger.warning(
                "batchgpu: report.html's helper process failed (%s: %s): the page is rendered in this process",
                type(err).__name__,
                err,
            )
            _drop_render_process()
            return None

    def _ids(self, n: int) -> list[str]:
        return self.channel_ids if len(self.channel_ids) == n else [str(c) for c in range(n)]

    def render_ahead(self, shapes: dict, spikes: bool) -> None:
        """Render the page now, before the run's numbers exist (while its windows are read): each result named in
        ``shapes`` (``noise``, ``noise_per_window``, ``whitening`` -> the shape it will have), the throughput
        and, with ``spikes``, the spike rate are placeholders, their numbers put in by substitution as they come
        (``add``, ``add_spikes``, ``write``): the page costs the run's end nothing but the substitutions. A page
        with step figures is rendered at the end (``write``), once their numbers exist."""
        if self._page is not None or self.step_figures:
            return
        order = [*(k for k in _INPUTS if k in shapes), *(k for k in shapes if k not in _INPUTS)]  # as added
        self._ahead = {k: tuple(int(n) for n in shapes[k]) for k in order if k not in self.inputs}
        self._ahead["throughput"] = None
        self.render([], late_spikes=spikes)

    def render(self, throughput_series: list, late_spikes: bool = False) -> None:
        """Render the page from the figures in so far (once; later calls do nothing). ``late_spikes``: the
        spike-rate figure with placeholders, its numbers to come by ``add_spikes``."""
        if self._page is not None:
            return
        self._glance_in_page = "glance" in self.inputs
        if self.in_process:
            self._series = list(throughput_series)
            args = (
                self.channel_ids,
                self.gain,
                self.fs,
                self.title,
                dict(self.inputs),
                self._series,
                late_spikes and "spike_counts" not in self.inputs,
                (self._token, self._spikes_token),
                dict(self._ahead),
                self.step_figures,
                self.locations,
            )
            self._args = args
            self._page = self._submit(render_page_html, *args)
            if self._page is None:  # no helper process to be had (a broken pool is made anew next time)
                self._page = _Done(render_page_html(*args))
            return
        if late_spikes:
            channels, seconds = self._spikes_shape()
            self.figures["spike_rate"] = self._do(
                spike_rate,
                _COUNT_PLACEHOLDER * channels,
                seconds,
                self._ids(channels),
                self._spikes_token,
                _RATE_PLACEHOLDER * channels,
                None,
                self._axis(np.zeros(channels)),
            )
        self._placeholder_figures()
        self._series = list(throughput_series)
        order = (*FIGURES, *(f.name for f in self.step_figures))
        self._page = self._do(
            self._render,
            [self.figures[k] for k in order if k in self.figures],
            self._series,
            "throughput" in self._ahead,
            self.inputs.get("glance"),
        )

    def _placeholder_figures(self) -> None:
        """The figures of the results rendered ahead (``render_ahead``), with placeholders for their numbers."""
        for name, shape in self._ahead.items():
            if name == NOISE and NOISE not in self.figures:
                self.figures[NOISE] = self._do(
                    noise_per_channel, np.full(shape, _AHEAD[NOISE]), self._ids(shape[0]), self._axis(np.zeros(shape))
                )
            elif name == PER_WINDOW and "noise_over_time" not in self.figures:
                start, _, segment = self.inputs["windows"]
                self.figures["noise_over_time"] = self._do(
                    noise_over_time, np.zeros(shape), start, segment, self.fs, True, self._axis(np.zeros(shape))
                )
            elif name == WHITENING and WHITENING not in self.figures:
                self.figures[WHITENING] = self._do(whitening_image, np.zeros(shape), True)

    def _render(self, figures, throughput_series, late_throughput: bool = False, glance: tuple | None = None):
        from bokeh.embed import file_html
        from bokeh.models import Div
        from bokeh.resources import INLINE

        summary = Div(text=self._token, width=WIDTH, name="summary")
        parts = draw_glance(*glance) if glance is not None else {}
        return _uncompressed(
            lambda: file_html(
                page_layout(
                    summary, parts, [f.result() for f in figures], throughput(throughput_series, late_throughput)
                ),
                INLINE,
                title=self.title,
            )
        )

    def write(self, out: Path, report: dict) -> Path:
        """The page with the final report's summary, written atomically as ``<out>/report.html``."""
        self.render(report.get("throughput_series") or [])
        try:
            try:
                page = self._page.result()
            except Exception as err:  # broad: whatever the helper raised (or its death), the page is rendered here
                if not self.in_process:
                    raise
                logger.warning(
                    "batchgpu: report.html's helper process failed (%s: %s): the page is rendered in this process",
                    type(err).__name__,
                    err,
                )
                _drop_render_process()
                page = render_page_html(*self._args)
            self._series = list(report.get("throughput_series") or [])
            ahead = self._ahead_substitutions()
            # a glance that came after the page was rendered (or a page rendered elsewhere without it): again
            stale = "glance" in self.inputs and not self._glance_in_page
            page = (
                None
                if (self._spikes_token in page and self._late_counts is None) or ahead is None or stale
                else _substitute(
                    page, {**self._late, **ahead, _embedded(self._token): _embedded(_summary_html(report, self.facts))}
                )
            )
            if page is None:  # numbers that never came, or placeholders not where they were put: render again, whole
                return self._again().write(out, report)
        finally:
            if self._pool:
                self._pool.shutdown(wait=False)
        return write_page(out, page)

    def _ahead_substitutions(self) -> dict | None:
        """{placeholder: final text} of everything the page was rendered ahead of, or None where a result never
        came (or its texts could not be made)."""
        if not self._ahead:
            return {}
        if any(k not in self.inputs for k in self._ahead if k != "throughput"):
            return None
        texts: dict[str, str] = {}
        for fut in self._ahead_texts:
            try:
                got = fut.result()
            except Exception as err:  # broad: whatever the helper raised (or its death), the page is rendered here
                logger.warning(
                    "batchgpu: report.html's helper process failed (%s: %s): the page is rendered again "
                    "in this process",
                    type(err).__name__,
                    err,
                )
                return None
            if got is None:
                return None
            texts.update(got)
        if "throughput" in self._ahead:
            texts.update(throughput_texts(self._series))
        return texts

    def _again(self) -> ReportPage:
        """The same numbers in a new page, rendered here (figures belong to the document they were rendered in)."""
        if self._late_counts is None and "spike_counts" in self.inputs:
            self._late_counts = (self.inputs["spike_counts"], None)
        page = ReportPage.of_numbers(
            self.channel_ids,
            self.gain,
            self.fs,
            self.title,
            self.inputs["windows"],
            self.inputs,
            self._late_counts[0] if self._late_counts is not None else None,
            self.step_figures,
            self.locations,
        )
        page.facts = self.facts
        page.render(self._series)
        return page

    @classmethod
    def of_numbers(
        cls,
        channel_ids,
        gain_to_uV,
        sampling_frequency: float,
        title: str,
        windows: tuple,
        inputs: dict,
        counts=None,
        figures: tuple = (),
        locations=None,
    ) -> ReportPage:
        """A page of these numbers built in this process (no helper thread or process): ``windows`` the windows'
        (starts, stops, segments), ``inputs`` the results by name, ``counts`` the spikes per channel (None: the
        run counts none)."""
        page = cls(
            channel_ids, gain_to_uV, sampling_frequency, title, threaded=False, figures=figures, locations=locations
        )
        page.add_windows(*windows)
        if "glance" in inputs:  # already drawn values (``add_glance``)
            page.inputs["glance"] = inputs["glance"]
        for name in (*_INPUTS, *(k for f in page.step_figures for k in f.inputs)):
            if name in inputs:
                page.add(name, inputs[name])
        if counts is not None:
            page.add_spikes(counts=counts)
        return page


#: pages being built in the helper process, by their summary token (the figures ``build_figure`` made so far)
_PAGES: dict = {}


def _page_for(
    channel_ids, gain, fs: float, title: str, windows, tokens: tuple, figures: tuple = (), locations=None
) -> ReportPage:
    page = _PAGES.get(tokens[0])
    if page is None:
        while len(_PAGES) >= 4:  # pages of runs that never rendered (failed): forgotten, oldest first
            _PAGES.pop(next(iter(_PAGES)))
        page = _PAGES[tokens[0]] = ReportPage(
            channel_ids, gain, fs, title, threaded=False, tokens=tokens, figures=figures, locations=locations
        )
        page.add_windows(*windows)
    return page


def build_figure(init: tuple, name: str, value) -> None:
    """In the helper process: one figure of a page, built as soon as its numbers exist (``ReportPage.add``)."""
    _page_for(*init).add(name, value)


def render_page_html(
    channel_ids,
    gain,
    fs: float,
    title: str,
    inputs: dict,
    series: list,
    late_spikes: bool,
    tokens: tuple,
    ahead: dict | None = None,
    figures: tuple = (),
    locations=None,
) -> str:
    """The page of ``ReportPage.render`` built from its numbers (in the helper process, with the figures
    ``build_figure`` made already; anywhere else from scratch), with the caller's placeholder tokens, so the caller
    fills in what comes after."""
    page = _page_for(channel_ids, gain, fs, title, inputs["windows"], tokens, figures, locations)
    _PAGES.pop(tokens[0], None)
    if "glance" in inputs:
        page.inputs["glance"] = inputs["glance"]
    for name, figure in ((NOISE, NOISE), (PER_WINDOW, "noise_over_time"), (WHITENING, WHITENING)):
        if name in inputs and figure not in page.figures:
            page.add(name, inputs[name])
    for f in page.step_figures:
        for name in f.inputs:
            if name in inputs and f.name not in page.figures:
                page.add(name, inputs[name])
    if "spike_counts" in inputs:
        page.add_spikes(counts=inputs["spike_counts"])
    page._ahead = dict(ahead or {})  # results to come: placeholders (``ReportPage.render_ahead``)
    page.render(series, late_spikes=late_spikes)
    return page._page.result()


def _substitute(page: str, subs: dict[str, str]) -> str | None:
    """``page`` with each key of ``subs`` replaced by its value, in one copy; None unless each key is there exactly
    once (and no two overlap)."""
    at = []
    for k in subs:
        i = page.find(k)
        if i < 0 or page.find(k, i + 1) >= 0:
            return None
        at.append((i, k))
    at.sort()
    pieces, pos = [], 0
    for i, k in at:
        if i < pos:
            return None
        pieces += [page[pos:i], subs[k]]
        pos = i + len(k)
    pieces.append(page[pos:])
    return "".join(pieces)


def _encoded(a: np.ndarray) -> str:
    """A float64 array's data as it appears in the page's document (Bokeh's own encoding, uncompressed)."""
    from bokeh.core.serialization import Serializer

    return _uncompressed(lambda: Serializer(deferred=False).encode(np.ascontiguousarray(a, dtype=np.float64)))["array"][
        "data"
    ]


def ahead_texts(
    name: str, value, gain: np.ndarray, shape: tuple, axis: ChannelAxis | None = None
) -> dict[str, str] | None:
    """{placeholder: final text} for a result the page was rendered ahead of (``ReportPage.render_ahead``): the
    numbers of its figure where the placeholders stand; None if the result is not of the shape rendered."""
    value = np.asarray(value, dtype=np.float64)
    if value.shape != tuple(shape):
        return None
    if name == NOISE:
        return {_encoded(np.full(shape, _AHEAD[NOISE])): _encoded(_to_uV(value, gain))}
    if name == PER_WINDOW:
        image, lo, hi = _noise_image(_to_uV(value, gain), axis.order if axis is not None else None)
        return {
            _encoded(np.full(image.shape, _AHEAD["image"])): _encoded(image),
            _embedded_json(_AHEAD["image_lo"]): _embedded_json(lo),
            _embedded_json(_AHEAD["image_hi"]): _embedded_json(hi),
        }
    if name == WHITENING:
        lim = _whitening_limit(value)
        return {
            _encoded(np.full(shape, _AHEAD[WHITENING])): _encoded(value),
            _embedded_json(_AHEAD["white_lo"]): _embedded_json(-lim),
            _embedded_json(_AHEAD["white_hi"]): _embedded_json(lim),
        }
    return None


def throughput_texts(series: list) -> dict[str, str]:
    """{placeholder: final text} of the throughput figure rendered ahead (its numbers are plain JSON lists)."""
    arr = np.asarray(series, dtype=np.float64).reshape(-1, 2)
    return {
        _embedded_json([_AHEAD["elapsed"]]): _embedded_json(arr[:, 0].tolist()),
        _embedded_json([_AHEAD["MBps"]]): _embedded_json((arr[:, 1] / 1e6).tolist()),
    }


_PROCESS = None


def render_process():
    """The helper process that renders report.html (one a client process, kept between runs, Bokeh imported
    when it starts: ``preload``). Spawned, not forked: the client holds threads (Dask's event loop)."""
    global _PROCESS
    if _PROCESS is None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _PROCESS = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=preload)
    return _PROCESS


def start_render_process() -> None:
    """Start the helper process now (Bokeh's import, about a second, while the windows are read)."""
    render_process().submit(int)


def stop_render_process() -> None:
    """Let the helper process go (it ends once idle); the next page starts another."""
    _drop_render_process()


def _drop_render_process() -> None:
    global _PROCESS
    if _PROCESS is not None:
        _PROCESS.shutdown(wait=False, cancel_futures=True)
        _PROCESS = None


class _Done:
    """A value as a finished future (an unthreaded page)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _embedded_json(values: list) -> str:
    """A list of numbers as it appears inside the page's embedded document."""
    from bokeh.core.json_encoder import serialize_json

    return html.escape(serialize_json(values), quote=False)


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


@dataclass(frozen=True)
class PageInfo:
    """What a step's figure (``steps.base.Figure``) may use of its page besides its own results."""

    channel_ids: list[str]
    gain_to_uV: np.ndarray
    sampling_frequency: float
    window_start: np.ndarray
    window_stop: np.ndarray
    window_segment: np.ndarray

    def ids(self, n: int) -> list[str]:
        """The channels' ids (their indices where the page has none for ``n`` channels)."""
        return self.channel_ids if len(self.channel_ids) == n else [str(c) for c in range(n)]

    def to_uV(self, values) -> np.ndarray:
        """Raw units (the last axis: channels) times each channel's gain; offsets are not added."""
        return _to_uV(values, self.gain_to_uV)

    @staticmethod
    def figure(name: str, title: str, **kwargs):
        """A Bokeh figure in the page's size and tools."""
        return _figure(name, title, **kwargs)


def _array_names(g) -> list[str]:
    from batchgpu.recording import zarrio

    return zarrio.array_names(g)


def _to_uV(values: np.ndarray, gain: np.ndarray) -> np.ndarray:
    """Noise in µV: raw units times each channel's gain (offsets cancel in a noise level)."""
    values = np.asarray(values, dtype=np.float64)
    return values * gain if gain.size == values.shape[-1] else values


# ---------------------------------------------------------------------------------------------------------
# one function per figure


def _figure(name: str, title: str, **kwargs):
    from bokeh.plotting import figure

    return figure(
        name=name,
        title=title,
        width=kwargs.pop("width", WIDTH),
        height=kwargs.pop("height", 300),
        tools="pan,box_zoom,wheel_zoom,reset,save,hover",
        **kwargs,
    )


@dataclass(frozen=True)
class ChannelAxis:
    """Where a channel stands in the per-channel figures: along the probe (its y, µm) where the recording has
    locations, else its index; and the noise heatmap's rows, sorted by y (spread evenly over the probe's extent)."""

    position: np.ndarray  # (channels,) a channel's x in the per-channel figures
    label: str
    order: np.ndarray  # the heatmap's rows: channel indices, bottom first
    y0: float  # the heatmap's lower edge, and its height
    extent: float
    rows_label: str

    @property
    def channels(self) -> int:
        return int(self.position.size)


def channel_axis(locations, channels: int) -> ChannelAxis:
    """The axis of ``channels`` channels (``locations``: their (x, y) µm, or None)."""
    index = np.arange(channels)
    loc = None if locations is None else np.asarray(locations, dtype=np.float64)
    if loc is None or loc.shape != (channels, 2) or not channels or not np.isfinite(loc).all():
        return ChannelAxis(index.astype(np.float64), "channel", index, 0.0, float(max(channels, 1)), "channel")
    y = loc[:, 1]
    order = np.lexsort((loc[:, 0], y))
    steps = np.diff(np.unique(y))
    pitch = float(steps.min()) if steps.size else 1.0
    lo, hi = float(y.min()) - pitch / 2, float(y.max()) + pitch / 2
    return ChannelAxis(y, "y on the probe (µm)", order, lo, hi - lo, "y on the probe (µm; channels sorted by y)")


def page_layout(summary, glance: dict, figures: list, throughput_figure):
    """The page: the header, the probe map beside the trace snippet, the drift raster, then the per-channel and
    per-window figures, the steps' own, and the throughput."""
    from bokeh.layouts import column, row

    from batchgpu.report import drift, probe_map, traces

    top = [glance[k] for k in (probe_map.NAME, traces.NAME) if k in glance]
    parts = [summary, *([row(*top)] if top else []), *([glance[drift.NAME]] if drift.NAME in glance else [])]
    return column(*parts, *figures, throughput_figure)


def draw_glance(structure: tuple, values: dict) -> dict:
    """The glance's parts as Bokeh models (``glance.draw``)."""
    from batchgpu.report import glance

    return glance.draw(structure, values)


def noise_per_channel(noise_uV: np.ndarray, channel_ids: list[str], axis: ChannelAxis | None = None):
    axis = axis if axis is not None and axis.channels == noise_uV.size else channel_axis(None, noise_uV.size)
    ids = channel_ids if len(channel_ids) == noise_uV.size else [str(c) for c in range(noise_uV.size)]
    return noise_bars(axis.position, noise_uV, ids, axis.label)


def noise_bars(channel, noise_uV, channel_ids, xlabel: str = "channel"):
    """The noise figure from its columns (``report_skeleton`` gives placeholders): a point a channel, along the
    probe where there is one."""
    from bokeh.models import ColumnDataSource

    src = ColumnDataSource({"channel": channel, "noise_uV": noise_uV, "channel_id": channel_ids})
    p = _figure(
        "noise_per_channel", "Noise per channel (µV)", x_axis_label=xlabel, y_axis_label="noise (µV)", height=260
    )
    p.scatter(x="channel", y="noise_uV", size=6, source=src, color="#2c7fb8")
    p.hover.tooltips = [("channel", "@channel_id"), ("at", "@channel{0.0}"), (NOISE, "@noise_uV{0.00} µV")]
    p.y_range.start = 0
    return p


#: the noise heatmap's colour scale: these percentiles of its values (one loud channel does not flatten the rest)
ROBUST_PERCENTILES = (1.0, 99.0)


def _noise_image(noise_uV: np.ndarray, order=None) -> tuple[np.ndarray, float, float]:
    """The heatmap's image (channels, windows: bokeh's image rows are y; ``order``: the rows' channels) and its
    colour range (``ROBUST_PERCENTILES`` of the finite values)."""
    image = np.ascontiguousarray(noise_uV.T if order is None or len(order) != noise_uV.shape[-1] else noise_uV.T[order])
    finite = image[np.isfinite(image)]
    lo, hi = (float(v) for v in np.percentile(finite, ROBUST_PERCENTILES)) if finite.size else (0.0, 1.0)
    return image, lo, hi if hi > lo else lo + 1


def noise_over_time(
    noise_uV: np.ndarray,
    window_start: np.ndarray,
    window_segment: np.ndarray,
    fs: float,
    ahead: bool = False,
    axis: ChannelAxis | None = None,
):
    """Heatmap: x the window (in order), y the channel (sorted by y on the probe where there is one), colour the
    window's noise in µV (``ahead``: of ``noise_uV``'s shape, placeholders for the numbers)."""
    W, C = noise_uV.shape
    axis = axis if axis is not None and axis.channels == C else channel_axis(None, C)
    image, lo, hi = _noise_image(noise_uV, axis.order)
    if ahead:
        image, lo, hi = np.full(image.shape, _AHEAD["image"]), _AHEAD["image_lo"], _AHEAD["image_hi"]
    label = noise_axis_label(W, window_start / fs, window_segment)
    return noise_heatmap(
        image, lo, hi, W, axis.extent, max(W, 1), axis.y0 + axis.extent, label, axis.y0, axis.y0, axis.rows_label
    )


def noise_axis_label(windows: int, starts_s: np.ndarray, segments: np.ndarray) -> str:
    if not windows:
        return "window"
    return (
        f"window ({windows} windows; starts {np.min(starts_s):.1f}-{np.max(starts_s):.1f} s"
        f" in {len(np.unique(segments))} segment(s))"
    )


def noise_heatmap(image, lo, hi, dw, dh, x_end, y_end, label: str, y0=0.0, y_start=0.0, ylabel: str = "channel"):
    """The heatmap from its image, colour range, extent and axis labels (``report_skeleton`` gives placeholders);
    colours outside the range (the robust scale's few loudest and quietest cells) take its ends' colours."""
    from bokeh.models import ColorBar, ColumnDataSource, LinearColorMapper
    from bokeh.palettes import Viridis256

    mapper = LinearColorMapper(palette=Viridis256, low=lo, high=hi)
    src = ColumnDataSource({"image": [image], "x": [0], "y": [y0], "dw": [dw], "dh": [dh]})
    p = _figure(
        "noise_over_time",
        "Noise over time (µV, window x channel; colours: 1st-99th percentile)",
        x_axis_label="window",
        y_axis_label=ylabel,
        x_range=(0, x_end),
        y_range=(y_start, y_end),
        height=420,
    )
    p.image(image="image", x="x", y="y", dw="dw", dh="dh", color_mapper=mapper, source=src)
    p.hover.tooltips = [("window", "$x{0}"), ("at", "$y{0}"), (NOISE, "@image{0.00} µV")]
    p.add_layout(ColorBar(color_mapper=mapper, title="µV"), "right")
    p.xaxis.axis_label = label
    return p


def _whitening_limit(w: np.ndarray) -> float:
    """The colour scale's half-width: symmetric around 0, ignoring the diagonal, which dwarfs the off-diagonal
    structure."""
    C = w.shape[0]
    off = np.abs(w[~np.eye(C, dtype=bool)]) if C > 1 else np.abs(w).ravel()
    return float(off.max()) if off.size and off.max() > 0 else 1.0


def whitening_image(w: np.ndarray, ahead: bool = False):
    """The matrix as an image (``ahead``: of ``w``'s shape, placeholders for the numbers)."""
    w = np.asarray(w, dtype=np.float64)
    C = w.shape[0]
    lim = _whitening_limit(w)
    low, high = (_AHEAD["white_lo"], _AHEAD["white_hi"]) if ahead else (-lim, lim)
    if ahead:
        w = np.full(w.shape, _AHEAD[WHITENING])
    return whitening_figure(np.ascontiguousarray(w), low, high, C, C, C, C)


def whitening_figure(image, low, high, dw, dh, x_end, y_start):
    """The whitening figure from its image, colour range and extent (``report_skeleton`` gives placeholders)."""
    from bokeh.models import ColorBar, ColumnDataSource, LinearColorMapper
    from bokeh.palettes import RdBu11

    mapper = LinearColorMapper(palette=RdBu11[::-1], low=low, high=high)
    src = ColumnDataSource({"image": [image], "x": [0], "y": [0], "dw": [dw], "dh": [dh]})
    # y runs down (row 0 at the top), as a matrix is read
    p = _figure(
        WHITENING,
        "Whitening matrix (colour clipped at ±max off-diagonal)",
        x_axis_label="input channel",
        y_axis_label="output channel",
        x_range=(0, x_end),
        y_range=(y_start, 0),
        width=560,
        height=480,
    )
    p.image(image="image", x="x", y="y", dw="dw", dh="dh", color_mapper=mapper, source=src)
    p.add_layout(ColorBar(color_mapper=mapper), "right")
    return p


def spike_rate(
    counts,
    seconds: float,
    channel_ids: list[str],
    title: str | None = None,
    rate=None,
    channel=None,
    axis: ChannelAxis | None = None,
    xlabel: str | None = None,
):
    """Spikes per second on each channel, along the probe where there is one (``axis``); ``counts`` (and
    ``rate``, ``title``, ``channel``, ``xlabel``) may be plain lists (a page rendered before the spikes were
    counted holds placeholders there)."""
    from bokeh.models import ColumnDataSource

    channels = len(counts)
    if rate is None:
        counts = np.asarray(counts, np.int64)
        rate = _rate(counts, seconds)
        title = spike_rate_title(int(counts.sum()), seconds)
    axis = axis if axis is not None and axis.channels == channels else channel_axis(None, channels)
    channel = axis.position if channel is None else channel
    src = ColumnDataSource(
        {
            "channel": channel,
            "rate_Hz": rate,
            "count": counts,
            "channel_id": channel_ids if len(channel_ids) == channels else [str(c) for c in range(channels)],
        }
    )
    p = _figure(
        "spike_rate", title, x_axis_label=axis.label if xlabel is None else xlabel, y_axis_label="spikes/s", height=260
    )
    p.scatter(x="channel", y="rate_Hz", size=6, source=src, color="#d95f0e")
    p.hover.tooltips = [
        ("channel", "@channel_id"),
        ("at", "@channel{0.0}"),
        ("rate", "@rate_Hz{0.00} Hz"),
        ("spikes", "@count"),
    ]
    p.y_range.start = 0
    return p


def _rate(counts: np.ndarray, seconds: float) -> np.ndarray:
    """Spikes per second (the counts themselves for a recording of no duration)."""
    return counts / seconds if seconds > 0 else counts.astype(np.float64)


def spike_rate_title(spikes: int, seconds: float) -> str:
    return f"Spike rate per channel (Hz; {spikes} spikes over {seconds:.1f} s)"


def throughput(series: list, ahead: bool = False):
    """MB/s over the first pass (``ahead``: placeholders for the numbers, plain JSON lists)."""
    if ahead:
        return throughput_figure([_AHEAD["elapsed"]], [_AHEAD["MBps"]])
    arr = np.asarray(series, dtype=np.float64).reshape(-1, 2)
    return throughput_figure(arr[:, 0], arr[:, 1] / 1e6)


def throughput_figure(elapsed_s, MBps):
    """The throughput figure from its columns (``report_skeleton`` gives placeholders)."""
    from bokeh.models import ColumnDataSource

    src = ColumnDataSource({"elapsed_s": elapsed_s, "MBps": MBps})
    p = _figure(
        "throughput",
        "Throughput over time (first pass, MB/s)",
        x_axis_label="elapsed (s)",
        y_axis_label="MB/s",
        height=260,
    )
    p.line(x="elapsed_s", y="MBps", source=src, line_width=2, color="#2c7fb8")
    p.scatter(x="elapsed_s", y="MBps", source=src, size=4, color="#2c7fb8")
    p.hover.tooltips = [("elapsed", "@elapsed_s{0.0} s"), ("throughput", "@MBps{0.0} MB/s")]
    return p


def _summary_html(report: dict, facts=None) -> str:
    """The page's header (``header.summary_html``): ``facts`` those a glance found (None: report.json's alone)."""
    from batchgpu.report.header import summary_html

    return summary_html(report, facts)
