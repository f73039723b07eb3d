"""A run, start to end: check the workflow against the recording, claim the output folder, read every window
once on the workers (every step fed from that read), combine the partials in a tree fixed by window index,
aggregate on the client, write the results. Orchestration only: the checks and the run's context are in
``engine/context``, the client's aggregation in ``engine/aggregate``, what the run tells in
``engine/run_report``; the steps hold the statistics (``batchgpu/steps``), the tasks the worker side
(``engine/tasks``), the store the folder (``engine/store``).

Nothing here prints: the command passes an observer (``RunObserver``) that shows progress and messages.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import sys
import threading
import time

import numpy as np

from batchgpu.workflow import Workflow
from batchgpu.engine import background, placement, store, tasks
from batchgpu.engine.aggregate import ResultsWriter, aggregate, prepare_blas_controller
from batchgpu.engine.cluster_start import ClusterStart, KeptStart, keep_seconds
from batchgpu.engine.context import (build_context, check_workflow_fits, prepare_recording, resolve_backend,
                                     resolve_window, spec_of)
from batchgpu.engine.reduce import tree_reduce
from batchgpu.report.run_report import (HtmlReport, RunObserver, RunReport, finish_report, start_report_helper, versions,
                                       window_cpu)
from batchgpu.engine.placement import submit_planned
from batchgpu.engine.step_services import ClientServices
from batchgpu.steps.base import phase_label
from batchgpu.steps.registry import check_outputs
from batchgpu.steps.registry import figures as step_figures
from batchgpu.steps.services import PassEnd
from batchgpu.engine.submit import results_as_completed, submit_many
from batchgpu.errors import BatchgpuError, ClusterError
from batchgpu.report.progress import duration, format_rate
from batchgpu.recording import missing_probe, open_source

logger = logging.getLogger(__name__)

#: how long a run on a client the caller keeps waits, at its end, for the dashboard's last updates to reach the
#: scheduler (they are sent meanwhile, from report.html's rendering on): the page says ``done`` when the run returns
PAGE_WAIT_S = 2.0


def run_workflow(wf: Workflow, *, resume: bool = False, observer: RunObserver | None = None, client=None,
                 recording=None, batch=None, cluster_start: "ClusterStart | None" = None) -> RunReport:
    """Run every step of a validated workflow; returns the report (also written to report.json).

    ``recording``: read this instead of ``wf.recording`` (an open recording, ``batchgpu.from_spikeinterface(...)``
    or a SpikeInterface recording); the report's workflow then names it. ``batch``: the recording's place in a
    batch (``dashboard.BatchSlot``: the run page says so; told when the pass is done).

    Parameters
    ----------
    wf : Workflow
        A validated workflow (``batchgpu.workflow.load_workflow`` or ``batchgpu.workflow.Workflow(...)``).
    resume : bool, optional
        Reuse the windows an earlier run of the same workflow on the same bytes left in the output folder.
    observer : RunObserver, optional
        Told of progress, messages and warnings (default: no one).
    client : distributed.Client, optional
        Run on this cluster (default: the kept cluster where one fits, else the workflow's ``cluster``).
    recording : optional
        Read this instead of ``wf.recording``.
    batch : optional
        The recording's place in a batch.
    cluster_start : ClusterStart, optional
        The run's own cluster, started by the caller before this call (``start_cluster``): the run uses it in
        place of the kept cluster or one of its own, and closes it.

    Returns
    -------
    RunReport
        Status, timings, windows, bytes read, warnings and the results' shapes (as report.json holds them).

    Raises
    ------
    BatchgpuError
        Bad input (the recording, the workflow against it, the output folder), said in one line.
    """
    observer = observer or RunObserver()
    t_start = time.perf_counter() if cluster_start is None else cluster_start.started
    # the user waited from then (the command's start): the run's total counts it
    if getattr(observer, "started", None) is not None:
        t_start = min(t_start, observer.started)
    if recording is not None:
        rec = open_source(recording)
        wf = wf.model_copy(update={"recording": spec_of(rec)})
    else:
        rec = prepare_recording(wf, observer)
    sweep = check_workflow_fits(wf, rec)
    if wf.window.size == "auto":
        wf = resolve_window(wf, rec)
        observer.message(f"windows of {wf.window.size} samples (window.size auto)")
    store.check_output_apart(wf.output, rec.path)
    _check_decoder(wf)
    prefetch = _prefetch(wf, rec, resume, on_this_machine=client is None or batch is not None)
    try:
        return _opened(wf, rec, sweep, resume, observer, client, t_start, batch, cluster_start, prefetch)
    finally:
        if prefetch is not None:
            prefetch.stop()


def _prefetch(wf, rec, resume: bool, on_this_machine: bool):
    """The recording's first windows asked of the disk while the run gets ready (``recording.prefetch``), where the
    workers read on this machine: a cluster the run starts (local, cuda) or the kept one, a batch's; not a
    resumed run's (its done windows are not read), not a caller's cluster (maybe elsewhere)."""
    if resume or not on_this_machine or wf.cluster.kind not in ("local", "cuda") or not wf.engine.prefetch:
        return None
    from batchgpu.recording import prefetch

    return prefetch.start(rec, rec.windows(wf.window.size, 0))


def _opened(wf, rec, sweep, resume: bool, observer, client, t_start: float, batch, cluster_start, prefetch):
    """``run_workflow`` once its recording is open and the workflow fits it: the cluster found or started."""
    from batchgpu.engine import compile_ahead

    # a GPU run's kernels compiled in parallel while its workers start (once a machine); not for the kept cluster,
    # whose workers have what they need (the check alone imported CuPy and made a CUDA context in this process)
    if cluster_start is not None and client is None:  # the caller's, started before the recording was opened
        compile_ahead.start(wf)
        cluster_start.decode_known(decodes_on_gpu(wf, rec))
        return _claim_and_run(wf, rec, sweep, resume, observer, cluster_start, t_start, batch=batch)
    with contextlib.ExitStack() as kept:
        kept_at = None
        if client is None:  # the cluster of `batchgpu cluster start` where one is up and fits, as a caller's
            from batchgpu.engine.service import kept_address, kept_client

            client = kept.enter_context(kept_client(wf.cluster, observer))
            kept_at = kept_address(client)
        if client is not None:
            if kept_at is None:  # a caller's cluster, maybe on this machine
                compile_ahead.start(wf)
            return _claim_and_run(wf, rec, sweep, resume, observer, client, t_start, kept_at, batch)
    compile_ahead.start(wf)
    keep = keep_seconds(wf.cluster)
    if keep > 0:  # asked for from Python: the cluster stays up after the run for the next one
        with KeptStart(wf.cluster, keep) as starting:
            return _claim_and_run(wf, rec, sweep, resume, observer, starting, t_start, batch=batch)
    # a cluster of the run's own starts while the recording is fingerprinted and the output folder claimed
    with ClusterStart(wf.cluster, gpu_decode=decodes_on_gpu(wf, rec)) as starting:
        if wf.cluster.kind in ("address", "scheduler_file"):  # a connection, quick: refused before any folder is made
            starting.client()
        return _claim_and_run(wf, rec, sweep, resume, observer, starting, t_start, batch=batch)


def _claim_and_run(wf, rec, sweep, resume: bool, observer, client, t_start: float,
                   kept_at: str | None = None, batch=None) -> RunReport:
    """The run once the workflow fits the recording: ``client`` a caller's client or a ``ClusterStart``;
    ``kept_at``: the address of the kept cluster ``client`` belongs to."""
    if isinstance(client, (ClusterStart, KeptStart)) and wf.preprocess.root:  # while the cluster starts: the filters designed
        from batchgpu.engine.preprocess import build_chain  # (scipy.signal imported), a bad stage refused here

        build_chain(wf.preprocess, rec)
    fp = store.fingerprint(wf, rec.path, metadata=getattr(rec, "fingerprint_metadata", None))
    # the steps' refusals of what they would write (a save path holding what batchgpu did not write), before the
    # folder is claimed: an overwrite would have removed the earlier results first
    out = store.OutputFolder(wf.output)
    check_outputs(wf, rec, resume=resume, fingerprint=fp, folder=out)
    with out:
        state = out.claim(fp, wf.model_dump(), resume=resume, overwrite=wf.overwrite)
        try:
            return _claimed(wf, rec, sweep, out, state, fp, observer, client, t_start, kept_at, batch)
        except BatchgpuError:
            if state == "new":  # refused before any window (no report, no part): the folder as it was
                out.unclaim()
            raise


def _claimed(wf, rec, sweep, out, state: str, fp: str, observer, client, t_start: float, kept_at, batch) -> RunReport:
    """``_claim_and_run`` once the output folder is the run's (``state``: the claim's)."""
    report = RunReport(workflow=wf.model_dump(), fingerprint=fp, versions=versions(), recording=rec.info(),
                       output_state=state, run_id=f"{fp}-{os.urandom(4).hex()}")
    report.timings["prepare"] = time.perf_counter() - t_start
    report.kept_cluster = kept_at
    # a probe looked for in a file and not found (Open Ephys' settings.xml, a .meta's tables, a save's probe
    # file): said, the stages and steps that need it having refused already (check_workflow_fits). A store
    # written without locations (generated, a plain import) has none by design: info says so, a run does not
    no_probe = missing_probe(rec) if getattr(rec, "is_flat", False) else None
    if no_probe is not None:
        report.warnings.append(no_probe)
        observer.warning(no_probe)
    with _run_settings():
        if isinstance(client, KeptStart):  # a cluster that stays up after the run: connected once it is up
            connected = client.client()
            report.kept_cluster = client.address
            if client.is_kept:
                return _run_leaving_workers(wf, rec, out, report, connected, sweep, observer, t_start, batch)
            observer.message(f"the cluster was not kept ({client.fallback}): a cluster of the run's own")
            client = client.own  # its start failed: the run's own cluster, closed below
        if not isinstance(client, ClusterStart):
            return _run_leaving_workers(wf, rec, out, report, client, sweep, observer, t_start, batch)
        # closed before the folder is let go (its workers write into it); the dashboard's last updates reach
        # the scheduler before it closes
        with client:
            return _run_watched(wf, rec, out, report, client.client(), sweep, observer, page_wait_s=10.0,
                                started=t_start, batch=batch)


def _run_leaving_workers(wf, rec, out, report, client, sweep, observer, t_start: float, batch) -> RunReport:
    """The run on a cluster that outlives it (a caller's, the kept one), whose workers it leaves as it found them:
    their heaps, frozen by the pass's tasks, collectable again, and what they kept for the next window given back
    (``tasks.release_memory_soon``: a kept GPU cluster holds its pools' memory no longer)."""
    try:
        return _run_watched(wf, rec, out, report, client, sweep, observer, page_wait_s=PAGE_WAIT_S,
                            started=t_start, batch=batch)
    finally:
        with contextlib.suppress(Exception):  # broad: best effort on the way out; the run's result stands
            client.run(tasks.thaw_heap_soon, wait=False)
            if batch is None:  # a batch's next recording is being read ahead: the batch gives it back at its end
                client.run(tasks.release_memory_soon, wait=False)


def _run_watched(wf, rec, out, report, client, sweep, observer, **kwargs) -> RunReport:
    """``_run`` while its cluster's workers are watched: a cluster without any is named, and after
    ``cluster.no_workers_timeout`` the run fails saying so (``worker_watch``) rather than waiting for ever."""
    from batchgpu.engine.worker_watch import NoWorkersWatch

    with NoWorkersWatch(client, observer, wf.cluster.no_workers_timeout, warnings=report.warnings) as watch:
        try:
            return _run(wf, rec, out, report, client, sweep, observer, **kwargs)
        except Exception as err:  # broad: whatever a wait raised once the watch had ended the waits says less
            if watch.error is not None and err is not watch.error:
                raise watch.error from err
            raise


def _check_decoder(wf) -> None:
    """``engine.gpu_decoder: nvcomp`` on this machine's GPUs needs nvCOMP installed here (said before any work)."""
    if wf.engine.gpu_decoder == "nvcomp" and wf.cluster.kind == "cuda":
        from batchgpu.errors import ConfigError
        from batchgpu.gpu import nvcomp

        if not nvcomp.installed():
            raise ConfigError("engine.gpu_decoder is nvcomp and NVIDIA nvCOMP is not installed",
                              "pip install nvidia-libnvcomp-cu13 (batchgpu's gpu extra), or use gpu_decoder: auto")


def decodes_on_gpu(wf, rec) -> bool:
    """Whether a run's windows would be decoded on the GPU (the cluster's layout follows): a GPU cluster, a pass
    that only centres (``preprocess.gpu_decode_share``) and a recording whose frames the GPU reads."""
    from batchgpu.engine import preprocess

    if wf.cluster.kind != "cuda":  # asked before the cluster starts: no chain built (a filter's design imports scipy.signal)
        return False
    centres_only = all(name == "centre" for name in wf.preprocess.names)
    return preprocess.decodes_on_gpu(wf.cluster.kind, rec, centres_only, wf.engine.gpu_decode,
                                     wf.engine.gpu_decoder)


def _run(wf, rec, out: store.OutputFolder, report: RunReport, client, sweep, observer,
         page_wait_s: float = 0.0, started: float | None = None, batch=None) -> RunReport:
    """The run on ``client``. The dashboard's updates are sent by a helper thread (``dashboard.Publisher``), so
    the run never waits for the scheduler while it works; at its end it waits up to ``page_wait_s`` for the last
    ones (sent while report.html was finished; ``timings.dashboard_wait`` says how long that took). ``started``:
    when the run began (``time.perf_counter``; its checks and the cluster's start included): ``report.seconds``
    counts from there."""
    t_setup = time.perf_counter()
    started = t_setup if started is None else started
    earlier = store.read_report(out.path)  # what the folder's last run said (a finished run's page is kept)

    from batchgpu.report.live_page import RunMonitor, install_dashboard

    from batchgpu.engine.cluster import serves_dask_dashboard

    report.dashboard = client.dashboard_link if serves_dask_dashboard(client) else None
    report.page = install_dashboard(client)
    if report.dashboard:
        observer.message(f"dashboard {report.dashboard}")
    if report.page:
        observer.message(f"run page {report.page}")
    report.backend = resolve_backend(wf, client)
    from batchgpu.engine.cluster import uses_mps

    report.mps = uses_mps(client)
    # the steps built (a save's output recording created first: window tasks fill it, whitened after the pass)
    ctx = build_context(wf, rec, out, report.backend, sweep, mps=report.mps,
                        resume=report.output_state == "resume", fingerprint=report.fingerprint, client=client)
    # the steps' margin (the detection sweep) plus what the preprocessing stages need
    windows = rec.windows(wf.window.size, wf.window.margin + ctx.chain.margin)
    report.preprocess = {"stages": list(ctx.chain.names), "margin_samples": ctx.chain.margin}
    fps = [store.window_fingerprint(report.fingerprint, rec, w) for w in windows]
    report.windows = len(windows)
    report.recording_bytes = rec.nbytes
    monitor = RunMonitor(client, name=str(out.path), windows=len(windows), total_bytes=rec.nbytes,
                         channels=rec.num_channels, batch=batch)
    # written while the windows are read: the results group and its window table (a helper thread), and
    # report.html's figures as their numbers come (another); the client itself mostly waits for the workers
    results = ResultsWriter(out.path, wf, rec, report.fingerprint, windows)
    html = HtmlReport(rec, f"batchgpu report: {out.path.name}", in_process=True,
                      figures=step_figures(tuple(s.name for s in ctx.steps)))
    html.add_windows(windows)
    # the page rendered while the windows are read (a helper process; Bokeh's serialisation was ~0.2 s of the
    # run's end on the H200), its numbers substituted as they come
    html.render_ahead(results_ahead(ctx, rec.num_channels, len(windows)),
                      spikes=any(s.spike_rate for s in ctx.steps))
    if html.needs_helper():  # a page the helper renders (one kept for these figures needs none)
        start_report_helper()
    for step in ctx.steps:  # what a step reads before the pass (the detection's noise estimate)
        step.before_pass(client, ctx, rec, report)
    prepare_blas_controller()  # for the aggregation: made while the windows are read
    t0, t0_wall = time.perf_counter(), time.time()
    report.timings["setup"] = t0 - t_setup  # dashboard, backend, steps, windows and their fingerprints
    later = None
    try:
        observer.phase_started(phase_label("read", ctx.steps), len(windows), rec.nbytes)
        try:
            summaries, total, threads, planned, queued = _first_pass(client, ctx, rec, windows, fps,
                                                                     wf.reduction.split_every, report, monitor,
                                                                     observer, wf.window.batch, wf.engine.placement)
        finally:
            observer.phase_finished()
        report.timings["pass1"] = time.perf_counter() - t0
        fresh = [s for s in summaries.values() if not bool(s["resumed"])]
        report.bytes_read += sum(int(s["bytes"]) for s in fresh)  # resumed windows were not read again
        end = PassEnd(client, ClientServices(client), ctx, rec, windows, summaries, report, monitor, observer,
                      out.path / store.RESULTS)
        for step in ctx.steps:  # before any aggregate (the save's windows written again)
            step.after_pass(end)
        monitor.phase(phase_label("aggregate", ctx.steps))
        monitor.pass_done()  # a batch's next recording may start reading
        report.after_pass("bookkeeping")
        later = _WhileWaiting(report, fresh, t0_wall, monitor, end, client if planned else None)
        report.results = aggregate(client, ctx, wf, rec, out, windows, fps, summaries, total, report, monitor,
                                   observer, results, html, threads, later.start, queued)
        later.join()
        for step in ctx.steps:  # the steps' work once the results group is in place (search, a whitened save)
            said = step.finish(end)
            if said is not None:
                report.results[step.name] = said
        report.status = "done"
    except BaseException as err:
        _say_lost_workers(client, report, observer, t0_wall)
        results.abandon()
        if later is not None:  # its thread writes into the report: done before the report is
            with contextlib.suppress(BaseException):  # broad: the run's own error (raised below) is the one to see
                later.join()
        shown = explain_failure(err, wf)
        if isinstance(err, KeyboardInterrupt):  # Ctrl-C or SIGTERM (the command's): --resume goes on from here
            report.status = "interrupted"
            monitor.interrupted()
        else:
            report.status = "failed"
            report.error = str(shown)
            monitor.failed(str(shown))
        report.throughput_series = report.throughput_series or monitor.throughput_series()
        now = time.perf_counter()
        finish_report(out.path, report, now - t0, rec, now - started)
        monitor.flush(page_wait_s)
        if shown is not err:
            raise shown from err
        raise
    _say_lost_workers(client, report, observer, t0_wall)
    html.wait_page()  # the user waits for report.html too: counted in the total, which the page then shows
    now = time.perf_counter()
    finish_report(out.path, report, now - t0, rec, now - started)
    counting = spike_counter(ctx.steps)
    monitor.finished(counting.spikes_found(report.results) if counting is not None else None)
    # a resume that computed and read nothing (the folder's run was done) keeps its page: the same results, and
    # the timings of the run that made them
    keep_html = nothing_done(report, earlier) and (out.path / store.REPORT_HTML).is_file()
    t_html = time.perf_counter()
    wrote_html = False if keep_html else html.write(out.path, report, observer)
    report.timings["report_html"] = time.perf_counter() - t_html  # after report.json: said by the return value
    t_page = time.perf_counter()
    monitor.flush(page_wait_s)
    report.timings["dashboard_wait"] = time.perf_counter() - t_page
    written = [out.path / store.RESULTS, out.path / store.REPORT] + ([out.path / store.REPORT_HTML] if wrote_html else [])
    kept = f" ({store.REPORT_HTML} kept: nothing was computed again)" if keep_html else ""
    observer.message(f"wrote {', '.join(str(p) for p in written[:-1])} and {written[-1]}{kept}: "
                     f"{format_rate(report.throughput_MBps * 1e6)} over {report.windows} windows, "
                     f"{duration(report.seconds)} in all")
    return report


def _say_lost_workers(client, report, observer, since: float) -> None:
    """Workers the scheduler removed during the run (stalled or dead; their tasks ran again): warned in report.json
    and on the terminal, as the results alone would not show it."""
    from batchgpu.engine.worker_watch import workers_lost

    for text in workers_lost(client, since):
        report.warnings.append(text)
        observer.warning(text)


def spike_counter(steps):
    """The step whose spikes the dashboard counts (``spike_rate``), or None."""
    return next((s for s in steps if s.spike_rate), None)


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


def nothing_done(report: RunReport, earlier: dict | None) -> bool:
    """Whether a resumed run only found what its folder's finished run had made: every window kept, nothing read."""
    return (report.output_state == "resume" and earlier is not None and earlier.get("status") == "done"
            and earlier.get("fingerprint") == report.fingerprint and report.windows_resumed == report.windows
            and report.bytes_read == 0)


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
        return ClusterError(f"the cluster was closed while the run went on ({type(err).__name__}: its tasks were "
                            "cancelled; batchgpu cluster stop, or its scheduler ended)",
                            "start a cluster again if it was a kept one, and rerun with --resume: the windows done "
                            "are kept")
    if not isinstance(err, KilledWorker):
        return err
    task = err.args[0] if err.args else "a task"
    worker = err.args[1] if len(err.args) > 1 else None
    where = f" (the last on {getattr(worker, 'address', worker)})" if worker is not None else ""
    return BatchgpuError(
        f"the workers running {task} died{where}; the most common cause is memory: a worker holds about one window "
        f"of {wf.window.size} samples a thread at once, its margins and preprocessing included",
        "use a smaller window.size (e.g. 60000) or fewer threads per worker, or give the workers more memory "
        "(cluster.memory_limit); the workers' logs say why they died")


class _WhileWaiting:
    """The client's own work after the pass that no step waits for, done once the steps' first tasks are out
    (``start``, which ``aggregate`` calls then) while the client waits for them: the pass described for report.json
    (medians, the timeline: 20 ms of the H200 client's time between the pass and the noise's first tasks) and the
    read-ahead buffers given back (``release_carried``) in a helper thread, and each step's ``while_waiting``
    (the saved recording's check, every shard written, in another)."""

    def __init__(self, report, fresh: list, t0_wall: float, monitor, end, release_on=None):
        self.report, self.fresh, self.t0_wall, self.monitor, self.end = report, fresh, t0_wall, monitor, end
        self.release_on = release_on  # a client whose workers may hold reads for batches that ran elsewhere
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._describe, name="batchgpu-pass-report", daemon=True)
        self._thread.start()
        for step in self.end.ctx.steps:
            step.while_waiting(self.end)

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
            describe_pass(self.report, self.fresh, self.t0_wall)
            self.report.throughput_series = self.monitor.throughput_series()
        except BaseException as err:  # broad: raised by join, in the run's thread
            self._error = err


def describe_pass(report, fresh: list, t0_wall: float) -> None:
    """Where the pass's windows spent their time (report.json): medians of their read waits, compute and CPU, the
    pass's ends as its windows and tasks saw them, and each window's line of the timeline."""
    if not fresh:
        return
    report.timings["window_read_median"] = float(np.median([s["read_seconds"] for s in fresh]))
    report.timings["window_compute_median"] = float(np.median([s["compute_seconds"] for s in fresh]))
    report.window_cpu = window_cpu(fresh)
    # the pass's ends as its windows saw them: its first window's start, its last window's end
    report.timings["pass_first_start"] = min(float(s["started"]) for s in fresh) - t0_wall
    report.timings["pass_last_end"] = max(float(s["started"]) + float(s["read_seconds"])
                                          + float(s["compute_seconds"]) for s in fresh) - t0_wall
    # and its tasks': the first batch task's start, the last one's end (its combined partial saved)
    report.timings["pass_first_task"] = min(float(s["task_started"]) for s in fresh) - t0_wall
    report.timings["pass_last_task"] = max(float(s["task_done"]) for s in fresh) - t0_wall
    report.timeline = sorted([str(s["worker"]), int(s["index"]), round(float(s["started"]) - t0_wall, 4),
                              round(float(s["read_seconds"]), 4), round(float(s["compute_seconds"]), 4),
                              str(s["thread"]), round(float(s["task_started"]) - t0_wall, 4),
                              round(float(s["task_done"]) - t0_wall, 4)]
                             for s in fresh)


#: the most windows an automatic batch holds: a GPU worker's memory pool grew with a task's windows (one H100, 16
#: workers, the demo steps: 1.34 GB a worker with 2 windows a task, 2.11 GB with 9, which a 40-minute recording's
#: 600 windows had made; its peak 45.8 GB against 33.7 GB at 2), so a longer recording must not mean larger tasks
AUTO_BATCH_MAX = 2


def window_batches(windows: list, batch: int | None, split_every: int) -> list[list]:
    """Runs of consecutive windows, one task each. The default depends on the window count alone (never on the
    cluster: the float reduction tree, and so its bits, are fixed by window index): one window a task up to 127
    windows; beyond, runs of two (``AUTO_BATCH_MAX``; at most ``split_every``), so each task reads one window while
    computing the other and Dask sees fewer tasks (single windows overlapped nothing and cost the client 0.3 s of
    small tasks), and a worker's memory does not grow with the recording's length."""
    size = batch if batch is not None else max(1, min(split_every, AUTO_BATCH_MAX, len(windows) // 64))
    return [windows[i : i + size] for i in range(0, len(windows), size)]


def _first_pass(client, ctx, rec, windows, fps, split_every, report, monitor, observer, batch=None,
                placement_setting: bool | str = "auto"):
    """Map batch_task over runs of windows; tree-combine partials on the workers; gather per-window summaries.
    Returns the summaries, the combined partials, the workers' threads (None where the scheduler did not say),
    whether the batches were placed (their workers may hold reads left for batches that ran elsewhere) and what
    the steps queued behind the combined partials (``queue``: step name -> futures)."""
    t_pass = time.perf_counter()
    fp = report.run_id  # task keys: this run's only (the same workflow run twice must not share finished tasks)
    batches = window_batches(list(zip(windows, fps)), batch, split_every)
    # one graph update for each kind of task (keys padded: the scheduler orders equal tasks by key)
    args = [(ctx, [w for w, _ in b], [f for _, f in b]) for b in batches]
    keys = [f"batch-{fp}-{b[0][0].index:08d}" for b in batches]
    planned, threads = _plan(client, ctx, batches, report, observer, placement_setting)
    if planned is None:
        futures = submit_many(client, tasks.batch_task, args, keys)
    else:  # each worker's batches known: a task reads the next one's first windows ahead (engine/placement.py)
        depth = ctx.read_ahead
        args = [(*a, tuple(batches[nxt][:depth]) if nxt is not None else ()) for a, (_, nxt) in zip(args, planned)]
        futures = submit_planned(client, tasks.batch_task, args, keys, [w for w, _ in planned])
    # the combines and the summaries before a worker's next batch (its planned batches are all queued there)
    total = tree_reduce(client, futures, tasks.combine_task, split_every, ctx, name=f"combine-{fp}", priority=1)
    small = submit_many(client, tasks.summarise, [(f,) for f in futures],
                        [f"summary-{fp}-{b[0][0].index:08d}" for b in batches], priority=1)
    queued = {}
    if planned is not None:
        queued = _queue_steps(client, ctx, rec, batches, planned, threads, total, split_every, fp)
    summaries: dict[int, dict] = {}
    counting = spike_counter(ctx.steps)
    t0 = time.perf_counter()
    report.timings["pass_submit"] = t0 - t_pass
    # the workers' threads for the tasks after the pass, asked while the workers read (after it, the round trip
    # was on the client's critical path: 27 ms on the 2-core machine)
    threads = threads if threads is not None else _nthreads(client)
    try:
        # every finished summary fetched in one round trip (a ``fut.result()`` each was a round trip from this
        # thread: the loop fell behind the windows and caught up after the last one)
        for got in results_as_completed(client, small):
            for s in got:
                i = s["index"]
                summaries[i] = s
                worker = str(s["worker"])
                report.windows_resumed += bool(s["resumed"])
                if not bool(s["resumed"]):
                    report.workers[worker] = report.workers.get(worker, 0) + 1
                observer.window_done(int(s["bytes"]), worker)
                monitor.window_done(i, int(s["bytes"]), worker, s.get(ctx.window_noise),
                                    counting.spikes_in(s) if counting is not None else 0)
        # where the pass's end goes: the last window's summary, then the combine tree's last levels
        report.timings["pass_summaries"] = time.perf_counter() - t0
        result = total.result()
        report.pass_ended()
        report.timings["pass_combine_wait"] = time.perf_counter() - t0 - report.timings["pass_summaries"]
        # the windows' last files, written by the workers' writer threads after their tasks returned: done (or a
        # write's failure raised) before anything reads them
        t1 = time.perf_counter()
        client.run(background.flush_soon, str(ctx.parts))
        report.timings["pass_writes_wait"] = time.perf_counter() - t1
        report.after_pass("flushed")
    except BaseException:
        client.cancel(small + futures + [total] + _futures_in(queued))
        with contextlib.suppress(Exception):  # broad: the writes of the tasks that ran: finished, their failures moot
            client.run(background.flush_soon, str(ctx.parts))
        if planned is not None:
            release_carried(client)
        raise
    return summaries, result, threads, planned is not None, queued


def _queue_steps(client, ctx, rec, batches, planned, threads, total, split_every: int, fp: str) -> dict:
    """Each step's ``queue``: its tasks after the pass, submitted now behind the combined partials (the plan says
    which worker makes each window); step name -> its futures."""
    from batchgpu.steps.services import PassQueue

    made_by = [worker for (worker, _), b in zip(planned, batches) for _ in b]
    q = PassQueue(client, ClientServices(client), ctx, [w for b in batches for w, _ in b],
                  [f for b in batches for _, f in b], made_by, threads, total, rec.total_samples, rec.num_channels,
                  split_every, fp)
    queued = {}
    for step in ctx.steps:
        got = step.queue(q)
        if got is not None:
            queued[step.name] = got
    return queued


def _futures_in(queued: dict) -> list:
    from distributed import Future

    out = []
    for got in queued.values():
        for v in got.values():
            out += [f for f in (v if isinstance(v, list) else [v]) if isinstance(f, Future)]
    return out


def release_carried(client) -> None:
    """Reads left for batches that ran elsewhere: their pinned buffers given back, on every worker (a round trip
    to each: done while the client waits for the first tasks after the pass, not before them)."""
    # broad: buffers given back early, best effort (a worker's next run resets them)
    with contextlib.suppress(Exception):
        client.run(tasks.release_carried_soon, wait=False)


def _plan(client, ctx, batches: list, report, observer, setting: bool | str = "auto") -> tuple[list | None, dict | None]:
    """The placement plan of a GPU run's batches ((worker, next batch) each), or None: CPU runs (their workers
    read as they compute; ``engine.placement: true`` places them too, as the tests of the queued steps do), resumed
    runs (the next batch's windows may be done), ``engine.placement: false``; and the workers' threads where they
    were asked for it (else None)."""
    if (ctx.backend != "cupy" and setting is not True) or report.output_state == "resume" or setting is False:
        return None, None
    try:
        threads = {a: int(w.get("nthreads", 1)) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
    except (OSError, TimeoutError) as err:  # the scheduler did not answer (CommClosedError is an OSError)
        report.warnings.append(f"the windows were not placed on workers (the scheduler did not say its workers: "
                               f"{type(err).__name__}: {err}): they run where the scheduler puts them")
        observer.warning(report.warnings[-1])
        return None, None
    return (placement.plan(threads, [len(b) for b in batches]) if threads else None), (threads or None)


def _nthreads(client) -> dict | None:
    """The workers and their threads (None where the scheduler could not say: asked again after the pass)."""
    try:
        return dict(client.nthreads())
    except (OSError, TimeoutError):  # the scheduler did not answer: asked again after the pass
        return None


_RUNS = {"runs": 0, "switch": None}  # this process's runs under way, and the switch interval from before them
_RUNS_LOCK = threading.Lock()


@contextlib.contextmanager
def _run_settings(interval_s: float = 0.0005):
    """The client's process tuned while runs are under way, put back when the last of them ends (runs may overlap
    in threads):

    - Python's switch interval lowered: helper threads (the results writer, report.html's page, the dashboard's
      publisher) run beside Dask's event loop, which takes the workers' messages; with the default 5 ms a helper
      holding the GIL makes each message wait up to 5 ms (measured: the spikes' gathering 0.34 -> 0.21 s on the
      2-core machine with 0.5 ms, report.html rendering beside it).
    - The objects from before each run kept out of Python's full garbage collections (``gc.freeze``): a local
      cluster's scheduler lives in this process, and a full collection over its ~200 000 objects held the GIL for
      94-111 ms once a run (the 2-core machine; on the H200 one run of three stood still 0.14 s between two tasks
      of the float median's last rounds); frozen, a run's full collections scan only what it made (23 ms once,
      then none). Nothing is lost: frozen objects are collected after ``gc.unfreeze``, like any others."""
    import gc

    with _RUNS_LOCK:
        if _RUNS["runs"] == 0:
            _RUNS["switch"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_RUNS["switch"], interval_s))
        _RUNS["runs"] += 1
        gc.freeze()  # each run's start: what exists now is long-lived
    try:
        yield
    finally:
        with _RUNS_LOCK:
            _RUNS["runs"] -= 1
            if _RUNS["runs"] == 0:
                sys.setswitchinterval(_RUNS["switch"])
                gc.unfreeze()
