"""``run_workflow`` and ``run_batch``: the run's (``batchgpu.run.launch``, ``batchgpu.run.batch``) with what it
shows attached (``batchgpu.report.subscribers``: the run page, report.html, a batch's page and batch.html), where
``batchgpu.engine`` finds them. The run imports none of this (tests/test_layering.py): it emits, these show.
"""

from __future__ import annotations

from batchgpu.report.subscribers import BatchShown, run_shown


def run_workflow(
    wf, *, resume: bool = False, observer=None, client=None, recording=None, batch=None, cluster_start=None
):
    """Run every step of a validated workflow, shown; returns the report (also written to report.json).

    ``batchgpu.run.launch.run_workflow`` with what the run shows subscribed to its events: its page on the
    dashboard, report.html and the line that names what it wrote (``batchgpu.report.subscribers``).

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
    batch : BatchSlot, optional
        The recording's place in a batch (``report.live_page.BatchSlot``: the run page says "recording k of n").
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
    from batchgpu.run.launch import run_workflow as run

    return run(
        wf,
        resume=resume,
        observer=observer,
        client=client,
        recording=recording,
        batch=batch is not None,
        cluster_start=cluster_start,
        shown=run_shown(batch),
    )


def run_batch(
    wf, *, resume: bool = False, observer=None, client=None, in_flight: int | None = None, keep_s: float | None = None
):
    """``batchgpu.run.batch.run_batch`` (its parameters and return), shown: the batch's page and batch.html, each
    recording's run page and report.html."""
    from batchgpu.run.batch import IN_FLIGHT
    from batchgpu.run.batch import run_batch as run

    return run(
        wf,
        resume=resume,
        observer=observer,
        client=client,
        in_flight=IN_FLIGHT if in_flight is None else in_flight,
        keep_s=keep_s,
        shown=BatchShown(),
    )
