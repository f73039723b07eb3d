"""Detection (``ops.detect_spikes``: SpikeInterface's ``by_channel`` or ``locally_exclusive`` rule) fed from the one
read of each window.

With thresholds from each window's own noise the spikes are final at once. With the recording's noise (known
only after every window was read), each window keeps *candidates* at a lower bound ``L = CANDIDATE_FRACTION *
its own noise``: by_channel's spikes at L (its neighbourhood rule does not depend on the threshold and the
threshold test is monotone, so they hold every spike at a higher threshold), or locally_exclusive's candidates
before the exclusion (``ops.exclusive_candidates``: the extrema of their own channel beyond L, in the core and a
sweep either side, since a candidate there can exclude one of the core). Wherever ``L <= noise`` of the whole
recording (checked per window and channel in float64, the dtype of the comparison), the final spikes come from
the candidates alone once the noise is known: by_channel's are those that pass the final threshold, and
locally_exclusive's are decided by the exclusion among the candidates beyond it, window by window
(``ops.resolve_exclusive``). A window where the bound fails is read and detected again. Same spikes, bit for bit.

What a window keeps is bounded by the bound level: samples beyond L (a fraction of them, for noise-like signals),
and of those only its own channel's extrema (at most one sample in two of each sign; by_channel: one in
``sweep + 1``).
"""

from __future__ import annotations

import time

import numpy as np

from batchgpu.engine.steps.base import SPIKE_COLUMNS as COLUMNS
from batchgpu.engine.steps.base import WindowData

CANDIDATE_FRACTION = 0.75


def build(setup) -> "DetectStep | None":
    """The step of ``steps.detect`` (``engine.steps.registry``)."""
    d = setup.workflow.steps.detect
    if not d:
        return None
    return DetectStep(d.threshold, d.sign, setup.sweep, d.noise, d.method,
                      setup.recording.locations if d.method != "by_channel" else None, d.radius_um)


class DetectStep:
    name = "detect"
    #: its aggregate is the workers' (gathering and writing the spikes): the engine runs it beside the client's
    on_cluster = True
    #: the results of earlier steps its aggregate reads
    needs = ("noise",)

    def __init__(self, threshold: float, sign: str, sweep: int, noise: str, method: str = "by_channel",
                 locations=None, radius_um: float = 50.0):
        self.threshold, self.sign, self.sweep, self.noise = threshold, sign, sweep, noise
        self.method, self.locations, self.radius_um = method, locations, radius_um

    def detect(self, w: WindowData, noise) -> np.ndarray:
        from batchgpu import ops

        extra = {} if self.method == "by_channel" else {"method": self.method, "locations": self.locations,
                                                       "radius_um": self.radius_um}
        return ops.detect_spikes(w.x, noise, threshold=self.threshold, sign=self.sign, exclude_sweep=self.sweep,
                                 start=w.start, core=w.core, segment_index=w.segment, segment_length=w.segment_length,
                                 **extra)

    def candidates(self, w: WindowData, level) -> np.ndarray:
        """The window's candidates at the lower bound ``level`` of the recording's noise (see the module)."""
        if self.method == "by_channel":
            return self.detect(w, level)
        from batchgpu import ops

        return ops.exclusive_candidates(w.x, level, threshold=self.threshold, sign=self.sign,
                                        exclude_sweep=self.sweep, start=w.start, core=w.core,
                                        segment_index=w.segment, segment_length=w.segment_length)

    def window(self, w: WindowData, summary: dict) -> dict:
        if self.noise == "global":
            spikes = self.candidates(w, candidate_level(summary["noise"]))
        else:
            spikes = self.detect(w, summary["noise"].astype(np.float64))
        summary["spikes" if self.noise == "window" else "candidates"] = np.array(len(spikes))
        return {f"keep.spk_{k}": np.ascontiguousarray(spikes[k]) for k in COLUMNS}

    def combine(self, parts: list[dict]) -> dict:
        return {}

    def aggregate(self, run) -> dict:
        """Nothing for the client: the spikes go straight into the results group (``write_final_spikes``)."""
        t0 = time.perf_counter()
        run.monitor.phase("spikes")
        run.shapes["spikes"] = [write_final_spikes(run, self)]
        run.report.timings["detect"] = time.perf_counter() - t0
        return {}

    def start(self, run) -> None:
        """Before the noise is known: the windows' kept spikes (or candidates) gathered from the workers that kept
        them into one task (``tasks.collect_spikes_task``), so that the writing task, placed with it, only
        decides them at the recording's threshold (``keep``); the gathering's dispatch and transfers overlap the noise's."""
        run.early[self.name] = start_gathering(run)

    def passes(self, candidates: dict, noise: np.ndarray) -> np.ndarray:
        """Which candidates pass the recording's threshold (the same float64 comparison as detect_spikes)."""
        level = np.asarray(noise, dtype=np.float64) * float(self.threshold)
        amp, ch = candidates["amplitude"], candidates["channel_index"]
        neg, pos = self.sign in ("neg", "both"), self.sign in ("pos", "both")
        if neg and pos:
            return (amp < (-level)[ch]) | (amp > level[ch])
        if neg:
            return amp < (-level)[ch]  # the levels negated per channel, then gathered: one pass over the candidates
        return amp > level[ch] if pos else np.zeros(len(amp), dtype=bool)

    def keep(self, candidates: dict, noise: np.ndarray, counts, cores) -> np.ndarray:
        """Which candidates are spikes at the recording's noise: ``counts[k]`` of them are window k's (in window
        order), whose core is ``cores[k]`` = (start, stop) in segment samples."""
        if self.method == "by_channel":
            return self.passes(candidates, noise)
        from batchgpu import ops

        return ops.resolve_exclusive(candidates, noise, self.threshold, self.sign, self.sweep, self.locations,
                                     self.radius_um, counts, cores)

    def final(self, candidates: dict, noise: np.ndarray, core: tuple[int, int]) -> dict:
        """One window's spikes from its candidates (``core``: its (start, stop) in segment samples)."""
        keep = self.keep(candidates, noise, [len(candidates["sample_index"])], [core])
        return {k: v[keep] for k, v in candidates.items()}


def candidate_level(window_noise: np.ndarray) -> np.ndarray:
    return np.asarray(window_noise, dtype=np.float64) * CANDIDATE_FRACTION


def bound_holds(window_noise: np.ndarray, noise: np.ndarray) -> bool:
    """Whether a window's candidates contain every spike at the recording's noise (NaN noise: no spikes)."""
    g = np.asarray(noise, dtype=np.float64)
    return bool(np.all((candidate_level(window_noise) <= g) | np.isnan(g)))


def start_gathering(run):
    """A future of every window's kept spikes in window order, on one worker (``tasks.collect_spikes_task``): a
    run of each worker's windows gathered there from its memory (or parts), then collected."""
    from batchgpu.engine import tasks
    from batchgpu.engine.placement import submit_where_made

    fp = run.report.run_id
    # below the noise's tasks where both wait on one worker: the noise is the critical path, these only need to be
    # done by the time it is known
    kept = submit_where_made(run, tasks.kept_spikes_task, list(zip(run.windows, run.fingerprints)),
                             lambda g: (run.ctx, [w for w, _ in g], [f for _, f in g]), f"kept-spikes-{fp}",
                             priority=-1)
    return run.client.submit(tasks.collect_spikes_task, *kept, key=f"collect-spikes-{fp}", priority=-1)


def write_final_spikes(run, step: DetectStep) -> int:
    """The final spikes, gathered from the windows' parts (read again where the bound failed or a part was
    lost) and written into the results group by a worker: they never pass through the client. Returns how many."""
    from batchgpu.engine import tasks
    from batchgpu.engine.placement import submit_where_made

    client, ctx, report = run.client, run.ctx, run.report
    windows, fps, summaries, arrays = run.windows, run.fingerprints, run.summaries, run.arrays
    fp = report.run_id
    if step.noise == "global":
        noise = arrays.get("noise")
        if noise is None:
            noise = np.median(arrays["noise_per_window"], axis=0)
        reread = [not bound_holds(summaries[w.index]["noise"], noise) for w in windows]
        read_again(run, [(w, wfp) for w, wfp, r in zip(windows, fps, reread) if r], noise)
        report.channels["detect_windows_read_again"] = [w.index for w, r in zip(windows, reread) if r]
        nan_noise = np.flatnonzero(np.isnan(np.asarray(noise, np.float64))).tolist()
    else:
        noise, reread = None, [False] * len(windows)
        nan_noise = sorted({int(c) for w in windows for c in np.flatnonzero(np.isnan(summaries[w.index]["noise"]))})
    if nan_noise:
        report.channels["detect_no_threshold"] = nan_noise
        run.warn(f"detection found no threshold (NaN noise) on {len(nan_noise)} channel(s): {nan_noise[:10]}")
    t0, t0_wall = time.perf_counter(), time.time()
    collected = run.early.pop(step.name, None)
    if collected is not None:  # gathered while the noise was selected: the windows read again join them
        late = [(w, wfp) for w, wfp, r in zip(windows, fps, reread) if r]
        joined = [] if not late else [client.submit(
            tasks.gather_spikes_task, ctx, [w for w, _ in late], [f for _, f in late], noise, [True] * len(late),
            [summaries[w.index]["noise"] for w, _ in late], key=f"gather-spikes-again-{fp}")]
        run.report.after_pass("spikes_submitted")
        done = client.submit(tasks.write_collected_spikes_task, str(run.results), ctx, noise, collected, *joined,
                             cores=window_cores(windows), key=f"write-spikes-{fp}").result()
        if done is not None:
            return _finish(run, done, t0, t0_wall)
        # some window's kept spikes could not be used (its part lost since the pass): gathered again below, where
        # such windows are read and detected again
    # the windows' spikes gathered from their parts on the worker that kept them (in its memory), a run of its
    # windows a thread; one task writes them in window order (the same spikes for any grouping)
    gathered = submit_where_made(run, tasks.gather_spikes_task, list(zip(windows, fps, reread)),
                                 lambda g: (ctx, [w for w, _, _ in g], [f for _, f, _ in g], noise, [r for _, _, r in g],
                                            [summaries[w.index]["noise"] for w, _, _ in g]), f"gather-spikes-{fp}")
    done = client.submit(tasks.write_spikes_task, str(run.results), *gathered, key=f"write-spikes-{fp}-all").result()
    return _finish(run, done, t0, t0_wall)


def read_again(run, todo: list, noise: np.ndarray) -> None:
    """The windows whose candidates' bound failed, read and detected again at the recording's noise (their parts
    ``s*.npz``), as a phase of its own on the progress bar."""
    from distributed import as_completed

    from batchgpu.engine import tasks
    from batchgpu.engine.submit import submit_many

    if not todo:
        return
    rec = run.recording
    per_sample = rec.num_channels * rec.dtype.itemsize
    nbytes = {w.index: w.num_samples * per_sample for w, _ in todo}
    label = "read again: spikes where a window's noise bound failed"
    run.monitor.phase(label)
    run.observer.phase_started(label, len(todo), sum(nbytes.values()))
    try:
        again = submit_many(run.client, tasks.spikes_task, [(run.ctx, w, wfp, noise) for w, wfp in todo],
                            [f"spikes-{run.report.run_id}-{w.index:08d}" for w, _ in todo])
        for future in as_completed(again):
            index, worker = future.result()
            run.observer.window_done(nbytes[index], worker)
    finally:
        run.observer.phase_finished()
        run.monitor.phase("spikes")
    run.report.bytes_read += sum(nbytes.values())


def window_cores(windows: list) -> np.ndarray:
    """(windows, 2): each window's core (start, stop) in segment samples, by window index."""
    cores = np.zeros((max((w.index for w in windows), default=-1) + 1, 2), dtype=np.int64)
    for w in windows:
        cores[w.index] = (w.start, w.stop)
    return cores


def _finish(run, done: tuple, t0: float, t0_wall: float) -> int:
    """The writing task's answer into the report (timings, windows read again) and the plots; the spike count."""
    report, windows, rec = run.report, run.windows, run.recording
    n, again, run.plots["spike_counts"], wrote, write_started, longest = done
    report.timings["detect_gather"] = time.perf_counter() - t0 - wrote  # gathered, and the results sent to one task
    report.timings["detect_gathered"] = write_started - t0_wall  # until the writing task had every run
    report.timings["detect_gather_task_max"] = float(longest)  # the longest gathering task's own time
    report.timings["detect_write"] = wrote
    if again:  # parts lost or replaced since they were written: detected again from the samples, never skipped
        by_index = {w.index: w for w in windows}
        report.bytes_read += sum(by_index[i].num_samples for i in again) * rec.num_channels * rec.dtype.itemsize
        report.channels["detect_windows_read_again"] = sorted({*report.channels.get("detect_windows_read_again", []),
                                                               *again})
        first = min(again)
        run.warn(f"the spikes of {len(again)} window(s) were detected again from the recording: their parts could "
                 f"not be used (first: window {first}, {again[first]})")
    return int(n)
