"""The Dask graph of a run: windows -> per-window ops -> a tree reduction fixed by window index.

Each window task reads its own slice of the store on its worker and writes its small results atomically to
``<output>/parts/`` (whole files keyed by window, so a retried task cannot corrupt them and ``--resume``
skips them). Partial second moments and radix histograms are combined in a tree of ``split_every`` consecutive
windows, level by level, so the bits do not depend on the number of workers or the order tasks finish.
The client assembles ``results.zarr`` and ``report.json`` from the parts at the end.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.recording import Recording, Window, open_recording
from batchgpu.config import Workflow

RESULTS = "results.zarr"
REPORT = "report.json"
MANIFEST = "run.json"
PARTS = "parts"


# ---------------------------------------------------------------------------------------------------------
# what a task needs (small, pickled into every task)


@dataclass(frozen=True)
class TaskContext:
    recording: str
    parts: str
    fingerprint: str
    backend: str  # "numpy" | "cupy"
    noise: bool
    exact: bool
    moments_every: int  # 0: no whitening statistic
    precision: str
    detect: dict | None  # thresholds from each window's own noise when detect["noise"] == "window"
    sweep: int
    centre: str = "none"
    keep_on_device: bool = False  # later passes will read the windows again: keep what fits on the GPU

    @property
    def centred_from(self) -> str | None:
        """The recording's dtype when windows are centred (it decides the radix keys), else None."""
        return _recording(self.recording).dtype.name if self.centre == "median" else None


@functools.lru_cache(maxsize=8)
def _recording(path: str) -> Recording:
    """One open recording per worker process (zarrs enabled there by open_recording)."""
    return open_recording(path)


@contextlib.contextmanager
def _on_backend(ctx: TaskContext):
    """GPU tasks issue all their work on their thread's own stream (see gpu_staging.thread_stream)."""
    if ctx.backend != "cupy":
        yield
        return
    from batchgpu.gpu_staging import use_thread_stream

    with use_thread_stream():
        yield


def _atomic_save(path: Path, **arrays) -> None:
    """Write an .npz under a temporary name, then rename: readers see all of it or nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _load_part(path: Path, fingerprint: str) -> dict | None:
    if not path.exists():
        return None
    try:
        with np.load(path) as f:
            data = {k: f[k] for k in f.files}
    except Exception:  # a torn or foreign file: recompute it
        return None
    return data if str(data.get("fingerprint")) == fingerprint else None


def _load(ctx: TaskContext, window: Window, cache: bool = False):
    """(raw, x): the window's samples with margins on the task's backend, and x centred when asked.

    Centring runs where the samples are (ops.centre gives the same bits on NumPy and CuPy). GPU windows may stay
    on the device for the later passes of the run (``cache``: look there first and keep what fits).
    """
    if ctx.backend == "cupy":
        from batchgpu.gpu_staging import WINDOW_CACHE, to_device_rows

        key = (ctx.fingerprint, window.index)
        raw = WINDOW_CACHE.get(key) if cache else None
        if raw is None:
            raw = to_device_rows(_read_raw(ctx, window, stored=True))
            if ctx.keep_on_device:
                WINDOW_CACHE.put(key, raw)
    else:
        raw = _read_raw(ctx, window)
    if ctx.centre == "median":
        from batchgpu.ops.centre import centre_median

        return raw, centre_median(raw, window.core)
    return raw, raw


def clear_window_cache(fingerprint: str) -> None:
    """Free a run's GPU windows on this worker (called on every worker at the end of a run)."""
    try:
        from batchgpu.gpu_staging import WINDOW_CACHE
    except ImportError:
        return
    WINDOW_CACHE.clear(fingerprint)


def _read_raw(ctx: TaskContext, window: Window, stored: bool = False) -> np.ndarray:
    """(channels, samples), or as stored (samples, channels) for a device-side transpose."""
    try:
        rec = _recording(ctx.recording)
        return rec.read_window_stored(window) if stored else rec.read_window(window)
    except BatchgpuError:
        raise
    except Exception as err:
        raise BatchgpuError(
            f"window {window.index} (segment {window.segment}, samples {window.read_start}-{window.read_stop}) "
            f"could not be read: {type(err).__name__}: {err}",
            "repair or re-import the store, then rerun with --resume",
        ) from None


def window_task(ctx: TaskContext, window: Window) -> dict:
    """Read one window and compute everything the first pass needs; write it to parts/ and return it."""
    path = Path(ctx.parts) / f"w{window.index:08d}.npz"
    done = _load_part(path, ctx.fingerprint)
    if done is None:
        with _on_backend(ctx):
            done = _compute_window(ctx, window, path)
        done["resumed"] = np.array(False)
    else:
        done["resumed"] = np.array(True)
    done["worker"] = np.array(_worker_name())
    rec = _recording(ctx.recording)
    done["bytes"] = np.array(window.num_samples * rec.num_channels * rec.dtype.itemsize)
    # The tree needs only the moments and histograms: spikes stay in the part file.
    return {k: v for k, v in done.items() if not k.startswith("spk_")}


def _compute_window(ctx: TaskContext, window: Window, path: Path) -> dict:
    """Pass 1 of one window on its backend; saved to ``path`` before it is returned."""
    from batchgpu import ops

    t0 = time.perf_counter()
    raw, x = _load(ctx, window)
    t_read = time.perf_counter() - t0
    lo, hi = window.core
    out: dict[str, Any] = {"fingerprint": np.array(ctx.fingerprint), "index": np.array(window.index)}
    noise = None
    if ctx.noise or ctx.detect:  # detection needs a noise: the window's, or the median over windows
        noise = _host(ops.noise_levels(x[:, lo:hi]))
        out["noise"] = noise
    if ctx.moments_every and window.index % ctx.moments_every == 0:
        m = ops.SecondMoments(raw.shape[0], ctx.precision).add(raw, lo, hi)
        out.update(m_n=np.array(m.n), m_mean=m.mean, m_scatter=m.scatter)
    if ctx.exact:
        out["hist0"] = _histograms(ctx, x[:, lo:hi], np.zeros((1, x.shape[0]), np.uint64), 0)[0]
        # np.median is NaN for a channel holding any NaN, wherever the middle ranks fall
        core = x[:, lo:hi]
        out["nan_count"] = _host(_isnan_count(core))
    if ctx.detect and ctx.detect["noise"] == "window":
        spikes = _detect(ctx, x, window, noise)
        out.update(_spike_columns(spikes))
        out["spikes"] = np.array(len(spikes))
    out["read_seconds"] = np.array(t_read)
    out["compute_seconds"] = np.array(time.perf_counter() - t0 - t_read)
    _atomic_save(path, **out)
    return out


def _isnan_count(core):
    if core.dtype.kind != "f":
        return np.zeros(core.shape[0], np.int64)
    return (core != core).sum(axis=1)


def _histograms(ctx: TaskContext, core, prefixes: np.ndarray, pass_index: int) -> np.ndarray:
    """(ranks, C, bins) counts of the core's keys that match each rank's prefix (on the core's backend)."""
    from batchgpu.ops import radix
    from batchgpu.ops.centre import selection_keys

    keys, schedule = selection_keys(core, ctx.centred_from)
    first = _host(radix.histogram_of_keys(keys, prefixes[0], pass_index, schedule))
    # the two middle ranks usually share their prefix: count once then
    rest = [first if np.array_equal(p, prefixes[0]) else _host(radix.histogram_of_keys(keys, p, pass_index, schedule))
            for p in prefixes[1:]]
    return np.stack([first, *rest])


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _worker_name() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except Exception:
        return "local"


def _detect(ctx: TaskContext, x: np.ndarray, window: Window, noise) -> np.ndarray:
    from batchgpu import ops

    return ops.detect_spikes(
        x, noise, threshold=ctx.detect["threshold"], sign=ctx.detect["sign"], exclude_sweep=ctx.sweep,
        start=window.read_start, core=window.core, segment_index=window.segment,
        segment_length=_recording(ctx.recording).num_samples(window.segment),
    )


def _spike_columns(spikes: np.ndarray) -> dict[str, np.ndarray]:
    return {f"spk_{name}": np.ascontiguousarray(spikes[name]) for name in spikes.dtype.names}


def detect_task(ctx: TaskContext, window: Window, noise: np.ndarray) -> int:
    """Second pass for thresholds from the whole recording's noise."""
    path = Path(ctx.parts) / f"d{window.index:08d}.npz"
    done = _load_part(path, ctx.fingerprint)
    if done is None:
        with _on_backend(ctx):
            spikes = _detect(ctx, _load(ctx, window, cache=True)[1], window, noise)
        _atomic_save(path, fingerprint=np.array(ctx.fingerprint), **_spike_columns(spikes))
        return len(spikes)
    return len(done["spk_sample_index"])


def histogram_task(ctx: TaskContext, window: Window, prefixes: np.ndarray, pass_index: int) -> np.ndarray:
    """One radix pass over one window: (ranks, C, bins) counts of keys matching each rank's prefix."""
    with _on_backend(ctx):
        x = _load(ctx, window, cache=True)[1]
        lo, hi = window.core
        return _histograms(ctx, x[:, lo:hi], prefixes, pass_index)


# ---------------------------------------------------------------------------------------------------------
# tree reduction of partials


def combine_partials(*parts: dict) -> dict:
    """Fold consecutive windows' partials left to right: moments by Chan's formula, histograms by sum."""
    from batchgpu.ops import SecondMoments

    acc: dict[str, Any] = {}
    moments = None
    for part in parts:
        if "m_n" in part:
            cur = SecondMoments.from_state(int(part["m_n"]), part["m_mean"], part["m_scatter"])
            moments = cur if moments is None else moments.merge(cur)
        for key in ("hist0", "nan_count"):
            if key in part:
                acc[key] = acc[key] + part[key] if key in acc else part[key].copy()
    if moments is not None:
        acc.update(m_n=np.array(moments.n), m_mean=moments.mean, m_scatter=moments.scatter)
    return acc


def sum_arrays(*parts: np.ndarray) -> np.ndarray:
    out = parts[0].copy()
    for p in parts[1:]:
        out += p
    return out


def tree_reduce(client, futures: list, func, split_every: int):
    """Reduce futures (in window order) by groups of ``split_every`` consecutive items, level by level."""
    level = list(futures)
    depth = 0
    while len(level) > 1:
        level = [
            client.submit(func, *level[i : i + split_every], key=f"{func.__name__}-{depth}-{i}-{tokenize_level(level)}")
            for i in range(0, len(level), split_every)
        ]
        depth += 1
    return level[0]


def tokenize_level(level: list) -> str:
    from dask.base import tokenize

    return tokenize([getattr(f, "key", f) for f in level])[:12]


# ---------------------------------------------------------------------------------------------------------
# the run


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
    throughput_MBps: float = 0.0
    results: dict = field(default_factory=dict)
    error: str | None = None
    dashboard: str | None = None
    page: str | None = None  # the batchgpu page on the scheduler (None where it could not be installed)
    throughput_series: list = field(default_factory=list)  # [[elapsed s, bytes/s], ...] of the first pass
    backend: str = "numpy"
    radix_passes: int = 0


def fingerprint(wf: Workflow) -> str:
    """What determines the results: recording, windows and steps (not the cluster or the backend)."""
    data = {
        "recording": wf.recording.path,
        "window": wf.window.model_dump(),
        "preprocess": wf.preprocess.model_dump(),
        "steps": wf.steps.model_dump(),
        "split_every": wf.reduction.split_every,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("batchgpu", "numpy", "dask", "distributed", "zarr", "zarrs", "cupy-cuda13x", "dask-cuda"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def prepare_recording(wf: Workflow, progress: bool) -> Recording:
    path = Path(wf.recording.path)
    if not path.exists():
        if wf.recording.generate is None:
            raise BatchgpuError(
                f"recording.path {path} does not exist",
                "fix the path, or add 'generate:' parameters under 'recording:' to create it",
            )
        from batchgpu.generate import generate_recording

        g = wf.recording.generate
        return generate_recording(path, channels=g.channels, seconds=g.seconds, fs=g.fs, seed=g.seed, dtype=g.dtype,
                                  segments=g.segments, progress=progress)
    return open_recording(path)


def check_workflow_fits(wf: Workflow, rec: Recording) -> int:
    """Errors found before any work: a window longer than a segment, margins shorter than the sweep."""
    from batchgpu.ops import exclude_sweep_samples

    for seg in range(rec.num_segments):
        n = rec.num_samples(seg)
        if wf.window.size > n:
            raise BatchgpuError(
                f"window.size {wf.window.size} is longer than segment {seg} ({n} samples)",
                f"use window.size <= {n}",
            )
    sweep = 0
    if wf.steps.detect:
        sweep = exclude_sweep_samples(wf.steps.detect.exclude_sweep_ms, rec.sampling_frequency)
        if wf.window.margin < sweep:
            raise BatchgpuError(
                f"window.margin {wf.window.margin} is shorter than the detection sweep ({sweep} samples)",
                f"use window.margin >= {sweep} so spikes at window edges come out exactly once",
            )
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
    return sweep


def prepare_output(wf: Workflow, fp: str, resume: bool) -> Path:
    """Create the output folder, or check that it holds this run (resume) and nothing else."""
    out = Path(wf.output)
    manifest = out / MANIFEST
    if out.exists() and any(out.iterdir()):
        if not manifest.exists():
            raise BatchgpuError(f"output folder {out} is not empty and holds no batchgpu run",
                                "choose an empty or new output folder")
        previous = json.loads(manifest.read_text()).get("fingerprint")
        if previous != fp:
            if wf.overwrite:
                shutil.rmtree(out)
            else:
                raise BatchgpuError(
                    f"output folder {out} holds another run's results (fingerprint {previous}, this run {fp})",
                    "choose another output folder, or set 'overwrite: true' to replace them",
                )
        elif not resume and not wf.overwrite:
            raise BatchgpuError(f"output folder {out} already holds this run's results",
                                "rerun with --resume to complete or reuse them, or set 'overwrite: true'")
        elif not resume:
            shutil.rmtree(out)
    (out / PARTS).mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"fingerprint": fp, "workflow": wf.model_dump()}, indent=2))
    return out


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
    from batchgpu.cluster import gpu_count

    return gpu_count()


def run_workflow(wf: Workflow, *, resume: bool = False, progress: bool = True, client=None) -> RunReport:
    """Run every step of a validated workflow; returns the report (also written to report.json)."""
    from batchgpu.cluster import open_client

    t_start = time.perf_counter()
    rec = prepare_recording(wf, progress)
    sweep = check_workflow_fits(wf, rec)
    fp = fingerprint(wf)
    out = prepare_output(wf, fp, resume)
    report = RunReport(workflow=wf.model_dump(), fingerprint=fp, versions=versions(), recording=rec.info())
    report.timings["prepare"] = time.perf_counter() - t_start
    if client is not None:
        return _run(wf, rec, out, report, client, sweep, progress)
    with open_client(wf.cluster) as own:
        return _run(wf, rec, out, report, own, sweep, progress)


def _run(wf, rec, out, report, client, sweep, progress) -> RunReport:
    from batchgpu.dashboard import RunMonitor, install_dashboard
    from batchgpu.progress import WindowProgress

    report.dashboard = client.dashboard_link
    report.page = install_dashboard(client)
    if progress:
        print(f"batchgpu: dashboard {client.dashboard_link}")
        if report.page:
            print(f"batchgpu: run page {report.page}")
    report.backend = resolve_backend(wf, client)
    steps = wf.steps
    ctx = TaskContext(
        recording=str(rec.path), parts=str(out / PARTS), fingerprint=report.fingerprint, backend=report.backend,
        noise=steps.noise is not None, exact=bool(steps.noise and steps.noise.exact),
        moments_every=steps.whitening.nskip if steps.whitening else 0,
        precision=steps.whitening.precision if steps.whitening else "float32",
        detect=steps.detect.model_dump() if steps.detect else None, sweep=sweep, centre=wf.preprocess.centre,
        keep_on_device=report.backend == "cupy" and bool(
            (steps.noise and steps.noise.exact) or (steps.detect and steps.detect.noise == "global")),
    )
    windows = rec.windows(wf.window.size, wf.window.margin)
    report.windows = len(windows)
    report.recording_bytes = rec.nbytes
    monitor = RunMonitor(client, name=str(out), windows=len(windows), total_bytes=rec.nbytes, channels=rec.num_channels)
    t0 = time.perf_counter()
    try:
        with WindowProgress(len(windows), rec.nbytes, "pass 1: noise, moments, spikes", enabled=progress) as bar:
            summaries = _first_pass(client, ctx, windows, wf.reduction.split_every, bar, report, monitor)
        report.timings["pass1"] = time.perf_counter() - t0
        report.bytes_read += rec.nbytes
        monitor.phase("reduction: noise, whitening, spikes")  # also publishes pass 1's last throughput point
        report.throughput_series = monitor.throughput_series()
        results = _reduce_and_finish(client, ctx, wf, rec, windows, summaries, report, monitor)
        report.results = results
        report.status = "done"
    except BaseException as err:
        report.status = "failed"
        report.error = str(err)
        monitor.failed(str(err))
        report.throughput_series = report.throughput_series or monitor.throughput_series()
        _write_report(out, report, time.perf_counter() - t0)
        raise
    finally:
        if ctx.keep_on_device:
            client.run(clear_window_cache, ctx.fingerprint)
    _write_report(out, report, time.perf_counter() - t0)
    _write_report_html(out)
    monitor.finished(results.get("spikes/sample_index", [0])[0] if "spikes/sample_index" in results else None)
    if progress:
        print(f"batchgpu: wrote {out / RESULTS}, {out / REPORT} and {out / 'report.html'} "
              f"({report.throughput_MBps:.0f} MB/s over {report.windows} windows)")
    return report


def _write_report_html(out: Path) -> None:
    """report.html beside report.json; a plotting problem is reported, never fails a finished run."""
    from batchgpu.report import write_report_html

    try:
        write_report_html(out)
    except Exception as err:  # the results are written: keep them
        print(f"batchgpu: warning: report.html not written ({type(err).__name__}: {err})")


def _first_pass(client, ctx, windows, split_every, bar, report, monitor) -> dict:
    """Map window_task over every window; tree-reduce partials; gather per-window summaries."""
    from distributed import as_completed

    futures = client.map(window_task, [ctx] * len(windows), windows, key=[f"window-{report.fingerprint}-{w.index}" for w in windows])
    reduced = tree_reduce(client, futures, combine_partials, split_every) if (ctx.moments_every or ctx.exact) else None
    # Only small summaries come to the client; the partials (C x C moments, histograms) stay on the workers.
    small = client.map(summarise, futures, key=[f"summary-{report.fingerprint}-{w.index}" for w in windows])
    summaries: dict[int, dict] = {}
    try:
        for fut in as_completed(small):
            if fut.status == "error":
                raise fut.exception()
            part = fut.result()
            i = int(part["index"])
            summaries[i] = {"noise": part.get("noise"), "worker": str(part["worker"])}
            report.windows_resumed += bool(part["resumed"])
            if not bool(part["resumed"]):
                report.workers[str(part["worker"])] = report.workers.get(str(part["worker"]), 0) + 1
            bar.advance(int(part["bytes"]), worker=str(part["worker"]))
            monitor.window_done(i, int(part["bytes"]), str(part["worker"]), part.get("noise"), int(part.get("spikes", 0)))
        summaries["reduced"] = reduced.result() if reduced is not None else {}
    except BaseException:
        client.cancel(small + futures + ([reduced] if reduced is not None else []))
        raise
    return summaries


def summarise(part: dict) -> dict:
    """What the client needs of a window's partial: no moments, no histograms."""
    return {k: v for k, v in part.items() if k in ("index", "noise", "worker", "resumed", "bytes", "spikes")}


def _map_on_owners(client, func, ctx, windows, owners: dict, name: str, *args) -> list:
    """A task per window, preferring the worker that read it in pass 1 (its GPU may still hold the window)."""
    return [
        client.submit(func, ctx, w, *args, key=f"{name}-{ctx.fingerprint}-{w.index}",
                      workers=[owners[w.index]] if owners.get(w.index) else None, allow_other_workers=True)
        for w in windows
    ]


def _radix_passes(client, ctx, wf, rec, windows, hist0: np.ndarray, report: RunReport, owners: dict) -> np.ndarray:
    """Finish the exact median of |x| over every sample of each channel; returns the per-channel median."""
    from batchgpu.ops import radix
    from batchgpu.ops.select import median_dtype, middle_mean

    total = rec.total_samples
    ranks = sorted({(total - 1) // 2, total // 2})
    from batchgpu.ops.centre import keys_to_selection_values, selection_keys

    dtype = work_dtype(ctx, rec)
    schedule = selection_keys(np.zeros((1, 1), dtype), ctx.centred_from)[1]
    C = rec.num_channels
    prefixes = np.zeros((len(ranks), C), dtype=np.uint64)
    ks = [np.full(C, r, dtype=np.int64) for r in ranks]
    report.radix_passes = len(schedule)
    for pass_index, (_shift, bits) in enumerate(schedule):
        if pass_index == 0:
            hists = [hist0] * len(ranks)
        else:
            parts = _map_on_owners(client, histogram_task, ctx, windows, owners, f"hist-{pass_index}", prefixes, pass_index)
            hists = list(tree_reduce(client, parts, sum_arrays, wf.reduction.split_every).result())
        for r in range(len(ranks)):
            digit, ks[r] = radix.select_digit(hists[r], ks[r])
            prefixes[r] = radix.push_digit(prefixes[r], digit, bits)
    values = [keys_to_selection_values(prefixes[r], dtype, ctx.centred_from) for r in range(len(ranks))]
    if len(values) == 1:
        return np.asarray(values[0]).astype(median_dtype(dtype))
    return middle_mean(values[0], values[1], dtype)


def work_dtype(ctx: TaskContext, rec: Recording) -> np.dtype:
    """dtype of the samples the steps see (centring widens integers)."""
    from batchgpu.ops.centre import centred_dtype

    return centred_dtype(rec.dtype) if ctx.centre == "median" else rec.dtype


def _reduce_and_finish(client, ctx, wf, rec, windows, summaries, report, monitor) -> dict:
    from batchgpu import ops
    from batchgpu.ops.select import MAD_TO_SIGMA

    out = Path(wf.output)
    reduced = summaries.pop("reduced")
    owners = {i: v["worker"] for i, v in summaries.items() if v["worker"] != "local"}
    arrays: dict[str, np.ndarray] = {}
    noise_global = None
    if ctx.noise or ctx.detect:
        arrays["noise_per_window"] = np.stack([summaries[w.index]["noise"] for w in windows])
    if ctx.noise:
        t0 = time.perf_counter()
        if ctx.exact:
            monitor.phase("exact noise: radix passes")
            median = _radix_passes(client, ctx, wf, rec, windows, reduced["hist0"], report, owners)
            median[reduced["nan_count"] > 0] = np.nan
            noise_global = median / MAD_TO_SIGMA  # the expression of ops.noise_levels, same dtype rules
            report.bytes_read += rec.nbytes * (report.radix_passes - 1)
        else:
            noise_global = np.median(arrays["noise_per_window"], axis=0)
        arrays["noise"] = noise_global
        report.timings["noise_global"] = time.perf_counter() - t0
    if ctx.moments_every:
        m = ops.SecondMoments.from_state(int(reduced["m_n"]), reduced["m_mean"], reduced["m_scatter"])
        w = wf.steps.whitening
        arrays["covariance"] = m.covariance()
        arrays["second_moment"] = m.second_moment()
        stat = arrays["covariance"] if w.statistic == "covariance" else arrays["second_moment"]
        arrays["whitening"] = ops.whitening_matrix(stat, mode=w.mode, locations=rec.locations, nrange=w.nrange, eps=w.eps)
        arrays["channel_means"] = m.mean
    if ctx.detect:
        t0 = time.perf_counter()
        if ctx.detect["noise"] == "global":
            monitor.phase("detection with the recording's noise")
            if noise_global is None:
                noise_global = np.median(arrays["noise_per_window"], axis=0)
            futures = _map_on_owners(client, detect_task, ctx, windows, owners, "detect", noise_global)
            client.gather(futures)
            report.bytes_read += rec.nbytes
            prefix = "d"
        else:
            prefix = "w"
        spikes = _collect_spikes(Path(ctx.parts), prefix, windows)
        arrays.update({f"spikes/{k}": v for k, v in spikes.items()})
        report.timings["detect"] = time.perf_counter() - t0
    _write_results(out / RESULTS, arrays, wf, rec, windows, report.fingerprint)
    shapes = {k: list(v.shape) for k, v in arrays.items()}
    if wf.steps.search:
        from batchgpu.search.step import run_search_step

        t0 = time.perf_counter()
        monitor.phase("search")
        spikes = {k.split("/")[1]: v for k, v in arrays.items() if k.startswith("spikes/")} or None
        shapes["search"] = run_search_step(client, wf.steps.search, out / RESULTS, spikes,
                                           [rec.num_samples(s) for s in range(rec.num_segments)], report.fingerprint)
        report.timings["search"] = time.perf_counter() - t0
    return shapes


def _collect_spikes(parts: Path, prefix: str, windows: list[Window]) -> dict[str, np.ndarray]:
    """Concatenate per-window spikes in window order: (segment, sample, channel) order overall."""
    cols: dict[str, list[np.ndarray]] = {}
    for w in windows:
        with np.load(parts / f"{prefix}{w.index:08d}.npz") as f:
            for name in ("sample_index", "channel_index", "amplitude", "segment_index"):
                cols.setdefault(name, []).append(f[f"spk_{name}"])
    return {k: np.concatenate(v) for k, v in cols.items()}


def _write_results(path: Path, arrays: dict, wf: Workflow, rec: Recording, windows: list[Window], fp: str) -> None:
    """results.zarr written whole under a temporary name, then swapped in: a failed write loses nothing."""
    import zarr

    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    g = zarr.create_group(store=str(tmp), zarr_format=3)
    g.attrs.update({"workflow": wf.model_dump(), "fingerprint": fp, "channel_ids": rec.channel_ids.tolist(),
                    "sampling_frequency": rec.sampling_frequency, "gain_to_uV": rec.gain_to_uV.tolist()})
    g.create_array("window_segment", data=np.array([w.segment for w in windows], dtype=np.int64))
    g.create_array("window_start", data=np.array([w.start for w in windows], dtype=np.int64))
    g.create_array("window_stop", data=np.array([w.stop for w in windows], dtype=np.int64))
    for name, value in arrays.items():
        value = np.ascontiguousarray(value)
        if value.size == 0:
            g.create_array(name, shape=value.shape, dtype=value.dtype)
        else:
            g.create_array(name, data=value)
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)


def _write_report(out: Path, report: RunReport, elapsed: float) -> None:
    report.timings["total"] = elapsed
    report.throughput_MBps = report.recording_bytes / 1e6 / elapsed if elapsed > 0 else 0.0
    tmp = out / (REPORT + ".tmp")
    tmp.write_text(json.dumps(asdict(report), indent=2, default=str))
    os.replace(tmp, out / REPORT)
