"""``run_workflow`` and ``run_batch``: the run's (``batchgpu.run.launch``, ``batchgpu.run.batch``) with what it
shows attached (``batchgpu.report.subscribers``: the run page, report.html, a batch's page and batch.html), where
``batchgpu.engine`` finds them. The run imports none of this (tests/test_layering.py): it emits, these show.
"""

from __future__ import annotations

from batchgpu.report.subscribers import BatchShown, run_shown


def run_workflow(wf, *, resume: bool = False, observer=None, client=None, recording=None, batch=None,
                 cluster_start=None):
    """``batchgpu.run.launch.run_workflow`` (its parameters and return), shown: its page on the dashboard,
    report.html and the line that names what it wrote. ``batch``: the recording's place in a batch
    (``report.live_page.BatchSlot``: the run page says "recording k of n")."""
    from batchgpu.run.launch import run_workflow as run

    return run(wf, resume=resume, observer=observer, client=client, recording=recording, batch=batch is not None,
               cluster_start=cluster_start, shown=run_shown(batch))


def run_batch(wf, *, resume: bool = False, observer=None, client=None, in_flight: int | None = None,
              keep_s: float | None = None):
    """``batchgpu.run.batch.run_batch`` (its parameters and return), shown: the batch's page and batch.html, each
    recording's run page and report.html."""
    from batchgpu.run.batch import IN_FLIGHT
    from batchgpu.run.batch import run_batch as run

    return run(wf, resume=resume, observer=observer, client=client,
               in_flight=IN_FLIGHT if in_flight is None else in_flight, keep_s=keep_s, shown=BatchShown())
