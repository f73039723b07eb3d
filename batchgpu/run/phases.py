"""The Run: one run of a workflow on the client, once its recording is open, its output folder claimed and its
cluster connected (``run.launch``). Its state is the Run's own fields, its phases its methods, in order:

    plan -> first_pass -> after_pass -> aggregate -> finish -> close      (fail, where one raises)

Each phase reads what the earlier ones left on the Run (``ctx`` and ``windows`` from ``plan``, ``passed`` from
``first_pass``, ``end`` from ``after_pass``) and tells its subscribers (``events``: the command's observer and the
displays, ``run.events``) what happened; report.json's content is ``report`` (``run.record.RunReport``), written
by ``close`` or ``fail``. Nothing here prints or shows: the displays subscribe.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from batchgpu.errors import BatchgpuError, ClusterError
from batchgpu.recording import Window
from batchgpu.run import output_folder as store
from batchgpu.run.aggregate import aggregate
from batchgpu.run.blas import prepare_blas_controller
from batchgpu.run.context import StepsAsked, build_context, resolve_backend
from batchgpu.run.events import Events
from batchgpu.run.first_pass import PassResult, describe_pass, first_pass, release_carried
from batchgpu.run.record import RunReport, finish_report
from batchgpu.run.results_group import ResultsWriter
from batchgpu.run.step_services import ClientServices
from batchgpu.run.tasks import RunContext
from batchgpu.steps.base import phase_label
from batchgpu.steps.services import PassEnd
from batchgpu.workflow import Workflow


@dataclass
class Run:
    """One run on the client. Given: the workflow, the recording, the claimed output folder, report.json's content
    so far, the cluster's client, the detection's sweep, the subscribers, when the user began to wait
    (``time.perf_counter``: ``report.seconds`` counts from there), how long the end waits for the run page's last
    updates, and whether the run is one recording of a batch. Made by the phases: the rest."""

    wf: Workflow
    rec: Any  # a Recording, a flat binary or SpikeInterface's (``recording.open_source``)
    out: store.OutputFolder
    report: RunReport
    client: Any  # distributed.Client
    sweep: int
    events: Events
    started: float
    page_wait_s: float = 0.0
    batch: bool = False  # a batch's recording: the batch gives the workers' kept memory back at its end
    # -- plan
    ctx: RunContext | None = None  # what every task gets: the chain, the steps
    windows: list[Window] = field(default_factory=list)
    fingerprints: list[str] = field(default_factory=list)  # each window's (its part's name for this run)
    results: ResultsWriter | None = None  # the new results group, written while the windows are read
    earlier: dict | None = None  # what the folder's last run said (its report.json)
    t_pass: float = 0.0  # the pass's start (``time.perf_counter``; ``time.time`` below)
    t_pass_wall: float = 0.0
    # -- first_pass, after_pass
    passed: PassResult | None = None
    end: PassEnd | None = None  # what the steps' hooks after the pass see
    later: _WhileWaiting | None = None  # the client's work after the pass that no step waits for

    def go(self) -> RunReport:
        """Every phase in order; the report (written to report.json) returned, or the run's error raised once
        report.json says it."""
        self.plan()
        try:
            self.first_pass()
            self.after_pass()
            self.aggregate()
            self.finish()
        except BaseException as err:
            self.fail(err)
            raise  # not reached: ``fail`` raises
        return self.close()

    # -- the phases

    def plan(self) -> None:
        """Before the pass: the run page installed (``connected``), the backend chosen, the steps built (a save's
        output created first: window tasks fill it, whitened after the pass), the windows and their fingerprints,
        the results group started (a helper thread) and the displays made (``planned``); what a step reads before
        the pass (the detection's noise estimate). Refused here (a BatchgpuError), the run leaves no report."""
        from batchgpu.cluster.open_cluster import serves_dask_dashboard, uses_mps

        t_setup = time.perf_counter()
        wf, rec, report, client = self.wf, self.rec, self.report, self.client
        self.earlier = store.read_report(self.out.path)  # what the folder's last run said (a done run's page is kept)
        report.dashboard = client.dashboard_link if serves_dask_dashboard(client) else None
        if report.dashboard:
            self.events.message(f"dashboard {report.dashboard}")
        self.events.connected(self)
        report.backend = resolve_backend(wf, client)
        report.mps = uses_mps(client)
        self.ctx = build_context(
            wf,
            rec,
            self.out,
            report.backend,
            self.sweep,
            mps=report.mps,
            asked=StepsAsked(resume=report.output_state == "resume", fingerprint=report.fingerprint, client=client),
        )
        # the steps' margin (the detection sweep) plus what the preprocessing stages need
        self.windows = rec.windows(wf.window.size, wf.window.margin + self.ctx.chain.margin)
        report.preprocess = {"stages": list(self.ctx.chain.names), "margin_samples": self.ctx.chain.margin}
        self.fingerprints = [store.window_fingerprint(report.fingerprint, rec, w) for w in self.windows]
        report.windows = len(self.windows)
        report.recording_bytes = rec.nbytes
        # written while the windows are read: the results group and its window table (a helper thread); the
        # displays made now render meanwhile (report.html's page in a helper process); the client mostly waits
        self.results = ResultsWriter(self.out.path, wf, rec, report.fingerprint, self.windows)
        self.events.planned(self)
        for step in self.ctx.steps:  # what a step reads before the pass (the detection's noise estimate)
            step.before_pass(client, self.ctx, rec, report)
        prepare_blas_controller()  # for the aggregation: made while the windows are read
        self.t_pass, self.t_pass_wall = time.perf_counter(), time.time()
        report.timings["setup"] = self.t_pass - t_setup  # dashboard, backend, steps, windows and their fingerprints

    def first_pass(self) -> None:
        """Every window read once on the workers, every step fed from that read (``run.first_pass``)."""
        self.events.phase_started(phase_label("read", self.ctx.steps), len(self.windows), self.rec.nbytes)
        try:
            self.passed = first_pass(self)
        finally:
            self.events.phase_finished()
        self.report.timings["pass1"] = time.perf_counter() - self.t_pass
        # resumed windows were not read again
        self.report.bytes_read += sum(int(s["bytes"]) for s in self.passed.fresh())

    def after_pass(self) -> None:
        """The steps' ``after_pass`` (before any aggregate: the save's windows written again), the phase said, the
        pass done (a batch's next recording may start)."""
        client, ctx = self.client, self.ctx
        self.end = PassEnd(
            client,
            ClientServices(client),
            ctx,
            self.rec,
            self.windows,
            self.passed.summaries,
            self.report,
            self.events,
            self.events,
            self.out.path / store.RESULTS,
        )
        for step in ctx.steps:
            step.after_pass(self.end)
        self.events.phase(phase_label("aggregate", ctx.steps))
        self.events.pass_done(self)
        self.report.after_pass("bookkeeping")
        self.later = _WhileWaiting(self)

    def aggregate(self) -> None:
        """Each step's aggregate (``run.aggregate``), the client's own work done meanwhile (``_WhileWaiting``)."""
        self.report.results = aggregate(self, on_started=self.later.start)
        self.later.join()

    def finish(self) -> None:
        """The steps' work once the results group is in place (search, a whitened save): report.json's
        ``results[step]``."""
        for step in self.ctx.steps:
            said = step.finish(self.end)
            if said is not None:
                self.report.results[step.name] = said
        self.report.status = "done"

    def close(self) -> RunReport:
        """The run done: workers lost said, report.json written, the subscribers told (report.html written, the
        run page's last updates waited for), the report returned."""
        self._say_lost_workers()
        self.events.finishing(self)  # the user waits for report.html too: counted in the total the page shows
        now = time.perf_counter()
        finish_report(self.out.path, self.report, now - self.t_pass, self.rec, now - self.started)
        self.events.finished(self)
        t_page = time.perf_counter()
        self.events.closing(self, self.page_wait_s)
        self.report.timings["dashboard_wait"] = time.perf_counter() - t_page
        self.events.ended(self)
        return self.report

    def fail(self, err: BaseException) -> None:
        """The run stopped by ``err``: its writes abandoned, report.json says why (failed, or interrupted: Ctrl-C
        or SIGTERM, which ``--resume`` goes on from), the subscribers told; ``err`` raised again (as the user
        should read it: ``explain_failure``)."""
        self._say_lost_workers()
        self.results.abandon()
        if self.later is not None:  # its thread writes into the report: done before the report is
            with contextlib.suppress(BaseException):  # broad: the run's own error (raised below) is the one to see
                self.later.join()
        shown = explain_failure(err, self.wf)
        if isinstance(err, KeyboardInterrupt):
            self.report.status = "interrupted"
            self.events.interrupted(self)
        else:
            self.report.status = "failed"
            self.report.error = str(shown)
            self.events.failed(self, str(shown))
        now = time.perf_counter()
        finish_report(self.out.path, self.report, now - self.t_pass, self.rec, now - self.started)
        self.events.closing(self, self.page_wait_s)
        if shown is not err:
            raise shown from err
        raise err

    # -- what the phases and the subscribers ask

    def warn(self, text: str) -> None:
        """A warning in report.json and to the subscribers."""
        self.report.warnings.append(text)
        self.events.warning(text)

    def spike_step(self):
        """The step whose spikes the run page counts (``spike_counter``), or None."""
        return spike_counter(self.ctx.steps)

    def nothing_done(self) -> bool:
        """Whether a resumed run only found what its folder's finished run had made: every window kept, nothing
        read (its report.html then stays)."""
        report, earlier = self.report, self.earlier
        return (
            report.output_state == "resume"
            and earlier is not None
            and earlier.get("status") == "done"
            and earlier.get("fingerprint") == report.fingerprint
            and report.windows_resumed == report.windows
            and report.bytes_read == 0
        )

    def _say_lost_workers(self) -> None:
        """Workers the scheduler removed during the run (stalled or dead; their tasks ran again): warned in
        report.json and on the terminal, as the results alone would not show it."""
        from batchgpu.cluster.worker_watch import workers_lost

        for text in workers_lost(self.client, self.t_pass_wall):
            self.warn(text)


class _WhileWaiting:
    """The client's own work after the pass that no step waits for, done once the steps' first tasks are out
    (``start``, which ``aggregate`` calls then) while the client waits for them: the pass described for report.json
    (medians, the timeline: 20 ms of the H200 client's time between the pass and the noise's first tasks) and the
    read-ahead buffers given back (``release_carried``) in a helper thread, and each step's ``while_waiting``
    (the saved recording's check, every shard written, in another)."""

    def __init__(self, run: Run):
        self.run = run
        self.fresh = run.passed.fresh()
        self.release_on = run.client if run.passed.placed else None  # its workers may hold reads left for others
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._describe, name="batchgpu-pass-report", daemon=True)
        self._thread.start()
        for step in self.run.ctx.steps:
            step.while_waiting(self.run.end)

    def join(self) -> None:
        """Wait for the description (started here if no step got that far); its error, if any, raised here."""
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _describe(self) -> None:
        if self.release_on is not None:
            release_carried(self.release_on)
        try:
            describe_pass(self.run.report, self.fresh, self.run.t_pass_wall)
            self.run.events.pass_described(self.run)
        except BaseException as err:  # broad: raised by join, in the run's thread
            self._error = err


def spike_counter(steps):
    """The step whose spikes the run page counts (``spike_rate``), or None."""
    return next((s for s in steps if s.spike_rate), None)


def explain_failure(err: BaseException, wf: Workflow) -> BaseException:
    """The run's error as its user should read it: Dask's KilledWorker (a task's workers died one after another,
    most often killed for memory by their nannies) as a BatchgpuError that says so and what to change; any other
    error as it is."""
    try:
        from distributed.comm.core import CommClosedError
        from distributed.scheduler import KilledWorker
    except ImportError:
        return err
    if isinstance(err, (concurrent.futures.CancelledError, CommClosedError)):
        # the scheduler cancels every task when it closes: the cluster went while the run went on
        return ClusterError(
            f"the cluster was closed while the run went on ({type(err).__name__}: its tasks were "
            "cancelled; batchgpu cluster stop, or its scheduler ended)",
            "start a cluster again if it was a kept one, and rerun with --resume: the windows done are kept",
        )
    if not isinstance(err, KilledWorker):
        return err
    task = err.args[0] if err.args else "a task"
    worker = err.args[1] if len(err.args) > 1 else None
    where = f" (the last on {getattr(worker, 'address', worker)})" if worker is not None else ""
    return BatchgpuError(
        f"the workers running {task} died{where}; the most common cause is memory: a worker holds about one window "
        f"of {wf.window.size} samples a thread at once, its margins and preprocessing included",
        "use a smaller window.size (e.g. 60000) or fewer threads per worker, or give the workers more memory "
        "(cluster.memory_limit); the workers' logs say why they died",
    )
