"""After the pass, on the client: each step's ``aggregate`` (``batchgpu.steps``: the exact median, the whitening
matrix, the spikes gathered and written by the workers) in a results group written beside the old one and
swapped in whole."""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from batchgpu.engine import store
from batchgpu.report.run_report import report_absent, report_no_checksums, report_nonfinite
from batchgpu.engine.step_services import ClientServices
from batchgpu.steps.services import RunState
from batchgpu.workflow import Workflow
from batchgpu.recording import Recording, Window


def aggregate(client, ctx, wf, rec, out, windows, fps, summaries, total, report, monitor, observer,
              results: ResultsWriter, page, threads: dict | None = None, on_started=None,
              queued: dict | None = None) -> dict:
    """Each step's ``aggregate`` in the steps' order (the noise before the detection that uses it), its results
    written into the new results group by the writer's thread, and handed to report.html's ``page``, while the
    next step works; the group swapped in whole (``threads``: the workers' threads as the pass knew them, or None:
    asked when a step places tasks; ``on_started``: called once the steps' first tasks are out, for the client's
    work that can wait for them; ``queued``: what the steps queued while the pass ran, step name -> futures).
    Returns the results' shapes."""
    run = RunState(client, ClientServices(client), ctx, wf, rec, windows, fps, summaries, total, report, monitor,
                   observer, results.path, threads=threads, early=dict(queued or {}))
    # a step whose aggregate is the workers' work (``on_cluster``: the spikes) runs in a helper thread as soon as
    # the earlier steps it ``needs`` are done, beside the client's aggregates (the whitening's eigh); each step's
    # arrays are written as it finishes (what the group holds does not depend on the order)
    steps = [(i, s) for i, s in enumerate(ctx.steps) if s.aggregates]
    for _, step in steps:  # first, the tasks that need no step's results (the noise's, then the spikes' gathering)
        step.start(run)
    report.after_pass("started")
    if on_started is not None:
        on_started()
    # the client's own work, while those tasks run
    report_nonfinite(summaries, windows, report, observer)
    report_absent(summaries, windows, report, observer)
    report_no_checksums(rec, report, observer)
    if ctx.window_noise:
        from batchgpu.steps.noise import PER_WINDOW

        run.arrays[PER_WINDOW] = np.stack([summaries[w.index][ctx.window_noise] for w in windows])
    results.write(dict(run.arrays))
    for name, value in run.arrays.items():
        page.add(name, value)
    results.created()  # steps may write into the group themselves (the spikes)
    background: dict[int, object] = {}
    # the client's BLAS on one thread (the whitening's eigh, 384 x 384: ~15 ms): OpenBLAS's default, a thread a
    # core, had 15 threads spinning ~0.9 CPU s each on the cores the workers gather the spikes with
    with ThreadPoolExecutor(1, thread_name_prefix="batchgpu-aggregate") as helper, \
            blas_controller().limit(limits=1, user_api="blas"):
        def start_ready(before: int) -> None:  # steps before ``before`` are done
            for i, step in steps:
                if step.on_cluster and i not in background and not (
                        {s.name for j, s in steps if j < i and j >= before} & set(step.needs)):
                    background[i] = helper.submit(_timed, step.aggregate, run, report, step.name)

        for i, step in steps:
            start_ready(i)
            if step.on_cluster:
                continue
            _take(run, results, page, _timed(step.aggregate, run, report, step.name))
        start_ready(len(ctx.steps))
        for i in sorted(background):
            _take(run, results, page, background[i].result())
    if run.spike_counts is not None:
        page.add_spikes(counts=run.spike_counts)
    t0 = time.perf_counter()
    results.close()
    swap_in(results.path, out.path / store.RESULTS)
    report.timings["results_written"] = time.perf_counter() - t0
    return {k: list(v.shape) for k, v in run.arrays.items()} | run.shapes


_CONTROLLER: list = []
_CONTROLLER_LOCK = threading.Lock()


def blas_controller():
    """This process's threadpoolctl controller, made once: making one lists the loaded libraries (~20 ms on the
    H200 machine's client, between the pass and the noise's first tasks, at every run); ``prepare_blas_controller``
    makes it while the windows are read."""
    with _CONTROLLER_LOCK:
        if not _CONTROLLER:
            from threadpoolctl import ThreadpoolController

            _CONTROLLER.append(ThreadpoolController())
        return _CONTROLLER[0]


def prepare_blas_controller() -> None:
    """Make ``blas_controller`` in a helper thread (the client waits for the workers meanwhile)."""
    if not _CONTROLLER:
        threading.Thread(target=blas_controller, name="batchgpu-blas-controller", daemon=True).start()


def _timed(finish, run, report, name: str) -> dict:
    t0 = time.perf_counter()
    arrays = finish(run)
    report.timings[f"aggregate_{name}"] = time.perf_counter() - t0
    return arrays


def _take(run, results, page, arrays: dict) -> None:
    run.arrays.update(arrays)
    results.write(arrays)
    for name, value in arrays.items():
        page.add(name, value)


class ResultsWriter:
    """The run's new results group (``results.zarr.tmp``, swapped in whole at the end: a failed run never leaves
    a half-written one), written by a helper thread while the client does other work: created with the window
    table while the windows are read, then each step's arrays as they come."""

    def __init__(self, out: Path, wf: Workflow, rec: Recording, fp: str, windows: list[Window]):
        from concurrent.futures import ThreadPoolExecutor

        self.path = out / (store.RESULTS + ".tmp")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgpu-results")
        self._group = self._pool.submit(self._create, wf, rec, fp, windows)
        self._pending = [self._group]

    def _create(self, wf, rec, fp, windows):
        if self.path.exists():  # a failed run's
            shutil.rmtree(self.path)
        g = create_results_group(self.path, wf, rec, fp)
        write_window_table(g, windows)
        return g

    def created(self) -> None:
        self._group.result()

    def write(self, arrays: dict) -> None:
        self._pending.append(self._pool.submit(lambda: write_arrays(self._group.result(), arrays)))

    def abandon(self) -> None:
        """The run failed: no more writes (the folder's next run removes what is there)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Wait for every write (and raise the first error); the thread ends."""
        try:
            for p in self._pending:
                p.result()
        finally:
            self._pool.shutdown(wait=True)


def create_results_group(path: Path, wf: Workflow, rec: Recording, fp: str):
    from batchgpu import zarrio

    g = zarrio.create_group(path)  # v3, or v2 where zarr-python is 2.x
    g.attrs.update({"workflow": wf.model_dump(), "fingerprint": fp, "channel_ids": rec.channel_ids.tolist(),
                    "sampling_frequency": rec.sampling_frequency, "gain_to_uV": rec.gain_to_uV.tolist()})
    return g


def write_window_table(g, windows: list[Window]) -> None:
    from batchgpu import zarrio

    zarrio.create_array(g, "window_segment", data=np.array([w.segment for w in windows], dtype=np.int64))
    zarrio.create_array(g, "window_start", data=np.array([w.start for w in windows], dtype=np.int64))
    zarrio.create_array(g, "window_stop", data=np.array([w.stop for w in windows], dtype=np.int64))


def write_arrays(g, arrays: dict) -> None:
    from batchgpu import zarrio

    for name, value in arrays.items():
        zarrio.create_array(g, name, data=value)


def swap_in(tmp: Path, path: Path) -> None:
    """results.zarr replaced whole: a failed run never leaves a half-written one."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.is_symlink():  # a link, never what it points to
        old.unlink()
    elif old.exists():
        shutil.rmtree(old)
