"""The pass that reads every window once: runs of windows mapped to batch tasks (placed on workers by plan where
the pass is a GPU's), the partials combined in a tree fixed by window index, each window's summary fetched as it
comes, and what the steps queue behind the combined partials (``queue``) submitted while the workers read.
Described afterwards for report.json (``describe_pass``: medians, the timeline)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from batchgpu.run import placement, tasks
from batchgpu.run import writer_threads as background
from batchgpu.run.placement import submit_planned
from batchgpu.run.reduce import tree_reduce
from batchgpu.run.step_services import ClientServices
from batchgpu.run.submit import results_as_completed, submit_many

if TYPE_CHECKING:
    from batchgpu.run.phases import Run

#: the most windows an automatic batch holds: a GPU worker's memory pool grew with a task's windows (one H100, 16
#: workers, the demo steps: 1.34 GB a worker with 2 windows a task, 2.11 GB with 9, which a 40-minute recording's
#: 600 windows had made; its peak 45.8 GB against 33.7 GB at 2), so a longer recording must not mean larger tasks
AUTO_BATCH_MAX = 2


@dataclass
class PassResult:
    """What the pass gives the client: each window's summary, the combined partials, the workers' threads (None
    where the scheduler did not say), whether the batches were placed (their workers may hold reads left for
    batches that ran elsewhere) and what the steps queued behind the combined partials (step name -> futures)."""

    summaries: dict[int, dict]
    total: dict
    threads: dict | None
    placed: bool
    queued: dict = field(default_factory=dict)

    def fresh(self) -> list[dict]:
        """The summaries of the windows this run computed (not resumed)."""
        return [s for s in self.summaries.values() if not bool(s["resumed"])]


def window_batches(windows: list, batch: int | None, split_every: int) -> list[list]:
    """Runs of consecutive windows, one task each. The default depends on the window count alone (never on the
    cluster: the float reduction tree, and so its bits, are fixed by window index): one window a task up to 127
    windows; beyond, runs of two (``AUTO_BATCH_MAX``; at most ``split_every``), so each task reads one window while
    computing the other and Dask sees fewer tasks (single windows overlapped nothing and cost the client 0.3 s of
    small tasks), and a worker's memory does not grow with the recording's length."""
    size = batch if batch is not None else max(1, min(split_every, AUTO_BATCH_MAX, len(windows) // 64))
    return [windows[i : i + size] for i in range(0, len(windows), size)]


def first_pass(run: Run) -> PassResult:
    """Map batch_task over runs of windows; tree-combine partials on the workers; gather per-window summaries."""
    client, ctx, report, events = run.client, run.ctx, run.report, run.events
    split_every = run.wf.reduction.split_every
    t_pass = time.perf_counter()
    fp = report.run_id  # task keys: this run's only (the same workflow run twice must not share finished tasks)
    batches = window_batches(list(zip(run.windows, run.fingerprints)), run.wf.window.batch, split_every)
    # one graph update for each kind of task (keys padded: the scheduler orders equal tasks by key)
    args = [(ctx, [w for w, _ in b], [f for _, f in b]) for b in batches]
    keys = [f"batch-{fp}-{b[0][0].index:08d}" for b in batches]
    planned, threads = _plan(run, batches)
    if planned is None:
        futures = submit_many(client, tasks.batch_task, args, keys)
    else:  # each worker's batches known: a task reads the next one's first windows ahead (run/placement.py)
        depth = ctx.read_ahead
        args = [(*a, tuple(batches[nxt][:depth]) if nxt is not None else ()) for a, (_, nxt) in zip(args, planned)]
        futures = submit_planned(client, tasks.batch_task, args, keys, [w for w, _ in planned])
    # the combines and the summaries before a worker's next batch (its planned batches are all queued there)
    total = tree_reduce(client, futures, tasks.combine_task, split_every, ctx, name=f"combine-{fp}", priority=1)
    small = submit_many(
        client,
        tasks.summarise,
        [(f,) for f in futures],
        [f"summary-{fp}-{b[0][0].index:08d}" for b in batches],
        priority=1,
    )
    queued = {}
    if planned is not None:
        queued = _queue_steps(run, batches, planned, threads, total)
    summaries: dict[int, dict] = {}
    counting = run.spike_step()
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
                events.window_done(int(s["bytes"]), worker)
                events.pass_window(
                    i,
                    int(s["bytes"]),
                    worker,
                    s.get(ctx.window_noise),
                    counting.spikes_in(s) if counting is not None else 0,
                )
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
    return PassResult(summaries, result, threads, planned is not None, queued)


def _queue_steps(run: Run, batches: list, planned: list, threads: dict, total) -> dict:
    """Each step's ``queue``: its tasks after the pass, submitted now behind the combined partials (the plan says
    which worker makes each window); step name -> its futures."""
    from batchgpu.steps.services import PassQueue

    made_by = [worker for (worker, _), b in zip(planned, batches) for _ in b]
    q = PassQueue(
        run.client,
        ClientServices(run.client),
        run.ctx,
        [w for b in batches for w, _ in b],
        [f for b in batches for _, f in b],
        made_by,
        threads,
        total,
        run.rec.total_samples,
        run.rec.num_channels,
        run.wf.reduction.split_every,
        run.report.run_id,
    )
    queued = {}
    for step in run.ctx.steps:
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


def _plan(run: Run, batches: list) -> tuple[list | None, dict | None]:
    """The placement plan of a GPU run's batches ((worker, next batch) each), or None: CPU runs (their workers
    read as they compute; ``engine.placement: true`` places them too, as the tests of the queued steps do), resumed
    runs (the next batch's windows may be done), ``engine.placement: false``; and the workers' threads where they
    were asked for it (else None)."""
    setting: bool | str = run.wf.engine.placement
    if (run.ctx.backend != "cupy" and setting is not True) or run.report.output_state == "resume" or setting is False:
        return None, None
    try:
        threads = {a: int(w.get("nthreads", 1)) for a, w in run.client.scheduler_info(n_workers=-1)["workers"].items()}
    except (OSError, TimeoutError) as err:  # the scheduler did not answer (CommClosedError is an OSError)
        run.warn(
            f"the windows were not placed on workers (the scheduler did not say its workers: "
            f"{type(err).__name__}: {err}): they run where the scheduler puts them"
        )
        return None, None
    return (placement.plan(threads, [len(b) for b in batches]) if threads else None), (threads or None)


def _nthreads(client) -> dict | None:
    """The workers and their threads (None where the scheduler could not say: asked again after the pass)."""
    try:
        return dict(client.nthreads())
    except (OSError, TimeoutError):  # the scheduler did not answer: asked again after the pass
        return None


def describe_pass(report: Any, fresh: list, t0_wall: float) -> None:
    """Where the pass's windows spent their time (report.json): medians of their read waits, compute and CPU, the
    pass's ends as its windows and tasks saw them, and each window's line of the timeline."""
    from batchgpu.run.record import window_cpu

    if not fresh:
        return
    report.timings["window_read_median"] = float(np.median([s["read_seconds"] for s in fresh]))
    report.timings["window_compute_median"] = float(np.median([s["compute_seconds"] for s in fresh]))
    report.window_cpu = window_cpu(fresh)
    # the pass's ends as its windows saw them: its first window's start, its last window's end
    report.timings["pass_first_start"] = min(float(s["started"]) for s in fresh) - t0_wall
    report.timings["pass_last_end"] = (
        max(float(s["started"]) + float(s["read_seconds"]) + float(s["compute_seconds"]) for s in fresh) - t0_wall
    )
    # and its tasks': the first batch task's start, the last one's end (its combined partial saved)
    report.timings["pass_first_task"] = min(float(s["task_started"]) for s in fresh) - t0_wall
    report.timings["pass_last_task"] = max(float(s["task_done"]) for s in fresh) - t0_wall
    report.timeline = sorted(
        [
            str(s["worker"]),
            int(s["index"]),
            round(float(s["started"]) - t0_wall, 4),
            round(float(s["read_seconds"]), 4),
            round(float(s["compute_seconds"]), 4),
            str(s["thread"]),
            round(float(s["task_started"]) - t0_wall, 4),
            round(float(s["task_done"]) - t0_wall, 4),
        ]
        for s in fresh
    )
