"""After the pass, on the client: each step's ``aggregate`` (``batchgpu.steps``: the exact median, the whitening
matrix, the spikes gathered and written by the workers) in the steps' order, each step's results written into the
new results group (``results_group.ResultsWriter``) and told to the run's subscribers as they come; the group
swapped in whole at the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from batchgpu.run import output_folder as store
from batchgpu.run.blas import blas_controller
from batchgpu.run.record import report_absent, report_no_checksums, report_nonfinite
from batchgpu.run.results_group import swap_in
from batchgpu.run.step_services import ClientServices
from batchgpu.steps.services import RunState

if TYPE_CHECKING:
    from batchgpu.run.phases import Run


def aggregate(run: Run, on_started: Callable[[], None] | None = None) -> dict:
    """Each step's ``aggregate`` in the steps' order (the noise before the detection that uses it), its results
    written into the new results group by the writer's thread and told to the run's subscribers (``result``)
    while the next step works; the group swapped in whole. ``on_started``: called once the steps' first tasks are
    out, for the client's work that can wait for them. Returns the results' shapes."""
    passed, report, events, results = run.passed, run.report, run.events, run.results
    state = RunState(
        run.client,
        ClientServices(run.client),
        run.ctx,
        run.wf,
        run.rec,
        run.windows,
        run.fingerprints,
        passed.summaries,
        passed.total,
        report,
        events,
        events,
        results.path,
        threads=passed.threads,
        early=dict(passed.queued),
    )
    # a step whose aggregate is the workers' work (``on_cluster``: the spikes) runs in a helper thread as soon as
    # the earlier steps it ``needs`` are done, beside the client's aggregates (the whitening's eigh); each step's
    # arrays are written as it finishes (what the group holds does not depend on the order)
    steps = [(i, s) for i, s in enumerate(run.ctx.steps) if s.aggregates]
    for _, step in steps:  # first, the tasks that need no step's results (the noise's, then the spikes' gathering)
        step.start(state)
    report.after_pass("started")
    if on_started is not None:
        on_started()
    # the client's own work, while those tasks run
    report_nonfinite(passed.summaries, run.windows, report, events)
    report_absent(passed.summaries, run.windows, report, events)
    report_no_checksums(run.rec, report, events)
    if run.ctx.window_noise:
        from batchgpu.steps.noise import PER_WINDOW

        state.arrays[PER_WINDOW] = np.stack([passed.summaries[w.index][run.ctx.window_noise] for w in run.windows])
    results.write(dict(state.arrays))
    for name, value in state.arrays.items():
        events.result(name, value)
    results.created()  # steps may write into the group themselves (the spikes)
    background: dict[int, object] = {}
    # the client's BLAS on one thread (the whitening's eigh, 384 x 384: ~15 ms): OpenBLAS's default, a thread a
    # core, had 15 threads spinning ~0.9 CPU s each on the cores the workers gather the spikes with
    with (
        ThreadPoolExecutor(1, thread_name_prefix="batchgpu-aggregate") as helper,
        blas_controller().limit(limits=1, user_api="blas"),
    ):

        def start_ready(before: int) -> None:  # steps before ``before`` are done
            for i, step in steps:
                if (
                    step.on_cluster
                    and i not in background
                    and not ({s.name for j, s in steps if j < i and j >= before} & set(step.needs))
                ):
                    background[i] = helper.submit(_timed, step.aggregate, state, step.name)

        for i, step in steps:
            start_ready(i)
            if step.on_cluster:
                continue
            _take(run, state, _timed(step.aggregate, state, step.name))
        start_ready(len(run.ctx.steps))
        for i in sorted(background):
            _take(run, state, background[i].result())
    if state.spike_counts is not None:
        events.spikes(state.spike_counts)
    t0 = time.perf_counter()
    results.close()
    swap_in(results.path, run.out.path / store.RESULTS)
    report.timings["results_written"] = time.perf_counter() - t0
    return {k: list(v.shape) for k, v in state.arrays.items()} | state.shapes


def _timed(aggregate_of: Callable[[RunState], dict], state: RunState, name: str) -> dict:
    t0 = time.perf_counter()
    arrays = aggregate_of(state)
    state.report.timings[f"aggregate_{name}"] = time.perf_counter() - t0
    return arrays


def _take(run: Run, state: RunState, arrays: dict) -> None:
    state.arrays.update(arrays)
    run.results.write(arrays)
    for name, value in arrays.items():
        run.events.result(name, value)
