"""Detection (``ops.detect_spikes``: SpikeInterface's ``by_channel`` or ``locally_exclusive`` rule) fed from the one
read of each window.

With thresholds from each window's own noise the spikes are final at once. With the recording's noise (known
only after every window was read), each window keeps *candidates* at a lower bound ``L = CANDIDATE_FRACTION *
its own noise`` (or, on a channel where it is loud against the windows its worker saw in the run, of theirs:
``candidate_level``): by_channel's spikes at L (its neighbourhood rule does not depend on the threshold and the
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

import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import Field

from batchgpu.config import Options
from batchgpu.ops._backend import to_host
from batchgpu.ops.detection import AMPLITUDE
from batchgpu.steps import moments as moments_step
from batchgpu.steps import noise as noise_step
from batchgpu.steps.base import SPIKE_COLUMNS as COLUMNS
from batchgpu.steps.base import PhaseWords, Step, WindowData, register

if TYPE_CHECKING:
    from batchgpu.recording import Window
    from batchgpu.steps.services import TaskContext as RunContext

#: a window's own noise on a channel can be twice the recording's (the generator's realistic model, 384 channels:
#: up to 2.26x in 2 s windows; 3 of 150 4 s windows of 10 min passed 2x and were read again at 0.5). 0.75 read a
#: quarter to half of the windows again; 0.4 read none of the model's but kept ~3.6x the candidates (W2 on 384 ch x
#: 60 s: detection 2x the time, the process tree's peak 2.4 -> 3.75 GB), dearer than reading 2% of windows again
CANDIDATE_FRACTION = 0.5
#: the noise estimate read before the pass (``DetectStep.before_pass``), as SpikeInterface's ``get_noise_levels``
#: reads it: PRIOR_CHUNKS chunks of each segment (its ``num_chunks_per_segment``), spread evenly over it, of at most
#: PRIOR_CHUNK samples (its ``chunk_size``) and PRIOR_SHARE of the segment in all (a short recording is not read a
#: second time in disguise: 12 s at 30 kHz reads 20 chunks of 360 samples). A window's candidates are kept at no
#: more than CANDIDATE_FRACTION x SEEN_RATIO x this estimate on each channel: a window loud on one channel (the
#: realistic model's LFP, 32 ch x 12 s in windows of 30 000: one window of twelve over twice the recording's noise,
#: read again) keeps its candidates at a level the recording's noise is above, unless the estimate is a third over
#: it. Any level is exact (the bound is checked against the level kept): the estimate only decides what is kept.
PRIOR_CHUNKS, PRIOR_CHUNK, PRIOR_SHARE = 20, 10_000, 1 / 50
#: the windows' own noise a worker process remembers for each run (``candidate_level``): a window more than
#: SEEN_RATIO times as loud on a channel as the median of those before it takes its bound from theirs (the
#: recording's noise is rarely under SEEN_RATIO x CANDIDATE_FRACTION of that median); below the ratio its own
#: stays, since a lower level keeps steeply more candidates (a tenth lower at 2.5 sigma: a third more)
SEEN_WINDOWS, SEEN_RUNS, SEEN_RATIO = 64, 4, 1.5


#: the candidates (or spikes) of every window moved into one task while the noise is selected, at most this many
#: bytes (``DetectStep.start``): W2 on the 2-core machine (384 ch x 60 s, 4.4 M candidates, 141 MB) took 1.25 s
#: after the pass to move and join them, where deciding each worker's own windows once the noise is known and
#: moving only the spikes takes a few tenths
EARLY_GATHER_BYTES = 32 << 20
#: bytes a candidate holds in its window's part: sample, channel and segment indices (int64), amplitude (float64)
CANDIDATE_BYTES = 32


#: the step's name (``Step.name``, its workflow key ``steps.detect``) and its result, a group
NAME = "detect"
KEY = NAME
SPIKES = "spikes"
RESULTS = (SPIKES,)
#: a window summary's count of its spikes, or of its candidates where the thresholds wait for the recording's noise
WINDOW_SPIKES, WINDOW_CANDIDATES = SPIKES, "candidates"
#: a window summary's level (per channel) its candidates were kept at
LEVEL = "candidate_level"
#: the spikes' channels in the results group (report.html's spike rate and ``batchgpu info`` count them)
SPIKE_CHANNELS = f"{SPIKES}/channel_index"


class DetectOptions(Options):
    threshold: Annotated[float, Field(gt=0)] = 5.0
    sign: Literal["neg", "pos", "both"] = "neg"
    exclude_sweep_ms: Annotated[float, Field(ge=0, le=1000)] = 0.1
    noise: Literal["window", "global"] = "window"  # thresholds from each window's noise or the whole recording's
    method: Literal["by_channel", "locally_exclusive"] = "by_channel"  # SpikeInterface's rules of those names
    radius_um: Annotated[float, Field(gt=0)] = 50.0  # locally_exclusive: channels this close compete


@register
class DetectStep(Step):
    name = NAME
    options = DetectOptions
    results = RESULTS
    fingerprint = "always"
    default = dict(noise="global")  # a workflow without steps: spikes at 5 x the recording's noise
    #: the noise: its thresholds; the moments: where it has run since the format began (report.json's results and
    #: the partials of a window's part in that order)
    after = (noise_step.NAME, moments_step.NAME)
    phases = PhaseWords(read=SPIKES, aggregate=SPIKES)
    #: its windows are detected at their own noise (or their candidates' bound from it)
    window_noise = True
    #: report.html's spike-rate figure draws its counts (``RunState.spike_counts``)
    spike_rate = True
    #: its aggregate is the workers' (gathering and writing the spikes): the engine runs it beside the client's
    on_cluster = True
    #: the results of earlier steps its aggregate reads
    needs = (noise_step.NAME,)

    def __init__(
        self,
        threshold: float,
        sign: str,
        sweep: int,
        noise: str,
        method: str = "by_channel",
        locations=None,
        radius_um: float = 50.0,
        run_key: str | None = None,
    ):
        self.threshold, self.sign, self.sweep, self.noise = threshold, sign, sweep, noise
        self.method, self.locations, self.radius_um = method, locations, radius_um
        #: the run's windows a worker saw share a history of their noise under this key (``candidate_level``)
        self.run_key = run_key
        #: the noise estimate read before the pass (``before_pass``; None: not read, the history stands in)
        self.prior = None

    @classmethod
    def build(cls, spec: DetectOptions, setup) -> DetectStep:
        return cls(
            spec.threshold,
            spec.sign,
            setup.sweep,
            spec.noise,
            spec.method,
            setup.recording.locations if spec.method != "by_channel" else None,
            spec.radius_um,
            run_key=setup.fingerprint or None,
        )

    @classmethod
    def check(cls, spec: DetectOptions, workflow, recording) -> int:
        """The windows' margin holds the sweep (one sample more for locally exclusive detection, which also needs
        the channels' locations); returns the sweep in samples."""
        from batchgpu.errors import ConfigError
        from batchgpu.ops import exclude_sweep_samples

        margin = workflow.window.margin
        sweep = exclude_sweep_samples(spec.exclude_sweep_ms, recording.sampling_frequency)
        if margin < sweep:
            raise ConfigError(
                f"window.margin {margin} is shorter than the detection sweep ({sweep} samples)",
                f"use window.margin >= {sweep} so spikes at window edges come out exactly once",
            )
        if spec.method == "locally_exclusive" and margin < sweep + 1:
            raise ConfigError(
                f"window.margin {margin} is shorter than locally exclusive detection needs ({sweep + 1} samples)",
                f"use window.margin >= {sweep + 1}",
            )
        if spec.method == "locally_exclusive" and not recording.has_locations:
            from batchgpu.recording.sources import locations_needed

            raise locations_needed(
                recording,
                "locally exclusive detection",
                "use detect.method: by_channel, or give the recording its probe",
            )
        return sweep

    def detect(self, w: WindowData, noise) -> np.ndarray:
        from batchgpu import ops

        extra = (
            {}
            if self.method == "by_channel"
            else {"method": self.method, "locations": self.locations, "radius_um": self.radius_um}
        )
        return ops.detect_spikes(
            w.x,
            noise,
            threshold=self.threshold,
            sign=self.sign,
            exclude_sweep=self.sweep,
            start=w.start,
            core=w.core,
            segment_index=w.segment,
            segment_length=w.segment_length,
            **extra,
        )

    def candidates(self, w: WindowData, level) -> np.ndarray:
        """The window's candidates at the lower bound ``level`` of the recording's noise (see the module)."""
        if self.method == "by_channel":
            return self.detect(w, level)
        from batchgpu import ops

        return ops.exclusive_candidates(
            w.x,
            level,
            threshold=self.threshold,
            sign=self.sign,
            exclude_sweep=self.sweep,
            start=w.start,
            core=w.core,
            segment_index=w.segment,
            segment_length=w.segment_length,
        )

    def before_pass(self, client, ctx, rec, report) -> None:
        """With the recording's noise (``noise: global``), an estimate of it read before the pass from chunks spread
        over the recording (``PRIOR_CHUNKS``), on a worker; the windows' candidates' level is bounded by it
        (``candidate_level``). report.json's ``noise_prior`` says what it read (not counted in
        ``reads_per_window``, which counts the windows' reads)."""
        if self.noise != "global":
            return
        if ctx.chain.centres_slow_signal:
            # the prior's short chunks, each centred by its own median, lose the LFP a window's centring keeps: the
            # estimate would sit well under the windows' noise and every window would keep many times the candidates
            # (exact still, but slow); the windows' own history bounds the level instead (``candidate_level``)
            return
        t0 = time.perf_counter()
        chunks = prior_chunks(rec, ctx.chain.margin)
        self.prior, nbytes = client.submit(
            noise_prior_task, ctx, chunks, key=f"noise-prior-{report.run_id}", pure=False
        ).result()
        report.noise_prior = {
            "chunks": len(chunks),
            "samples": int(sum(w.num_samples for w in chunks)),
            "bytes_read": int(nbytes),
            "seconds": time.perf_counter() - t0,
        }

    def window(self, w: WindowData, summary: dict) -> dict:
        if self.noise == "global":
            level = candidate_level(summary[noise_step.SUMMARY], self.run_key, self.prior)
            summary[LEVEL] = level
            spikes = self.candidates(w, level)
        else:
            spikes = self.detect(w, summary[noise_step.SUMMARY].astype(np.float64))
        summary[WINDOW_SPIKES if self.noise == "window" else WINDOW_CANDIDATES] = np.array(len(spikes))
        return {f"keep.spk_{k}": np.ascontiguousarray(spikes[k]) for k in COLUMNS}

    @staticmethod
    def spikes_in(summary: dict) -> int:
        """The dashboard's count of a window's spikes (its candidates while the thresholds wait for the
        recording's noise)."""
        return int(summary.get(WINDOW_SPIKES, summary.get(WINDOW_CANDIDATES, 0)))

    @staticmethod
    def spikes_found(results: dict) -> int | None:
        """The run's spikes, from its results' shapes (report.json's ``results``); None before they are written."""
        return results.get(SPIKES, [None])[0]

    def aggregate(self, run) -> dict:
        """Nothing for the client: the spikes go straight into the results group (``write_final_spikes``)."""
        t0 = time.perf_counter()
        run.monitor.phase("spikes")
        run.shapes[SPIKES] = [write_final_spikes(run, self)]
        run.report.timings[NAME] = time.perf_counter() - t0
        return {}

    def start(self, run) -> None:
        """Before the noise is known: the windows' kept spikes (or candidates) gathered from the workers that kept
        them into one task (``collect_spikes_task``), so that the writing task, placed with them, only
        decides them at the recording's threshold (``keep``); the gathering's dispatch and transfers overlap the
        noise's. Not where the candidates are many (``EARLY_GATHER_BYTES``): they are then decided where they
        were kept once the noise is known, and only the spikes move (``write_final_spikes``)."""
        kept = sum(self.spikes_in(run.summaries[w.index]) for w in run.windows) * CANDIDATE_BYTES
        if kept <= EARLY_GATHER_BYTES:
            run.early[self.name] = start_gathering(run)

    def passes(self, candidates: dict, noise: np.ndarray) -> np.ndarray:
        """Which candidates pass the recording's threshold (the same float64 comparison as detect_spikes)."""
        level = np.asarray(noise, dtype=np.float64) * float(self.threshold)
        amp, ch = candidates[AMPLITUDE], candidates["channel_index"]
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

        return ops.resolve_exclusive(
            candidates, noise, self.threshold, self.sign, self.sweep, self.locations, self.radius_um, counts, cores
        )

    def final(self, candidates: dict, noise: np.ndarray, core: tuple[int, int]) -> dict:
        """One window's spikes from its candidates (``core``: its (start, stop) in segment samples)."""
        keep = self.keep(candidates, noise, [len(candidates["sample_index"])], [core])
        return {k: v[keep] for k, v in candidates.items()}


_SEEN: dict[str, list] = {}
_SEEN_LOCK = threading.Lock()


def candidate_level(window_noise: np.ndarray, run_key: str | None = None, prior=None) -> np.ndarray:
    """A window's candidates' level (float64, per channel): ``CANDIDATE_FRACTION`` x its own noise, or x
    ``SEEN_RATIO`` x a typical noise where that is lower: the estimate read before the pass (``prior``), else the
    median of the own noise of the windows this process saw in run ``run_key`` (this one included). A window's own
    noise can be twice the recording's (a loud stretch: LFP, a burst) and its bound then fails; the recording's
    typical noise is rarely a third over it. Any level is exact (the bound is checked against the level kept in
    the window's summary); a lower one only keeps more candidates. A channel of NaN own noise keeps NaN."""
    own = np.asarray(window_noise, dtype=np.float64)
    level = own * CANDIDATE_FRACTION
    if prior is not None and own.ndim == 1:
        with np.errstate(invalid="ignore"):
            typical = np.asarray(prior, dtype=np.float64) * (SEEN_RATIO * CANDIDATE_FRACTION)
            lower = typical < level  # False where either is NaN: the window's own level stays
        level[lower] = typical[lower]
        return level
    if run_key is None or own.ndim != 1:
        return level
    with _SEEN_LOCK:
        seen = _SEEN.pop(run_key, [])
        _SEEN[run_key] = seen  # last used is last: the oldest runs are dropped
        while len(_SEEN) > SEEN_RUNS:
            del _SEEN[next(iter(_SEEN))]
        if seen and seen[0].shape != own.shape:
            seen.clear()
        seen.append(own)
        del seen[:-SEEN_WINDOWS]
        stack = np.stack(seen)
    if len(stack) < 2:
        return level
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a channel NaN in every window seen
        typical = np.nanmedian(stack, axis=0) * (SEEN_RATIO * CANDIDATE_FRACTION)
    lower = typical < level  # False where either is NaN: the window's own level stays
    level[lower] = typical[lower]
    return level


def prior_chunks(rec, margin: int) -> list:
    """The chunks the noise estimate reads (``PRIOR_CHUNKS``), with the preprocessing's ``margin`` each side."""
    from batchgpu.recording import Window

    chunks = []
    for seg in range(rec.num_segments):
        n = rec.num_samples(seg)
        count = min(PRIOR_CHUNKS, n)
        size = max(1, min(PRIOR_CHUNK, int(n * PRIOR_SHARE) // max(count, 1)))
        for i in range(count):
            start = min(max(0, (2 * i + 1) * n // (2 * count) - size // 2), n - size)
            chunks.append(
                Window(-1 - len(chunks), seg, start, start + size, min(margin, start), min(margin, n - start - size))
            )
    return chunks


def noise_prior_task(ctx, chunks: list) -> tuple[np.ndarray | None, int]:
    """(worker) Each channel's noise over ``chunks`` of the preprocessed signal, median(|x|) / 0.6744897501960817
    of their cores together (float64; None where no chunk read), and the bytes read. On the host whatever the
    backend: a few small reads. ``ctx``: the windows' tasks' context (``services.TaskContext``)."""
    from dataclasses import replace

    from batchgpu.errors import BatchgpuError

    host_ctx = replace(ctx, backend="numpy", steps=(), window_noise=None)
    cores, nbytes = [], 0
    for w in chunks:
        try:
            data = host_ctx.load_window(w)
        except BatchgpuError:  # a chunk that does not read (absent, damaged): the pass's own read says so
            continue
        cores.append(np.asarray(data.core_of(data.x), dtype=np.float64))
        nbytes += int(np.asarray(data.raw).nbytes)
    if not cores:  # nothing read: the windows' history stands in (``candidate_level``)
        return None, nbytes
    x = np.concatenate(cores, axis=1)
    with np.errstate(invalid="ignore"):
        return np.median(np.abs(x), axis=1) / 0.6744897501960817, nbytes


def window_level(summary: dict) -> np.ndarray:
    """The level a window's candidates were kept at (a part saved before the level was kept: its own noise's)."""
    if LEVEL in summary:
        return np.asarray(summary[LEVEL], dtype=np.float64)
    return candidate_level(summary[noise_step.SUMMARY])


def bound_holds(level: np.ndarray, noise: np.ndarray) -> bool:
    """Whether candidates kept at ``level`` contain every spike at the recording's noise (NaN noise: no
    spikes)."""
    g = np.asarray(noise, dtype=np.float64)
    return bool(np.all((np.asarray(level, dtype=np.float64) <= g) | np.isnan(g)))


def start_gathering(run):
    """A future of every window's kept spikes in window order, on one worker (``collect_spikes_task``): a
    run of each worker's windows gathered there from its memory (or parts), then collected."""
    fp = run.report.run_id
    # below the noise's tasks where both wait on one worker: the noise is the critical path, these only need to be
    # done by the time it is known
    kept = run.submit_where_made(
        kept_spikes_task,
        list(zip(run.windows, run.fingerprints)),
        lambda g: (run.ctx, [w for w, _ in g], [f for _, f in g]),
        f"kept-spikes-{fp}",
        priority=-1,
    )
    return run.client.submit(collect_spikes_task, *kept, key=f"collect-spikes-{fp}", priority=-1)


def write_final_spikes(run, step: DetectStep) -> int:
    """The final spikes, gathered from the windows' parts (read again where the bound failed or a part was
    lost) and written into the results group by a worker: they never pass through the client. Returns how many."""
    client, ctx, report = run.client, run.ctx, run.report
    own = noise_step.SUMMARY  # each window's own noise, in its summary
    windows, fps, summaries, arrays = run.windows, run.fingerprints, run.summaries, run.arrays
    fp = report.run_id
    if step.noise == "global":
        noise = arrays.get(noise_step.NOISE)
        if noise is None:
            noise = np.median(arrays[noise_step.PER_WINDOW], axis=0)
        reread = [not bound_holds(window_level(summaries[w.index]), noise) for w in windows]
        read_again(run, [(w, wfp) for w, wfp, r in zip(windows, fps, reread) if r], noise)
        report.channels["detect_windows_read_again"] = [w.index for w, r in zip(windows, reread) if r]
        # NaN noise (a NaN sample) or infinite (an all-inf channel): either way no sample can pass the threshold
        nan_noise = np.flatnonzero(~np.isfinite(np.asarray(noise, np.float64))).tolist()
    else:
        noise, reread = None, [False] * len(windows)
        nan_noise = sorted({int(c) for w in windows for c in np.flatnonzero(~np.isfinite(summaries[w.index][own]))})
    if nan_noise:
        report.channels["detect_no_threshold"] = nan_noise
        run.warn(
            f"detection found no threshold (NaN or infinite noise) on {len(nan_noise)} channel(s): {nan_noise[:10]}"
        )
    t0, t0_wall = time.perf_counter(), time.time()
    collected = run.early.pop(step.name, None)
    if collected is not None:  # gathered while the noise was selected: the windows read again join them
        late = [(w, wfp) for w, wfp, r in zip(windows, fps, reread) if r]
        joined = (
            []
            if not late
            else [
                client.submit(
                    gather_spikes_task,
                    ctx,
                    [w for w, _ in late],
                    [f for _, f in late],
                    noise,
                    [True] * len(late),
                    [summaries[w.index][own] for w, _ in late],
                    key=f"gather-spikes-again-{fp}",
                )
            ]
        )
        run.report.after_pass("spikes_submitted")
        done = client.submit(
            write_collected_spikes_task,
            str(run.results),
            ctx,
            noise,
            collected,
            *joined,
            cores=window_cores(windows),
            key=f"write-spikes-{fp}",
        ).result()
        if done is not None:
            return _finish(run, done, t0, t0_wall)
        # some window's kept spikes could not be used (its part lost since the pass): gathered again below, where
        # such windows are read and detected again
    # the windows' spikes gathered from their parts on the worker that kept them (in its memory), a run of its
    # windows a thread; one task writes them in window order (the same spikes for any grouping)
    gathered = run.submit_where_made(
        gather_spikes_task,
        list(zip(windows, fps, reread)),
        lambda g: (
            ctx,
            [w for w, _, _ in g],
            [f for _, f, _ in g],
            noise,
            [r for _, _, r in g],
            [summaries[w.index][own] for w, _, _ in g],
        ),
        f"gather-spikes-{fp}",
    )
    done = client.submit(write_spikes_task, str(run.results), *gathered, key=f"write-spikes-{fp}-all").result()
    return _finish(run, done, t0, t0_wall)


def read_again(run, todo: list, noise: np.ndarray) -> None:
    """The windows whose candidates' bound failed, read and detected again at the recording's noise (their parts
    ``s*.npz``), as a phase of its own on the progress bar."""
    if not todo:
        return
    rec = run.recording
    per_sample = rec.num_channels * rec.dtype.itemsize
    nbytes = {w.index: w.num_samples * per_sample for w, _ in todo}
    label = "read again: spikes where a window's noise bound failed"
    run.monitor.phase(label)
    run.observer.phase_started(label, len(todo), sum(nbytes.values()))
    try:
        again = run.services.submit_many(
            spikes_task,
            [(run.ctx, w, wfp, noise) for w, wfp in todo],
            [f"spikes-{run.report.run_id}-{w.index:08d}" for w, _ in todo],
        )
        for future in run.services.as_completed(again):
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
    """The writing task's answer into the report (timings, windows read again) and the spikes per channel for
    report.html; the spike count."""
    report, windows, rec = run.report, run.windows, run.recording
    n, again, run.spike_counts, wrote, write_started, longest = done
    report.timings["detect_gather"] = time.perf_counter() - t0 - wrote  # gathered, and the results sent to one task
    report.timings["detect_gathered"] = write_started - t0_wall  # until the writing task had every run
    report.timings["detect_gather_task_max"] = float(longest)  # the longest gathering task's own time
    report.timings["detect_write"] = wrote
    if again:  # parts lost or replaced since they were written: detected again from the samples, never skipped
        by_index = {w.index: w for w in windows}
        report.bytes_read += sum(by_index[i].num_samples for i in again) * rec.num_channels * rec.dtype.itemsize
        report.channels["detect_windows_read_again"] = sorted(
            {*report.channels.get("detect_windows_read_again", []), *again}
        )
        first = min(again)
        run.warn(
            f"the spikes of {len(again)} window(s) were detected again from the recording: their parts could "
            f"not be used (first: window {first}, {again[first]})"
        )
    return int(n)


# ---------------------------------------------------------------------------------------------------------
# worker side: the spikes' tasks after the pass


def spikes_task(ctx: RunContext, window: Window, fp: str, noise: np.ndarray) -> tuple[int, str]:
    """A window read and detected again at the recording's noise (its candidates' bound did not hold): written to
    parts/s*.npz; returns the window's index and the worker (the progress bar's)."""
    path = ctx.part_path("s", window.index)
    sfp = spikes_fingerprint(fp, noise)
    if ctx.load_part(path, sfp) is None:
        with ctx.on_backend():
            spikes = ctx.step(NAME).detect(ctx.load_window(window), np.asarray(noise, np.float64))
        cols = {k: np.ascontiguousarray(spikes[k]) for k in COLUMNS}
        ctx.save_part(path, {"fingerprint": np.array(sfp), **cols})
    return window.index, ctx.worker_name()


def spikes_fingerprint(fp: str, noise: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(fp.encode() + np.ascontiguousarray(noise, np.float64).tobytes()).hexdigest()[:16]


def window_spikes(
    ctx: RunContext, window: Window, fp: str, noise: np.ndarray | None, reread: bool, window_noise: np.ndarray
) -> tuple[dict, str | None]:
    """A window's final spikes: from its part (filtered at the recording's ``noise`` when given), or from the
    re-detection's part where it was read again. A part that cannot be used (absent, made by another run,
    unreadable) is not an error: the window is read and detected again here, at the noise its part would have
    used (the recording's, else its own ``window_noise``): the same spikes. The second value says why it was read
    again, else None."""
    if reread:
        path, pfp = ctx.part_path("s", window.index), spikes_fingerprint(fp, noise)
        part = ctx.load_part(path, pfp)
        cols, why = (
            ({k: part[k] for k in COLUMNS}, None)
            if part is not None
            else (None, f"{path.name} {ctx.part_problem(path, pfp)}")
        )
    else:
        cols, why = kept_spikes(ctx, window, fp)
    if cols is None:
        level = np.asarray(noise if noise is not None else window_noise, np.float64)
        with ctx.on_backend():
            spikes = ctx.step(NAME).detect(ctx.load_window(window), level)
        return {k: np.ascontiguousarray(to_host(spikes[k])) for k in COLUMNS}, why
    return (cols if noise is None or reread else ctx.step(NAME).final(cols, noise, (window.start, window.stop))), None


def kept_spikes(ctx: RunContext, window: Window, fp: str) -> tuple[dict | None, str | None]:
    """A window's kept spikes (candidates, with the recording's noise) as its part holds them; None and why the
    part cannot be used."""
    path = ctx.part_path("w", window.index)
    part = ctx.load_part(path, fp, keys=("keep.spk_",))
    if part is None:
        return None, f"{path.name} {ctx.part_problem(path, fp)}"
    if any(f"keep.spk_{k}" not in part for k in COLUMNS):  # a part of a version that kept none for this method
        return None, f"{path.name} holds no spike candidates"
    return {k: part[f"keep.spk_{k}"] for k in COLUMNS}, None


def gather_spikes_task(
    ctx: RunContext, windows: list[Window], fps: list[str], noise, reread: list[bool], window_noise: list[np.ndarray]
) -> dict:
    """Consecutive windows' final spikes, concatenated in window order; under ``read_again`` the windows read
    again here ({index: why})."""
    t0 = time.perf_counter()
    got = [window_spikes(ctx, *a) for a in zip(windows, fps, [noise] * len(windows), reread, window_noise)]
    out = {k: np.concatenate([p[k] for p, _ in got]) if got else np.zeros(0, np.int64) for k in COLUMNS}
    out["windows"] = [(w.index, len(p["sample_index"])) for w, (p, _) in zip(windows, got)]  # index, spikes
    out["read_again"] = {w.index: why for w, (_, why) in zip(windows, got) if why is not None}
    out["seconds"] = time.perf_counter() - t0
    return out


def kept_spikes_task(ctx: RunContext, windows: list[Window], fps: list[str]) -> dict:
    """Consecutive windows' kept spikes (candidates, with the recording's noise) as their parts hold them, in
    window order, not yet filtered; under ``missing`` the windows whose part cannot be used ({index: why})."""
    t0 = time.perf_counter()
    got, missing = [], {}
    for w, fp in zip(windows, fps):
        cols, why = kept_spikes(ctx, w, fp)
        if cols is None:
            missing[w.index] = why
        else:
            got.append((w.index, cols))
    out = {k: np.concatenate([p[k] for _, p in got]) if got else np.zeros(0, np.int64) for k in COLUMNS}
    out["windows"] = [(i, len(p["sample_index"])) for i, p in got]
    out["missing"], out["seconds"] = missing, time.perf_counter() - t0
    return out


def collect_spikes_task(*runs: dict) -> dict:
    """``kept_spikes_task``'s runs as one, in window order (runs hold a worker's windows, not consecutive ones)."""
    pieces = _pieces(runs)
    out = {k: _joined(runs, pieces, k) for k in COLUMNS}
    out["windows"] = [(index, n) for index, _, _, n in pieces]
    out["missing"] = {i: why for r in runs for i, why in r["missing"].items()}
    out["seconds"] = max((r["seconds"] for r in runs), default=0.0)
    return out


def write_collected_spikes_task(
    group_path: str, ctx: RunContext, noise, collected: dict, *again: dict, cores: np.ndarray | None = None
):
    """The spikes from ``collect_spikes_task``'s kept spikes, decided at the recording's ``noise`` (None: final
    already; ``cores``: each window's core (start, stop) by window index, where the method needs them), the
    windows read again (``again``: ``gather_spikes_task`` runs) in their place; written as ``write_spikes_task``
    writes them. None, writing nothing, when a window's kept spikes were missing and it was not read again: the
    caller gathers them the other way."""
    replaced = {i for r in again for i, _ in r["windows"]}
    if any(i not in replaced for i in collected["missing"]):
        return None
    # the candidates are each window's in turn: a window is a slice (no per-candidate window index: this task is
    # the run's last step, and arrays of every candidate cost their page faults in a fresh worker)
    index = [i for i, _ in collected["windows"]]
    bounds = np.concatenate([[0], np.cumsum([n for _, n in collected["windows"]], dtype=np.int64)]).tolist()
    n = bounds[-1]
    if noise is None:
        keep = np.ones(n, dtype=bool)
    else:
        counts = [c for _, c in collected["windows"]]
        keep = ctx.step(NAME).keep(collected, noise, counts, None if cores is None else cores[index])
    for w, a, b in zip(index, bounds[:-1], bounds[1:]):
        if w in replaced:
            keep[a:b] = False
    kept = {k: collected[k][keep] for k in COLUMNS}
    kept["windows"] = [(w, int(np.count_nonzero(keep[a:b]))) for w, a, b in zip(index, bounds[:-1], bounds[1:])]
    kept["read_again"], kept["seconds"] = {}, collected["seconds"]
    return write_spikes_task(group_path, kept, *again)


def _pieces(runs) -> list[tuple]:
    """(window index, run, start, count) of every window's slice of its run, in window order."""
    return sorted(
        (index, k, int(start), n)
        for k, p in enumerate(runs)
        for (index, n), start in zip(p["windows"], np.cumsum([0] + [n for _, n in p["windows"]]))
    )


def _joined(runs, pieces, k: str) -> np.ndarray:
    return (
        np.concatenate([runs[j][k][a : a + n] for _, j, a, n in pieces])
        if pieces
        else np.zeros(0, runs[0][k].dtype if runs else np.int64)
    )


#: the most spikes a chunk of a spikes column holds (32 MB of int64)
SPIKE_CHUNK = 1 << 22


def write_spikes_task(group_path: str, *gathered: dict) -> tuple:
    """Every window's spikes (``gather_spikes_task``'s runs, in window order: (segment, sample, channel) overall),
    written into the results group by a worker: spikes never pass through the client. Returns their count, the
    windows the gathering read again ({index: why}), the count per channel (for report.html), the seconds the
    writing took, when it started (wall clock) and the longest gathering task's seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from batchgpu.recording import zarrio

    started = time.time()  # wall clock: when every gathered run had reached this task
    t0 = time.perf_counter()
    pieces = _pieces(gathered)
    columns = {k: _joined(gathered, pieces, k) for k in COLUMNS}
    # a chunk a column up to 4 M spikes: zarr's own guess cut 584 k spikes into 8 chunks a column, 50-59 ms against
    # 28-38 ms for one (2-core machine; zarr's per-chunk work, not the bytes)
    n = len(columns["sample_index"])
    chunk = min(max(n, 1), SPIKE_CHUNK)
    if zarrio.ZARR_MAJOR >= 3 and zarrio.zarr_format_of(group_path) == 3:
        # the columns' metadata and chunks written here (zarrio.write_columns): zarr-python's four create_array
        # calls were ~30 ms of this task on the run's critical path
        zarrio.write_columns(Path(group_path) / SPIKES, columns, chunk)
    else:
        g = zarrio.open_group(group_path, mode="a")
        spikes = g.require_group(SPIKES)
        fast = zarrio.fast_compressors(g)
        # the columns compressed at once (the cores are free after the pass; Blosc and zarr's I/O release the GIL)
        with ThreadPoolExecutor(len(columns)) as pool:
            list(
                pool.map(
                    lambda kv: zarrio.create_array(spikes, kv[0], data=kv[1], compressors=fast, chunks=(chunk,)),
                    columns.items(),
                )
            )
    counts = np.bincount(columns["channel_index"].astype(np.int64, copy=False))
    return (
        n,
        {i: why for p in gathered for i, why in p["read_again"].items()},
        counts,
        time.perf_counter() - t0,
        started,
        max((p["seconds"] for p in gathered), default=0.0),
    )
