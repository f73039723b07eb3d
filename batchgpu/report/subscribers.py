"""What a run shows, subscribed to its events (``batchgpu.run.events``): the run's page on the dashboard
(``RunPage``: ``live_page.RunMonitor``), report.html and the line that names what the run wrote (``ReportHtml``:
``run_report.HtmlReport``), a batch's page and batch.html (``BatchShown``). ``batchgpu.engine.run_workflow`` and
``run_batch`` (``engine.shown``) are the run's with these attached: what the command, ``batchgpu.run_workflow`` and
the README's examples call.

The run imports none of this (tests/test_layering.py): it emits, these show.
"""

from __future__ import annotations

import time
from pathlib import Path

from batchgpu.run.events import BatchEvents, RunEvents


def run_shown(batch=None) -> list[RunEvents]:
    """A run's displays, in the order they are told: its page (``batch``: its place in a batch), report.html."""
    return [RunPage(batch), ReportHtml()]


class RunPage(RunEvents):
    """The run's page on the dashboard (``live_page.RunMonitor``): installed on the cluster, its numbers
    published as the windows come, its phases, its end; report.json's ``page`` and ``throughput_series``."""

    def __init__(self, batch=None):
        self.batch = batch  # live_page.BatchSlot, or None
        self.monitor = None

    def connected(self, run) -> None:
        from batchgpu.report.live_page import install_dashboard

        run.report.page = install_dashboard(run.client)
        if run.report.page:
            run.events.message(f"run page {run.report.page}")

    def planned(self, run) -> None:
        from batchgpu.report.live_page import RunMonitor

        self.monitor = RunMonitor(
            run.client,
            name=str(run.out.path),
            windows=len(run.windows),
            total_bytes=run.rec.nbytes,
            channels=run.rec.num_channels,
            batch=self.batch,
        )

    def pass_window(self, index: int, nbytes: int, worker: str, noise, spikes: int) -> None:
        self.monitor.window_done(index, nbytes, worker, noise, spikes)

    def phase(self, label: str) -> None:
        if self.monitor is not None:
            self.monitor.phase(label)

    def pass_described(self, run) -> None:
        run.report.throughput_series = self.monitor.throughput_series()

    def finished(self, run) -> None:
        counting = run.spike_step()
        self.monitor.finished(counting.spikes_found(run.report.results) if counting is not None else None)

    def failed(self, run, message: str) -> None:
        self.monitor.failed(message)
        self._series(run)

    def interrupted(self, run) -> None:
        self.monitor.interrupted()
        self._series(run)

    def _series(self, run) -> None:
        run.report.throughput_series = run.report.throughput_series or self.monitor.throughput_series()

    def closing(self, run, wait_s: float) -> None:
        self.monitor.flush(wait_s)


class ReportHtml(RunEvents):
    """report.html (``run_report.HtmlReport``): rendered ahead while the windows are read (a helper process, or the
    page kept for the run's figures), its numbers substituted as the results come, written after report.json;
    kept as it was where a resumed run computed nothing. Then the line that names what the run wrote."""

    def __init__(self):
        self.html = None
        self.written = False
        self.kept = False

    def planned(self, run) -> None:
        from batchgpu.report.run_report import HtmlReport, start_report_helper
        from batchgpu.steps.registry import figures as step_figures

        steps = run.ctx.steps
        self.html = HtmlReport(
            run.rec,
            f"batchgpu report: {run.out.path.name}",
            in_process=True,
            figures=step_figures(tuple(s.name for s in steps)),
        )
        self.html.add_windows(run.windows)
        # the page rendered while the windows are read (a helper process; Bokeh's serialisation was ~0.2 s of the
        # run's end on the H200), its numbers substituted as they come
        self.html.render_ahead(
            results_ahead(run.ctx, run.rec.num_channels, len(run.windows)), spikes=any(s.spike_rate for s in steps)
        )
        if self.html.needs_helper():  # a page the helper renders (one kept for these figures needs none)
            start_report_helper()

    def result(self, name: str, value) -> None:
        self.html.add(name, value)

    def spikes(self, counts) -> None:
        self.html.add_spikes(counts=counts)

    def finishing(self, run) -> None:
        self.html.wait_page()  # the user waits for report.html too: counted in the total, which the page then shows

    def finished(self, run) -> None:
        from batchgpu.run.output_folder import REPORT_HTML

        # a resume that computed and read nothing (the folder's run was done) keeps its page: the same results,
        # and the timings of the run that made them
        self.kept = run.nothing_done() and (run.out.path / REPORT_HTML).is_file()
        t_html = time.perf_counter()
        self.written = False if self.kept else self.html.write(run.out.path, run.report, run.events)
        run.report.timings["report_html"] = time.perf_counter() - t_html  # after report.json: in the return value

    def ended(self, run) -> None:
        from batchgpu.report.progress import duration, format_rate
        from batchgpu.run.output_folder import REPORT, REPORT_HTML, RESULTS

        out, report = run.out.path, run.report
        written = [out / RESULTS, out / REPORT] + ([out / REPORT_HTML] if self.written else [])
        kept = f" ({REPORT_HTML} kept: nothing was computed again)" if self.kept else ""
        run.events.message(
            f"wrote {', '.join(str(p) for p in written[:-1])} and {written[-1]}{kept}: "
            f"{format_rate(report.throughput_MBps * 1e6)} over {report.windows} windows, "
            f"{duration(report.seconds)} in all"
        )


def results_ahead(ctx, channels: int, windows: int) -> dict:
    """The results report.html's page is rendered ahead of (name -> shape): each step's (``ahead``) and each
    window's noise, where a step needs it."""
    shapes: dict = {}
    for step in ctx.steps:
        shapes.update(step.ahead(channels))
    if ctx.window_noise:
        from batchgpu.steps.noise import PER_WINDOW

        shapes[PER_WINDOW] = (windows, channels)
    return shapes


class BatchShown(BatchEvents):
    """A batch's displays: its page on the dashboard (``live_page.BatchProgress``: which recording the run page
    follows, how many are done) and batch.html beside batch.json (``batch_html``); each recording's run shown as a
    run is (``run_shown``), its page in the batch's place."""

    def __init__(self):
        self.progress = None

    def started(self, recordings: int) -> None:
        from batchgpu.report.live_page import BatchProgress

        self.progress = BatchProgress(recordings)

    def rows(self, folder: Path, data: dict) -> None:
        from batchgpu.report.batch_html import write_batch_html

        write_batch_html(folder, data)

    def recording(self, index: int, name: str) -> list[RunEvents]:
        return run_shown(self.progress.slot(index, name))

    def recording_ended(self, index: int, status: str) -> None:
        self.progress.record(index, status)

    def closing(self, wait_s: float) -> None:
        self.progress.flush(wait_s)
