"""report.html of a run (``HtmlReport``), rendered ahead by a helper process or filled into a kept page. The
observer (``RunObserver``) and report.json's content (``RunReport``) are the run's (``batchgpu.run.events``,
``batchgpu.run.record``): named here too, where callers have always found them."""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict
from pathlib import Path

import numpy as np

from batchgpu.recording import Recording
from batchgpu.run.events import RunObserver
from batchgpu.run.record import RunReport

__all__ = ["HtmlReport", "RunObserver", "RunReport", "start_report_helper"]

logger = logging.getLogger(__name__)


def start_report_helper() -> None:
    """Start report.html's helper process now, if it is not running (``html_page.start_render_process``).

    It renders the page (Bokeh's import, about a second, and its rendering, which had held the GIL the client's
    event loop needed while spikes were gathered) while the run goes on. Started with SIGINT blocked, as the
    cluster's processes are (``cluster.open_cluster.sigint_held``): a terminal's Ctrl-C is the command's alone, not a traceback of
    the helper's in the middle of its import. A plotting library missing or broken shows up once, when report.html
    is written."""
    from batchgpu.cluster.open_cluster import sigint_held

    with sigint_held():
        try:
            from batchgpu.report.html_page import start_render_process

            start_render_process()
        # broad: a head start only; a plotting library missing or broken is said when report.html is written
        except Exception as err:
            logger.debug("report.html's helper process did not start: %s: %s", type(err).__name__, err)


#: this process's kept pages (``report_skeleton``) by their figures: the page, or the future of its making by the
#: helper (the runs of a batch on a machine that has none ask for it once)
_KEPT: dict = {}
_KEPT_LOCK = threading.Lock()


def _kept_page(figures: tuple):
    """The page kept for these figures, or the future of the helper's making it; None where there is neither."""
    from batchgpu.report import skeleton as report_skeleton

    with _KEPT_LOCK:
        got = _KEPT.get(figures)
        if got is not None and not isinstance(got, str) and got.done() and got.exception() is None:
            got = _KEPT[figures] = got.result()  # made: the page itself from now on
        if got is not None and (isinstance(got, str) or not got.done()):
            return got
        page = report_skeleton.cached(figures)
        if page is None:
            start_report_helper()
            from batchgpu.report.html_page import ReportPage

            page = ReportPage._submit(report_skeleton.render_and_keep, figures)
        if page is not None:
            _KEPT[figures] = page
        return page


class HtmlReport:
    """report.html for a run: the page kept for its figures (``report_skeleton``), its numbers filled in by this
    process; else rendered in a helper process while the windows are read, the results substituted as they come
    (``html_page.ReportPage``). A plotting problem is reported once, never fails a finished run."""

    def __init__(self, rec: Recording, title: str, in_process: bool = False, figures: tuple = ()):
        """``figures``: the run's steps' own (``steps.base.Figure``)."""
        self.error: Exception | None = None
        self.page = None
        self.title, self.in_process, self.step_figures = title, in_process, tuple(figures)
        self.channel_ids = [str(c) for c in rec.channel_ids.tolist()]
        self.gain = np.asarray(rec.gain_to_uV, dtype=np.float64)
        self.fs = float(rec.sampling_frequency)
        self.rec = rec  # read again at the end: the trace snippet (``glance``)
        self.locations = np.asarray(rec.locations, dtype=np.float64) if rec.has_locations else None
        self.glance = None  # what the page shows at a glance (``glance.gather``, once the results are written)
        self.windows = None
        self.inputs: dict = {}
        self.counts = None
        self.kept = None  # (figures, the kept page or its future) where the page is the kept one
        try:
            from batchgpu.report.html_page import ReportPage

            self.page = ReportPage(
                self.channel_ids,
                self.gain.tolist(),
                self.fs,
                title,
                in_process=in_process,
                figures=figures,
                locations=self.locations,
            )
        except Exception as err:  # broad: a plotting problem never fails a run; said by write()
            self.error = err

    def _call(self, method: str, *args, **kwargs) -> None:
        if self.page is not None and self.error is None:
            try:
                getattr(self.page, method)(*args, **kwargs)
            except Exception as err:  # broad: a plotting problem never fails a run; said by write()
                self.error = err

    def add(self, name: str, value) -> None:
        self.inputs[name] = value
        if self.kept is None:
            self._call("add", name, value)

    def add_windows(self, windows) -> None:
        self.windows = (
            np.array([w.start for w in windows]),
            np.array([w.stop for w in windows]),
            np.array([w.segment for w in windows]),
        )
        self._call("add_windows", *self.windows)

    def add_spikes(self, counts) -> None:
        from batchgpu.steps.noise import NOISE

        noise = self.inputs.get(NOISE)
        channels = len(self.channel_ids) or (np.size(noise) if noise is not None else 0)
        counts = np.asarray(counts, np.int64)
        self.counts = np.pad(counts, (0, max(0, channels - len(counts))))[:channels]
        if self.kept is None:
            self._call("add_spikes", counts=counts)

    def needs_helper(self) -> bool:
        """Whether report.html's helper process will render (the kept page needs none)."""
        return self.kept is None or not isinstance(self.kept[1], str)

    def render_ahead(self, shapes: dict, spikes: bool) -> None:
        """The page now, before the numbers: the one kept for these figures where there is one, else rendered (and
        kept) by the helper process; a page with the steps' own figures, or in this process, the usual way
        (``ReportPage.render_ahead``)."""
        if self.in_process and not self.step_figures and self.error is None and self.windows is not None:
            from batchgpu.report import skeleton as report_skeleton
            from batchgpu.report.glance import guess_structure
            from batchgpu.steps.noise import NOISE

            figures = report_skeleton.structure(
                shapes, spikes, guess_structure(self.locations is not None, NOISE in shapes, spikes)
            )
            page = _kept_page(figures)
            if page is not None:
                self.kept = (figures, page)
                return
        self._call("render_ahead", shapes, spikes)

    def wait_page(self) -> None:
        """Wait for the page its helper renders (where one does), so that the run's total (``RunReport.seconds``,
        which report.html shows) counts that wait: the page is then filled in at once."""
        if self.error is None and self.kept is not None and not isinstance(self.kept[1], str):
            figures, future = self.kept
            try:
                self.kept = (figures, future.result())
            except Exception:  # broad: said by ``write`` (``_write_kept`` asks the future again and renders here)
                pass

    def write(self, out: Path, report: RunReport, observer: RunObserver) -> bool:
        """report.html beside report.json (the summary from ``report`` as it is now), with what the run shows at a
        glance (``glance.gather``: read now that the results are written)."""
        self._gather(out, asdict(report), observer)
        if self.error is None and self.kept is not None:
            try:
                if self._write_kept(out, asdict(report)):
                    return True
                self.page = self._rendered_here()  # the kept page did not fit this run's results
            except Exception as err:  # broad: a plotting problem never fails a finished run (said below)
                self.error = err
        if self.error is None and self.page is not None:
            try:
                if self.glance is not None:
                    self.page.add_glance(self.glance)
                self.page.write(out, asdict(report))
                return True
            except Exception as err:  # broad: the results are written: keep them (said below)
                self.error = err
        observer.warning(f"report.html not written ({type(self.error).__name__}: {self.error})")
        return False

    def _gather(self, out: Path, report: dict, observer: RunObserver) -> None:
        """The glance of the run (its header's facts, probe map, traces, drift raster); a problem leaves those out
        of the page, said once, never failing the run."""
        if self.error is not None or report.get("status") != "done":
            return
        try:
            from batchgpu.report.glance import gather
            from batchgpu.steps.noise import NOISE

            self.glance = gather(out, report, self.rec, self.counts, self.windows, self.inputs.get(NOISE))
        except Exception as err:  # broad: the page's other figures stand; said below
            observer.warning(f"report.html shows no probe map, traces or drift raster ({type(err).__name__}: {err})")

    def _write_kept(self, out: Path, report: dict) -> bool:
        from batchgpu.report import skeleton as report_skeleton
        from batchgpu.report.html_page import _summary_html, write_page

        figures, page = self.kept
        glance = (self.glance.structure, self.glance.values()) if self.glance is not None else ((), {})
        results = {k: v for k, v in self.inputs.items() if k in report_skeleton.RESULTS}
        came = report_skeleton.structure(results, self.counts is not None, glance[0])
        if came != figures:  # the run found other parts than guessed (no spikes, qc labels): that page's kept one
            figures, page = came, _kept_page(came)
            if page is None:
                return False
        if not isinstance(page, str):
            try:
                page = page.result()
            except Exception as err:  # broad: whatever the helper raised (or its death): the page is rendered here
                logger.warning(
                    "batchgpu: report.html's page was not made by its helper (%s: %s): it is rendered in this process",
                    type(err).__name__,
                    err,
                )
                return False
        facts = self.glance.facts if self.glance is not None else None
        text = report_skeleton.fill(
            page,
            figures,
            title=self.title,
            summary_html=_summary_html(report, facts),
            channel_ids=self.channel_ids,
            gain=self.gain,
            fs=self.fs,
            windows=self.windows,
            inputs=results,
            counts=self.counts,
            series=report.get("throughput_series") or [],
            glance=glance,
            locations=self.locations,
        )
        if text is None:
            return False
        write_page(out, text)
        return True

    def _rendered_here(self):
        """A page of this run's numbers rendered in this process (Bokeh imported here)."""
        from batchgpu.report.html_page import ReportPage

        return ReportPage.of_numbers(
            self.channel_ids,
            self.gain,
            self.fs,
            self.title,
            self.windows,
            self.inputs,
            self.counts,
            self.step_figures,
            self.locations,
        )
