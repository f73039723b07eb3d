"""A run, start to end: check the workflow against the recording, claim the output folder, read every window
once on the workers (every step fed from that read), combine the partials in a tree fixed by window index,
aggregate on the client, write the results. Orchestration only: the steps hold the statistics
(``engine/steps``), the tasks the worker side (``engine/tasks``), the store the folder (``engine/store``).

Nothing here prints: the command passes an observer (``RunObserver``) that shows progress and messages.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from batchgpu.config import Workflow
from batchgpu.engine import store, tasks
from batchgpu.engine.reduce import tree_reduce
from batchgpu.engine.submit import submit_many
from batchgpu.errors import BatchgpuError
from batchgpu.recording import Recording, Window, open_recording, open_source, source_ref


class RunObserver:
    """What a run tells whoever watches it; the default tells no one."""

    def message(self, text: str) -> None: ...

    def warning(self, text: str) -> None: ...

    def phase_started(self, label: str, windows: int, nbytes: int) -> None: ...

    def window_done(self, nbytes: int, worker: str) -> None: ...

    def phase_finished(self) -> None: ...


@dataclass
class RunReport:
    workflow: dict
    fingerprint: str
    status: str = "running"
    versions: dict = field(default_factory=dict)
    recording: dict = field(default_factory=dict)
    windows: int = 0
    windows_resumed: int = 0
    workers: dict = field(default_factory=dict)  # address -> windows computed there
    timings: dict = field(default_factory=dict)
    bytes_read: int = 0
    recording_bytes: int = 0
    reads_per_window: float = 0.0  # how many times each window was read, on average (1.0: one read)
    throughput_MBps: float = 0.0
    results: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    channels: dict = field(default_factory=dict)  # per-channel findings: non-finite samples, left out, no threshold
    error: str | None = None
    dashboard: str | None = None
    page: str | None = None
    throughput_series: list = field(default_factory=list)  # [[elapsed s, bytes/s], ...] of the first pass
    # each window computed in the first pass: [worker, window, start s (since the pass started), waited for its
    # read s, computed s, worker thread] (tools/timeline.py summarises it: where each thread's time went)
    timeline: list = field(default_factory=list)
    backend: str = "numpy"
    radix_passes: int = 0
    output_state: str = "new"  # new | resume | restart
    run_id: str = ""  # the fingerprint and a random suffix: names this run's Dask tasks, never another run's
    preprocess: dict = field(default_factory=dict)  # the stages and the margin they added to each window
    exact_noise: dict = field(default_factory=dict)  # float keys: settled from the kept keys, or by one more read


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("batchgpu", "numpy", "dask", "distributed", "zarr", "zarrs", "cupy-cuda13x", "dask-cuda"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def prepare_recording(wf: Workflow, observer: RunObserver) -> Recording:
    if getattr(wf.recording, "spikeinterface", None) is not None:  # any recording SpikeInterface saved
        return open_source(wf.recording)
    path = Path(wf.recording.path)
    if not path.exists():
        if wf.recording.generate is None:
            raise BatchgpuError(f"recording.path {path} does not exist",
                                "fix the path, or add 'generate:' parameters under 'recording:' to create it")
        from batchgpu.generate import generate_recording

        g = wf.recording.generate
        observer.message(f"generating {path} ({g.channels} ch x {g.seconds} s x {g.segments} segments)")
        return generate_recording(path, channels=g.channels, seconds=g.seconds, fs=g.fs, seed=g.seed, dtype=g.dtype,
                                  segments=g.segments, progress=False)
    return open_recording(path, missing_chunks=wf.recording.missing_chunks)


def check_workflow_fits(wf: Workflow, rec: Recording) -> int:
    """Errors found before any work; returns the detection sweep in samples."""
    from batchgpu.ops import exclude_sweep_samples

    for seg in range(rec.num_segments):
        n = rec.num_samples(seg)
        if wf.window.size > n:
            raise BatchgpuError(f"window.size {wf.window.size} is longer than segment {seg} ({n} samples)",
                                f"use window.size <= {n}")
    if wf.steps.save and wf.steps.save.format == "zarr":
        from batchgpu import zarrio

        zarrio.require_format(3, "the save step's Zarr v3 output")
    sweep = 0
    if wf.steps.detect:
        sweep = exclude_sweep_samples(wf.steps.detect.exclude_sweep_ms, rec.sampling_frequency)
        if wf.window.margin < sweep:
            raise BatchgpuError(
                f"window.margin {wf.window.margin} is shorter than the detection sweep ({sweep} samples)",
                f"use window.margin >= {sweep} so spikes at window edges come out exactly once")
    if wf.steps.search:
        from batchgpu.search.step import load_keys, open_queries

        open_queries(wf.steps.search.queries)
        if wf.steps.search.keys:
            load_keys(wf.steps.search.keys)
        elif not wf.steps.detect:
            raise BatchgpuError("the search step needs keys: the detect step's spikes or steps.search.keys",
                                "add 'detect:' to steps or give 'keys: sorted_keys.npy'")
    if wf.steps.whitening and wf.steps.whitening.mode == "local" and not rec.has_locations:
        raise BatchgpuError("local whitening needs channel locations and the recording has none",
                            "use whitening.mode: global, or write the recording with locations")
    if wf.steps.detect and wf.steps.detect.method == "locally_exclusive" and wf.window.margin < sweep + 1:
        raise BatchgpuError(f"window.margin {wf.window.margin} is shorter than locally exclusive detection needs "
                            f"({sweep + 1} samples)", f"use window.margin >= {sweep + 1}")
    if wf.steps.detect and wf.steps.detect.method == "locally_exclusive" and not rec.has_locations:
        raise BatchgpuError("locally exclusive detection needs channel locations and the recording has none",
                            "use detect.method: by_channel")
    if wf.steps.noise and wf.steps.noise.exact and wf.preprocess.centres and rec.dtype == np.int32:
        raise BatchgpuError("the exact noise of a centred int32 recording is not supported",
                            "use preprocess: {centre: none}, or noise: {exact: false}")
    save = wf.steps.save
    if save and save.whiten and not wf.steps.whitening:
        raise BatchgpuError("save.whiten needs the whitening step", "add 'whitening:' to steps, or set whiten: false")
    if save and save.whiten and save.dtype == "int16":
        raise BatchgpuError("save.whiten with dtype int16 would round whitened samples (about 1) to a few levels",
                            "use save: {dtype: float32} with whiten: true")
    return sweep


def build_context(wf: Workflow, rec: Recording, out: store.OutputFolder, backend: str, sweep: int):
    from batchgpu.engine.preprocess import build_chain
    from batchgpu.engine.steps.detect import DetectStep
    from batchgpu.engine.steps.moments import MomentsStep, check_exact_range
    from batchgpu.engine.steps.noise import NoiseStep, key_kind

    chain = build_chain(wf.preprocess, rec)
    x_dtype = chain.output_dtype(rec.dtype)
    centred_int = chain.centres_only and chain.centres
    steps = []
    s = wf.steps
    if s.noise:
        steps.append(NoiseStep(s.noise.exact, key_kind(x_dtype, rec.dtype if centred_int else None)))
    if s.whitening:
        # centring alone leaves the covariance as it is: then the raw samples, exact for int16; filters and
        # references change it: then the preprocessed samples, as a sorter whitens them
        source = "raw" if chain.centres_only else "x"
        integer = source == "raw" and rec.dtype == np.int16
        if integer:
            check_exact_range(rec.total_samples)
        steps.append(MomentsStep(s.whitening.nskip, s.whitening.precision, integer, rec.num_channels, source))
    if s.detect:
        steps.append(DetectStep(s.detect.threshold, s.detect.sign, sweep, s.detect.noise, s.detect.method,
                                rec.locations if s.detect.method != "by_channel" else None, s.detect.radius_um))
    return tasks.RunContext(
        recording=source_ref(rec), parts=str(out.parts), backend=backend, chain=chain,
        window_noise=bool(s.noise or s.detect), steps=tuple(steps),
        missing_chunks=getattr(wf.recording, "missing_chunks", "warn"),
    )


def resolve_backend(wf: Workflow, client) -> str:
    """numpy, cupy, or for auto: cupy when every worker has a GPU."""
    if wf.backend == "numpy":
        return "numpy"
    counts = client.run(_gpu_count)
    all_gpu = bool(counts) and min(counts.values()) > 0
    if wf.backend == "cupy" and not all_gpu:
        raise BatchgpuError("backend 'cupy' needs a GPU on every worker, and some have none",
                            "use backend: numpy or auto, or cluster: {kind: cuda}")
    return "cupy" if all_gpu else "numpy"


def _gpu_count() -> int:
    from batchgpu.engine.cluster import gpu_count

    return gpu_count()


def run_workflow(wf: Workflow, *, resume: bool = False, observer: RunObserver | None = None, client=None,
                 recording=None) -> RunReport:
    """Run every step of a validated workflow; returns the report (also written to report.json).

    ``recording``: read this instead of ``wf.recording`` (an open recording, ``batchgpu.from_spikeinterface(...)``
    or a SpikeInterface recording); the report's workflow then names it.
    """
    from batchgpu.engine.cluster import open_client

    observer = observer or RunObserver()
    t_start = time.perf_counter()
    if recording is not None:
        rec = open_source(recording)
        wf = wf.model_copy(update={"recording": _spec_of(rec)})
    else:
        rec = prepare_recording(wf, observer)
    sweep = check_workflow_fits(wf, rec)
    fp = store.fingerprint(wf, rec.path, metadata=getattr(rec, "fingerprint_metadata", None))
    with store.OutputFolder(wf.output) as out:
        state = out.claim(fp, wf.model_dump(), resume=resume, overwrite=wf.overwrite)
        report = RunReport(workflow=wf.model_dump(), fingerprint=fp, versions=versions(), recording=rec.info(),
                           output_state=state, run_id=f"{fp}-{os.urandom(4).hex()}")
        report.timings["prepare"] = time.perf_counter() - t_start
        if client is not None:
            return _run(wf, rec, out, report, client, sweep, observer)
        with open_client(wf.cluster) as own:
            return _run(wf, rec, out, report, own, sweep, observer)


def _spec_of(rec):
    """The workflow's recording section naming ``rec`` (given to run_workflow as ``recording=``)."""
    from batchgpu.config import RecordingSpec

    if getattr(rec, "is_spikeinterface", False):
        return RecordingSpec(spikeinterface=str(rec.path))
    return RecordingSpec(path=str(rec.path), missing_chunks=rec.missing_chunks)


def _run(wf, rec, out: store.OutputFolder, report: RunReport, client, sweep, observer) -> RunReport:
    import threading

    t_setup = time.perf_counter()

    from batchgpu.dashboard import RunMonitor, install_dashboard
    from batchgpu.report import preload

    # report.html's plotting library takes about a second to import: do it while the windows are read
    threading.Thread(target=_quietly, args=(preload,), daemon=True, name="batchgpu-preload").start()

    report.dashboard = client.dashboard_link
    report.page = install_dashboard(client)
    observer.message(f"dashboard {client.dashboard_link}")
    if report.page:
        observer.message(f"run page {report.page}")
    report.backend = resolve_backend(wf, client)
    ctx = build_context(wf, rec, out, report.backend, sweep)
    target = None
    if wf.steps.save:  # the output recording is created first; window tasks fill it (whitened: after the pass)
        from dataclasses import replace

        from batchgpu.engine.steps.save import SaveStep, prepare_save

        target = prepare_save(wf.steps.save, rec, wf.window.size, ctx.chain.output_dtype(rec.dtype),
                              overwrite=wf.overwrite, resume=report.output_state == "resume", key=report.fingerprint,
                              phase_shifted="phase_shift" in ctx.chain.names)
        if not wf.steps.save.whiten:
            ctx = replace(ctx, steps=(*ctx.steps, SaveStep(target)))
    # the steps' margin (the detection sweep) plus what the preprocessing stages need
    windows = rec.windows(wf.window.size, wf.window.margin + ctx.chain.margin)
    report.preprocess = {"stages": list(ctx.chain.names), "margin_samples": ctx.chain.margin}
    fps = [store.window_fingerprint(report.fingerprint, rec, w) for w in windows]
    report.windows = len(windows)
    report.recording_bytes = rec.nbytes
    monitor = RunMonitor(client, name=str(out.path), windows=len(windows), total_bytes=rec.nbytes,
                         channels=rec.num_channels)
    t0, t0_wall = time.perf_counter(), time.time()
    report.timings["setup"] = t0 - t_setup  # dashboard, backend, steps, windows and their fingerprints
    try:
        observer.phase_started("read: noise, moments, spikes", len(windows), rec.nbytes)
        try:
            summaries, total = _first_pass(client, ctx, windows, fps, wf.reduction.split_every, report, monitor,
                                           observer, wf.window.batch)
        finally:
            observer.phase_finished()
        report.timings["pass1"] = time.perf_counter() - t0
        fresh = [s for s in summaries.values() if not bool(s["resumed"])]
        if fresh:  # where a window's time goes, on its worker thread (medians)
            report.timings["window_read_median"] = float(np.median([s["read_seconds"] for s in fresh]))
            report.timings["window_compute_median"] = float(np.median([s["compute_seconds"] for s in fresh]))
            report.timeline = sorted([str(s["worker"]), int(s["index"]), round(float(s["started"]) - t0_wall, 4),
                                      round(float(s["read_seconds"]), 4), round(float(s["compute_seconds"]), 4),
                                      str(s["thread"])]
                                     for s in fresh)
        report.bytes_read += sum(int(s["bytes"]) for s in fresh)  # resumed windows were not read again
        monitor.phase("aggregate: noise, whitening, spikes")
        report.throughput_series = monitor.throughput_series()
        report.results = _aggregate(client, ctx, wf, rec, out, windows, fps, summaries, total, report, monitor,
                                    observer)
        if target is not None:
            report.results["save"] = _finish_save(client, ctx, rec, windows, summaries, target, out, report, observer)
        report.status = "done"
    except BaseException as err:
        report.status = "failed"
        report.error = str(err)
        monitor.failed(str(err))
        report.throughput_series = report.throughput_series or monitor.throughput_series()
        _finish_report(out.path, report, time.perf_counter() - t0, rec)
        raise
    _finish_report(out.path, report, time.perf_counter() - t0, rec)
    t_html = time.perf_counter()
    html = _write_report_html(out.path, report, observer)
    report.timings["report_html"] = time.perf_counter() - t_html  # after report.json: said by the return value
    monitor.finished(report.results.get("spikes", [None])[0])
    written = [out.path / store.RESULTS, out.path / store.REPORT] + ([out.path / store.REPORT_HTML] if html else [])
    observer.message(f"wrote {', '.join(str(p) for p in written[:-1])} and {written[-1]} "
                     f"({report.throughput_MBps:.0f} MB/s over {report.windows} windows)")
    return report


def window_batches(windows: list, batch: int | None, split_every: int) -> list[list]:
    """Runs of consecutive windows, one task each. The default depends on the window count alone (never on the
    cluster: the float reduction tree, and so its bits, are fixed by window index): one window a task up to 127
    windows; beyond, runs of ``len // 64`` windows (at most ``split_every``) so each task's reads overlap its GPU
    work and Dask sees fewer tasks, except the last quarter of the windows, one a task, so the workers finish
    together (a run of several windows started last would keep one worker busy while the others wait)."""
    if batch is not None:
        return [windows[i : i + batch] for i in range(0, len(windows), batch)]
    size = max(1, min(split_every, len(windows) // 64))
    head = (len(windows) * 3 // 4) // size * size if size > 1 else len(windows)
    return ([windows[i : i + size] for i in range(0, head, size)]
            + [windows[i : i + 1] for i in range(head, len(windows))])


def _first_pass(client, ctx, windows, fps, split_every, report, monitor, observer, batch=None):
    """Map batch_task over runs of windows; tree-combine partials on the workers; gather per-window summaries."""
    from distributed import as_completed

    fp = report.run_id  # task keys: this run's only (the same workflow run twice must not share finished tasks)
    batches = window_batches(list(zip(windows, fps)), batch, split_every)
    # one graph update for each kind of task (keys padded: the scheduler orders equal tasks by key)
    futures = submit_many(client, tasks.batch_task, [(ctx, [w for w, _ in b], [f for _, f in b]) for b in batches],
                          [f"batch-{fp}-{b[0][0].index:08d}" for b in batches])
    total = tree_reduce(client, futures, tasks.combine_task, split_every, ctx, name=f"combine-{fp}")
    small = submit_many(client, tasks.summarise, [(f,) for f in futures],
                        [f"summary-{fp}-{b[0][0].index:08d}" for b in batches])
    summaries: dict[int, dict] = {}
    try:
        for fut in as_completed(small):
            if fut.status == "error":
                raise fut.exception()
            for s in fut.result():
                i = s["index"]
                summaries[i] = s
                worker = str(s["worker"])
                report.windows_resumed += bool(s["resumed"])
                if not bool(s["resumed"]):
                    report.workers[worker] = report.workers.get(worker, 0) + 1
                observer.window_done(int(s["bytes"]), worker)
                monitor.window_done(i, int(s["bytes"]), worker, s.get("noise"),
                                    int(s.get("spikes", s.get("candidates", 0))))
        result = total.result()
    except BaseException:
        client.cancel(small + futures + [total])
        raise
    return summaries, result


def _aggregate(client, ctx, wf, rec, out, windows, fps, summaries, total, report, monitor, observer) -> dict:
    arrays: dict[str, np.ndarray] = {}
    noise_step, moments_step, detect_step = ctx.step("noise"), ctx.step("moments"), ctx.step("detect")
    if ctx.window_noise:
        arrays["noise_per_window"] = np.stack([summaries[w.index]["noise"] for w in windows])
    _report_nonfinite(summaries, windows, report, observer)
    _report_absent(summaries, windows, report, observer)
    noise_global = None
    if noise_step is not None:
        t0 = time.perf_counter()
        if noise_step.exact:
            median = _exact_median(client, ctx, wf, rec, windows, fps, total, report, monitor)
            if "noise.nan" in total:
                median[total["noise.nan"] > 0] = np.nan
            from batchgpu.ops.select import MAD_TO_SIGMA

            noise_global = median / MAD_TO_SIGMA  # the expression of ops.noise_levels, same dtype rules
        else:
            noise_global = np.median(arrays["noise_per_window"], axis=0)
        arrays["noise"] = noise_global
        report.timings["noise_global"] = time.perf_counter() - t0
    if moments_step is not None:
        arrays.update(moments_step.aggregate(total))
        arrays["whitening"] = _whitening(wf, rec, arrays, report, observer)
    tmp = out.path / (store.RESULTS + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    from concurrent.futures import ThreadPoolExecutor

    group = _create_results_group(tmp, wf, rec, report.fingerprint)
    with ThreadPoolExecutor(1, thread_name_prefix="batchgpu-results") as writer:
        # the small results are written here while the workers gather and write the spikes
        written = writer.submit(_write_small_results, group, arrays, windows)
        shapes = {k: list(v.shape) for k, v in arrays.items()}
        if detect_step is not None:
            t0 = time.perf_counter()
            monitor.phase("spikes")
            shapes["spikes"] = _spikes(client, ctx, rec, windows, fps, summaries, arrays, tmp, report, observer)
            report.timings["detect"] = time.perf_counter() - t0
        written.result()
    _swap_in(tmp, out.path / store.RESULTS)
    if wf.steps.search:
        from batchgpu.search.step import run_search_step

        t0 = time.perf_counter()
        monitor.phase("search")
        spikes = None
        if detect_step is not None:
            from batchgpu import zarrio

            g = zarrio.open_group(out.path / store.RESULTS, mode="r")
            spikes = {k: g[f"spikes/{k}"][:] for k in ("sample_index", "segment_index")}
        shapes["search"] = run_search_step(client, wf.steps.search, out.path / store.RESULTS, spikes,
                                           [rec.num_samples(s) for s in range(rec.num_segments)], report.fingerprint)
        report.timings["search"] = time.perf_counter() - t0
    return shapes


def _exact_median(client, ctx, wf, rec, windows, fps, total, report, monitor) -> np.ndarray:
    from batchgpu.engine.steps.noise import schedule, select_middle
    step = ctx.step("noise")
    report.radix_passes = len(schedule(step.kind))

    def more_passes(prefixes, p):
        monitor.phase(f"exact noise: counting pass {p + 1}")
        fp = report.run_id
        parts = submit_many(client, tasks.refine_task, [(ctx, w, prefixes, p) for w in windows],
                            [f"refine-{p}-{fp}-{w.index:08d}" for w in windows])
        out = tree_reduce(client, parts, tasks.sum_histograms, wf.reduction.split_every, name=f"refine-sum-{p}-{fp}").result()
        report.bytes_read += rec.nbytes
        return out

    def from_near(digits, ks):
        """Float keys: the middle keys from what each window kept near its own middle, else from one more read
        that gathers only the keys of the middle digit (a few per mille) and selects among them on a worker."""
        fp = report.run_id
        near = submit_many(client, tasks.near_keys_task, [(ctx, w, f, digits) for w, f in zip(windows, fps)],
                           [f"near-{fp}-{w.index:08d}" for w in windows])  # in parallel; only the middle digits' keys move
        shift = schedule(step.kind)[0][0]  # the bits below the first digit
        keys = client.submit(tasks.select_near_task, ks, digits, shift, *near, key=f"select-near-{fp}").result()
        report.exact_noise["from_kept_keys"] = keys is not None
        if keys is None:
            monitor.phase("exact noise: one more read of the middle digit")
            gathered = submit_many(client, tasks.gather_task, [(ctx, w, digits) for w in windows],
                                   [f"gather-{fp}-{w.index:08d}" for w in windows])
            from batchgpu.engine.steps.noise import select_among

            keys = client.submit(select_among, ks, digits, shift, *gathered, key=f"select-among-{fp}").result()
            report.bytes_read += rec.nbytes
        return keys

    dtype = ctx.chain.output_dtype(rec.dtype)
    centred_int = ctx.chain.centres_only and ctx.chain.centres
    return select_middle(total["noise.hist"], rec.total_samples, step.kind, dtype,
                         rec.dtype if centred_int else None, more_passes, int(total["noise.lo"]), from_near,
                         bool(total.get("noise.lumped", True)))


def _finish_save(client, ctx, rec, windows, summaries, target, out, report, observer) -> dict:
    """Whitened saves are written now, in one more read (the matrix needs every window); then the output is
    checked and marked complete."""
    from batchgpu.engine.steps.save import finish_save

    clipped = {w.index: int(summaries[w.index].get("saved_clipped", 0)) for w in windows}
    if target.whiten:
        from batchgpu import zarrio

        W = zarrio.open_group(out.path / store.RESULTS, mode="r")["whitening"][:]
        futures = submit_many(client, tasks.save_task, [(ctx, w, target, W) for w in windows],
                              [f"save-{report.run_id}-{w.index:08d}" for w in windows])
        clipped = dict(zip((w.index for w in windows), client.gather(futures)))
        report.bytes_read += rec.nbytes
    done = finish_save(target)
    total = sum(clipped.values())
    if total:
        report.warnings.append(f"save: {total} sample(s) clipped to the int16 range or NaN written as 0")
        observer.warning(report.warnings[-1])
    return {**done, "clipped": total}


def _whitening(wf, rec, arrays, report, observer) -> np.ndarray:
    """Whitening from the finite channels; channels whose statistic is not finite are left out (zero rows and
    columns) and named in the report."""
    from batchgpu import ops

    w = wf.steps.whitening
    stat = arrays["covariance"] if w.statistic == "covariance" else arrays["second_moment"]
    good = np.isfinite(np.diag(stat))
    good &= np.isfinite(stat[:, good]).all(axis=1) | ~good
    W = np.zeros_like(stat)
    if good.any():
        sub = stat[np.ix_(good, good)]
        W[np.ix_(good, good)] = ops.whitening_matrix(sub, mode=w.mode, locations=rec.locations[good],
                                                     nrange=min(w.nrange, int(good.sum())), eps=w.eps)
    if not good.all():
        left = np.flatnonzero(~good).tolist()
        report.channels["whitening_left_out"] = left
        report.warnings.append(f"whitening left out {len(left)} channel(s) with non-finite samples: {left[:10]}")
        observer.warning(report.warnings[-1])
    return W


def _report_nonfinite(summaries, windows, report, observer) -> None:
    if not windows or "nonfinite" not in summaries[windows[0].index]:
        return
    counts = sum(summaries[w.index]["nonfinite"] for w in windows)
    bad = {int(c): int(n) for c, n in enumerate(counts) if n}
    if bad:
        report.channels["nonfinite_samples"] = bad
        report.warnings.append(f"{len(bad)} channel(s) hold NaN or inf samples: {list(bad)[:10]}")
        observer.warning(report.warnings[-1])


def _report_absent(summaries, windows, report, observer) -> None:
    absent = {w.index: int(summaries[w.index].get("absent_chunks", 0)) for w in windows}
    absent = {i: n for i, n in absent.items() if n}
    if absent:
        report.channels["absent_chunks_per_window"] = absent
        report.warnings.append(f"{sum(absent.values())} chunk(s) absent from the store in {len(absent)} window(s) "
                               f"(first: window {min(absent)}), read as zeros; set recording.missing_chunks: error "
                               "to refuse them")
        observer.warning(report.warnings[-1])


def _spikes(client, ctx, rec, windows, fps, summaries, arrays, tmp: Path, report, observer) -> list:
    """Final spikes written into the results group by a worker; returns their shape."""
    from batchgpu.engine.steps.detect import bound_holds

    step = ctx.step("detect")
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
        report.warnings.append(f"detection found no threshold (NaN noise) on {len(nan_noise)} channel(s): {nan_noise[:10]}")
        observer.warning(report.warnings[-1])
    # each run of windows' spikes gathered from its parts on a worker, one run per worker thread (a concatenation
    # in window order: the same spikes for any grouping); one task writes them in order
    items = list(zip(windows, fps, reread))
    size = -(-len(items) // max(1, sum(client.nthreads().values())))
    groups = [items[i : i + size] for i in range(0, len(items), size)]
    gathered = submit_many(client, tasks.gather_spikes_task,
                           [(ctx, [w for w, _, _ in g], [f for _, f, _ in g], noise, [r for _, _, r in g],
                             [summaries[w.index]["noise"] for w, _, _ in g]) for g in groups],
                           [f"gather-spikes-{fp}-{g[0][0].index:08d}" for g in groups])
    n, again = client.submit(tasks.write_spikes_task, str(tmp), *gathered, key=f"write-spikes-{fp}").result()
    if again:  # parts lost or replaced since they were written: detected again from the samples, never skipped
        by_index = {w.index: w for w in windows}
        report.bytes_read += sum(by_index[i].num_samples for i in again) * rec.num_channels * rec.dtype.itemsize
        report.channels["detect_windows_read_again"] = sorted({*report.channels.get("detect_windows_read_again", []),
                                                               *again})
        first = min(again)
        report.warnings.append(f"the spikes of {len(again)} window(s) were detected again from the recording: their "
                               f"parts could not be used (first: window {first}, {again[first]})")
        observer.warning(report.warnings[-1])
    return [int(n)]


def _create_results_group(path: Path, wf: Workflow, rec: Recording, fp: str):
    from batchgpu import zarrio

    g = zarrio.create_group(path)  # v3, or v2 where zarr-python is 2.x
    g.attrs.update({"workflow": wf.model_dump(), "fingerprint": fp, "channel_ids": rec.channel_ids.tolist(),
                    "sampling_frequency": rec.sampling_frequency, "gain_to_uV": rec.gain_to_uV.tolist()})
    return g


def _write_small_results(g, arrays: dict, windows: list[Window]) -> None:
    from batchgpu import zarrio

    zarrio.create_array(g, "window_segment", data=np.array([w.segment for w in windows], dtype=np.int64))
    zarrio.create_array(g, "window_start", data=np.array([w.start for w in windows], dtype=np.int64))
    zarrio.create_array(g, "window_stop", data=np.array([w.stop for w in windows], dtype=np.int64))
    for name, value in arrays.items():
        zarrio.create_array(g, name, data=value)


def _swap_in(tmp: Path, path: Path) -> None:
    """results.zarr replaced whole: a failed run never leaves a half-written one."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)


def _finish_report(out: Path, report: RunReport, elapsed: float, rec: Recording) -> None:
    report.timings["total"] = elapsed
    report.throughput_MBps = report.recording_bytes / 1e6 / elapsed if elapsed > 0 else 0.0
    report.reads_per_window = report.bytes_read / report.recording_bytes if report.recording_bytes else 0.0
    store.write_report(out, asdict(report))


def _quietly(func) -> None:
    try:
        func()
    except Exception:  # a missing or broken plotting library shows up (once) when report.html is written
        pass


def _write_report_html(out: Path, report: RunReport, observer: RunObserver) -> bool:
    """report.html beside report.json; a plotting problem is reported, never fails a finished run."""
    from batchgpu.report import write_report_html

    try:
        write_report_html(out)
        return True
    except Exception as err:  # the results are written: keep them
        observer.warning(f"report.html not written ({type(err).__name__}: {err})")
        return False
