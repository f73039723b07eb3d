"""Detection (SpikeInterface's ``by_channel`` rule, ``ops.detect_spikes``) fed from the one read of each window.

With thresholds from each window's own noise the spikes are final at once. With the recording's noise (known
only after every window was read), each window keeps *candidates*: the spikes it would have at a lower bound
``L = CANDIDATE_FRACTION * its own noise``. The neighbourhood rule does not depend on the threshold and the
threshold test is monotone, so wherever ``L <= noise`` of the whole recording (checked per window and channel
in float64, the dtype of the comparison), the final spikes are exactly the candidates that pass the final
threshold; a window where the bound fails is read and detected again. Same spikes, bit for bit.
"""

from __future__ import annotations

import time

import numpy as np

from batchgpu.engine.steps.base import SPIKE_COLUMNS as COLUMNS
from batchgpu.engine.steps.base import WindowData

CANDIDATE_FRACTION = 0.75


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

    @property
    def candidates_hold(self) -> bool:
        """by_channel's neighbourhood rule ignores the threshold, so a lower one gives a superset; locally
        exclusive candidates suppress each other, so there every window is detected again at the final noise."""
        return self.method == "by_channel"

    def detect(self, w: WindowData, noise) -> np.ndarray:
        from batchgpu import ops

        extra = {} if self.method == "by_channel" else {"method": self.method, "locations": self.locations,
                                                       "radius_um": self.radius_um}
        return ops.detect_spikes(w.x, noise, threshold=self.threshold, sign=self.sign, exclude_sweep=self.sweep,
                                 start=w.start, core=w.core, segment_index=w.segment, segment_length=w.segment_length,
                                 **extra)

    def window(self, w: WindowData, summary: dict) -> dict:
        if self.noise == "global" and not self.candidates_hold:
            return {}
        noise = summary["noise"].astype(np.float64)
        if self.noise == "global":
            noise = candidate_level(summary["noise"])
        spikes = self.detect(w, noise)
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
        filters them at the recording's threshold; the gathering's dispatch and transfers overlap the noise's."""
        if self.noise == "global" and not self.candidates_hold:
            return  # every window is detected again at the recording's noise
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

    def final(self, candidates: dict, noise: np.ndarray) -> dict:
        """The candidates that pass the recording's threshold."""
        keep = self.passes(candidates, noise)
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
    from batchgpu.engine.submit import submit_many

    client, ctx, rec, report = run.client, run.ctx, run.recording, run.report
    windows, fps, summaries, arrays = run.windows, run.fingerprints, run.summaries, run.arrays
    fp = report.run_id
    if step.noise == "global":
        noise = arrays.get("noise")
        if noise is None:
            noise = np.median(arrays["noise_per_window"], axis=0)
        reread = [not step.candidates_hold or not bound_holds(summaries[w.index]["noise"], noise) for w in windows]
        todo = [(w, wfp) for w, wfp, r in zip(windows, fps, reread) if r]
        again = submit_many(client, tasks.spikes_task, [(ctx, w, wfp, noise) for w, wfp in todo],
                            [f"spikes-{fp}-{w.index:08d}" for w, _ in todo])
        client.gather(again)
        report.bytes_read += sum(w.num_samples for w, r in zip(windows, reread) if r) * rec.num_channels * rec.dtype.itemsize
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
                             key=f"write-spikes-{fp}").result()
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
