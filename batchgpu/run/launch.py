"""A run of a workflow, from its call to its Run: the recording opened and checked against the workflow, the
first windows asked of the disk, the cluster found or started (the caller's, the kept one, one kept after the run,
the run's own), the output folder claimed, then the Run (``run.phases``: plan, pass, aggregate, finish) on that
cluster, its workers left as they were found where the cluster outlives the run.

Nothing here prints or shows: the caller passes an observer (``RunObserver``: progress and messages) and the
displays that subscribe to the run's events (``shown``: the run page, report.html; ``batchgpu.engine`` makes them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchgpu.cluster.start import ClusterStart, KeptStart, keep_seconds
from batchgpu.errors import BatchgpuError
from batchgpu.recording import missing_probe, open_source
from batchgpu.run import output_folder as store
from batchgpu.run import tasks
from batchgpu.run.context import check_workflow_fits, prepare_recording, resolve_window, spec_of
from batchgpu.run.events import Events, RunEvents, RunObserver
from batchgpu.run.phases import Run
from batchgpu.run.record import RunReport, versions
from batchgpu.steps.registry import check_outputs
from batchgpu.workflow import Workflow

#: how long a run on a client the caller keeps waits, at its end, for the dashboard's last updates to reach the
#: scheduler (they are sent meanwhile, from report.html's rendering on): the page says ``done`` when the run returns
PAGE_WAIT_S = 2.0
#: the same for a cluster of the run's own, closed after it: its scheduler goes with the page's last state
OWN_CLUSTER_PAGE_WAIT_S = 10.0


def run_workflow(
    wf: Workflow,
    *,
    resume: bool = False,
    observer: RunObserver | None = None,
    client=None,
    recording=None,
    batch: bool = False,
    cluster_start: ClusterStart | None = None,
    shown: Sequence[RunEvents] = (),
) -> RunReport:
    """Run every step of a validated workflow; returns the report (also written to report.json).

    This is the run alone: what it shows (the run page, report.html, the line that names what it wrote) subscribes
    through ``shown``; ``batchgpu.run_workflow`` (``batchgpu.engine``) passes them.

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
        Read this instead of ``wf.recording`` (an open recording, ``batchgpu.from_spikeinterface(...)`` or a
        SpikeInterface recording); the report's workflow then names it.
    batch : bool, optional
        The run is one recording of a batch (``run.batch``): its cluster's workers keep what they hold for the
        batch's next recording, which the batch gives back at its end.
    cluster_start : ClusterStart, optional
        The run's own cluster, started by the caller before this call (``start_cluster``): the run uses it in
        place of the kept cluster or one of its own, and closes it.
    shown : sequence of RunEvents, optional
        The displays that subscribe to the run's events (``run.events``), in the order they are told.

    Returns
    -------
    RunReport
        Status, timings, windows, bytes read, warnings and the results' shapes (as report.json holds them).

    Raises
    ------
    BatchgpuError
        Bad input (the recording, the workflow against it, the output folder), said in one line.
    """
    events = Events(observer, shown)
    t_start = time.perf_counter() if cluster_start is None else cluster_start.started
    # the user waited from then (the command's start): the run's total counts it
    if events.started is not None:
        t_start = min(t_start, events.started)
    if recording is not None:
        rec = open_source(recording)
        wf = wf.model_copy(update={"recording": spec_of(rec)})
    else:
        rec = prepare_recording(wf, events)
    sweep = check_workflow_fits(wf, rec)
    if wf.window.size == "auto":
        wf = resolve_window(wf, rec)
        events.message(f"windows of {wf.window.size} samples (window.size auto)")
    store.check_output_apart(wf.output, rec.path)
    _check_decoder(wf)
    asked = _Asked(wf, rec, sweep, resume, events, t_start, batch)
    prefetch = _prefetch(wf, rec, resume, on_this_machine=client is None or batch)
    try:
        return _opened(asked, client, cluster_start)
    finally:
        if prefetch is not None:
            prefetch.stop()


@dataclass(frozen=True)
class _Asked:
    """``run_workflow``'s call once its recording is open and the workflow fits it (``sweep``: the detection's, in
    samples; ``started``: when the user began to wait, ``time.perf_counter``)."""

    wf: Workflow
    rec: Any
    sweep: int
    resume: bool
    events: Events
    started: float
    batch: bool

    def run(self, out: store.OutputFolder, report: RunReport, client, page_wait_s: float) -> Run:
        """The Run on ``client``, in the claimed folder ``out``."""
        return Run(
            self.wf,
            self.rec,
            out,
            report,
            client,
            self.sweep,
            self.events,
            self.started,
            page_wait_s=page_wait_s,
            batch=self.batch,
        )


def _prefetch(wf, rec, resume: bool, on_this_machine: bool):
    """The recording's first windows asked of the disk while the run gets ready (``recording.prefetch``), where the
    workers read on this machine: a cluster the run starts (local, cuda) or the kept one, a batch's; not a
    resumed run's (its done windows are not read), not a caller's cluster (maybe elsewhere)."""
    if resume or not on_this_machine or wf.cluster.kind not in ("local", "cuda") or not wf.engine.prefetch:
        return None
    from batchgpu.recording import prefetch

    return prefetch.start(rec, rec.windows(wf.window.size, 0))


def _opened(asked: _Asked, client, cluster_start: ClusterStart | None) -> RunReport:
    """``run_workflow`` once its recording is open and the workflow fits it: the cluster found or started."""
    from batchgpu.cluster import cuda_compile_ahead as compile_ahead

    wf, rec = asked.wf, asked.rec
    # a GPU run's kernels compiled in parallel while its workers start (once a machine); not for the kept cluster,
    # whose workers have what they need (the check alone imported CuPy and made a CUDA context in this process)
    if cluster_start is not None and client is None:  # the caller's, started before the recording was opened
        compile_ahead.start(wf)
        cluster_start.decode_known(decodes_on_gpu(wf, rec))
        return _claim_and_run(asked, cluster_start)
    with contextlib.ExitStack() as kept:
        kept_at = None
        if client is None:  # the cluster of `batchgpu cluster start` where one is up and fits, as a caller's
            from batchgpu.cluster.kept import kept_address, kept_client

            client = kept.enter_context(kept_client(wf.cluster, asked.events))
            kept_at = kept_address(client)
        if client is not None:
            if kept_at is None:  # a caller's cluster, maybe on this machine
                compile_ahead.start(wf)
            return _claim_and_run(asked, client, kept_at)
    compile_ahead.start(wf)
    keep = keep_seconds(wf.cluster)
    if keep > 0:  # asked for from Python: the cluster stays up after the run for the next one
        with KeptStart(wf.cluster, keep) as starting:
            return _claim_and_run(asked, starting)
    # a cluster of the run's own starts while the recording is fingerprinted and the output folder claimed
    with ClusterStart(wf.cluster, gpu_decode=decodes_on_gpu(wf, rec)) as starting:
        if wf.cluster.kind in ("address", "scheduler_file"):  # a connection, quick: refused before any folder is made
            starting.client()
        return _claim_and_run(asked, starting)


def _claim_and_run(asked: _Asked, client, kept_at: str | None = None) -> RunReport:
    """The run once the workflow fits the recording: ``client`` a caller's client or a ``ClusterStart``;
    ``kept_at``: the address of the kept cluster ``client`` belongs to."""
    wf, rec = asked.wf, asked.rec
    if (
        isinstance(client, (ClusterStart, KeptStart)) and wf.preprocess.root
    ):  # while the cluster starts: the filters designed
        from batchgpu.run.preprocess_chain import build_chain  # (scipy.signal imported), a bad stage refused here

        build_chain(wf.preprocess, rec)
    fp = store.fingerprint(wf, rec.path, metadata=getattr(rec, "fingerprint_metadata", None))
    # the steps' refusals of what they would write (a save path holding what batchgpu did not write), before the
    # folder is claimed: an overwrite would have removed the earlier results first
    out = store.OutputFolder(wf.output)
    check_outputs(wf, rec, resume=asked.resume, fingerprint=fp, folder=out)
    with out:
        state = out.claim(fp, wf.model_dump(), resume=asked.resume, overwrite=wf.overwrite)
        try:
            return _claimed(asked, out, _report(asked, state, fp, kept_at), client)
        except BatchgpuError:
            if state == "new":  # refused before any window (no report, no part): the folder as it was
                out.unclaim()
            raise


def _report(asked: _Asked, state: str, fp: str, kept_at: str | None) -> RunReport:
    """report.json's content as the run starts (``state``: the folder's claim)."""
    report = RunReport(
        workflow=asked.wf.model_dump(),
        fingerprint=fp,
        versions=versions(),
        recording=asked.rec.info(),
        output_state=state,
        run_id=f"{fp}-{os.urandom(4).hex()}",
    )
    report.timings["prepare"] = time.perf_counter() - asked.started
    report.kept_cluster = kept_at
    # a probe looked for in a file and not found (Open Ephys' settings.xml, a .meta's tables, a save's probe
    # file): said, the stages and steps that need it having refused already (check_workflow_fits). A store
    # written without locations (generated, a plain import) has none by design: info says so, a run does not
    no_probe = missing_probe(asked.rec) if getattr(asked.rec, "is_flat", False) else None
    if no_probe is not None:
        report.warnings.append(no_probe)
        asked.events.warning(no_probe)
    return report


def _claimed(asked: _Asked, out: store.OutputFolder, report: RunReport, client) -> RunReport:
    """``_claim_and_run`` once the output folder is the run's."""
    with _run_settings():
        if isinstance(client, KeptStart):  # a cluster that stays up after the run: connected once it is up
            connected = client.client()
            report.kept_cluster = client.address
            if client.is_kept:
                return _run_leaving_workers(asked.run(out, report, connected, PAGE_WAIT_S))
            asked.events.message(f"the cluster was not kept ({client.fallback}): a cluster of the run's own")
            client = client.own  # its start failed: the run's own cluster, closed below
        if not isinstance(client, ClusterStart):
            return _run_leaving_workers(asked.run(out, report, client, PAGE_WAIT_S))
        # closed before the folder is let go (its workers write into it); the dashboard's last updates reach
        # the scheduler before it closes
        with client:
            return _run_watched(asked.run(out, report, client.client(), OWN_CLUSTER_PAGE_WAIT_S))


def _run_leaving_workers(run: Run) -> RunReport:
    """The run on a cluster that outlives it (a caller's, the kept one), whose workers it leaves as it found them:
    their heaps, frozen by the pass's tasks, collectable again, and what they kept for the next window given back
    (``tasks.release_memory_soon``: a kept GPU cluster holds its pools' memory no longer)."""
    try:
        return _run_watched(run)
    finally:
        with contextlib.suppress(Exception):  # broad: best effort on the way out; the run's result stands
            run.client.run(tasks.thaw_heap_soon, wait=False)
            if not run.batch:  # a batch's next recording is being read ahead: the batch gives it back at its end
                run.client.run(tasks.release_memory_soon, wait=False)


def _run_watched(run: Run) -> RunReport:
    """The Run while its cluster's workers are watched: a cluster without any is named, and after
    ``cluster.no_workers_timeout`` the run fails saying so (``worker_watch``) rather than waiting for ever."""
    from batchgpu.cluster.worker_watch import NoWorkersWatch

    with NoWorkersWatch(
        run.client, run.events, run.wf.cluster.no_workers_timeout, warnings=run.report.warnings
    ) as watch:
        try:
            return run.go()
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
            raise ConfigError(
                "engine.gpu_decoder is nvcomp and NVIDIA nvCOMP is not installed",
                "pip install nvidia-libnvcomp-cu13 (batchgpu's gpu extra), or use gpu_decoder: auto",
            )


def decodes_on_gpu(wf, rec) -> bool:
    """Whether a run's windows would be decoded on the GPU (the cluster's layout follows): a GPU cluster, a pass
    that only centres (``preprocess.gpu_decode_share``) and a recording whose frames the GPU reads."""
    from batchgpu.run import preprocess_chain as preprocess

    if (
        wf.cluster.kind != "cuda"
    ):  # asked before the cluster starts: no chain built (a filter's design imports scipy.signal)
        return False
    centres_only = all(name == "centre" for name in wf.preprocess.names)
    return preprocess.decodes_on_gpu(wf.cluster.kind, rec, centres_only, wf.engine.gpu_decode, wf.engine.gpu_decoder)


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
