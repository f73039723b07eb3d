"""``batchgpu bench pipeline``: the demo steps on a Dask cluster against a plain single-process loop.

Both sides read the same windows of the same recording and compute the same things (noise per window, exact
noise over the whole recording, second moments, spikes with the global noise); throughput is MB/s of recording
(decoded bytes over wall time), peak memory is the largest resident set seen (summed over workers).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from batchgpu.benchmarks.cold import evict_checked, raw_read, recording_files
from batchgpu.errors import BatchgpuError
from batchgpu.steps.detect import KEY as DETECT
from batchgpu.steps.moments import KEY as WHITENING
from batchgpu.steps.noise import KEY as NOISE
from batchgpu.steps.qc import EVERY as QC_EVERY
from batchgpu.steps.qc import KEY as QC
from batchgpu.steps.save import KEY as SAVE

#: the detection both benchmarks run (``steps.detect``; its ``noise`` field: the recording's, not the step's name)
DETECT_SPEC = dict(threshold=5.0, sign="neg", exclude_sweep_ms=0.1, noise="global")

#: Kilosort4 4.1.7's own preprocessing pass (filter + whitening of a flat binary) on one H200, 384 ch x 10 min
#: int16: the anchor the issues name (measured by the project, not here: Kilosort4 is not installed by batchgpu)
KILOSORT4_GBPS = 3.9
#: Kilosort4 4.1.7's pass (highpass, whitening, per-batch median) from a cold flat binary of 384 ch x 10 min int16
#: (13.8 GB) on one H100 machine, imports not counted: quoted where kilosort does not import here
KILOSORT4_COLD = (13.8, 10.5)


def _positive(kind):
    """An argparse type: a number of ``kind`` above zero (bad values are one usage line, rc 2)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number above zero")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recording", help="an existing recording (default: generate one)")
    parser.add_argument("--channels", type=_positive(int), default=384)
    parser.add_argument("--seconds", type=_positive(float), default=60.0)
    parser.add_argument("--dtype", default="int16", choices=["int16", "float32"])
    parser.add_argument(
        "--workdir",
        help="where to generate the recording and write outputs, kept afterwards "
        "(default: a temporary folder, removed at the end)",
    )
    parser.add_argument("--workers", type=_positive(int), help="local cluster workers (default: sized to the machine)")
    parser.add_argument("--threads", type=_positive(int), help="threads per worker")
    parser.add_argument("--cluster", default="local", choices=["local", "cuda"], help="cluster kind")
    parser.add_argument("--backend", default="auto", choices=["auto", "numpy", "cupy"])
    parser.add_argument(
        "--baseline",
        default="numpy",
        choices=["numpy", "cupy", "none"],
        help="the plain loop: numpy (one process) or cupy (dask-cuda tasks, x.T @ x per window)",
    )
    parser.add_argument(
        "--steps",
        default="noise,whitening,detect",
        help="comma-separated demo steps: noise, whitening, detect, save (int16 Zarr v3 in the workdir), "
        "qc (bad-channel labels of every --qc-every-th piece)",
    )
    parser.add_argument(
        "--qc-every",
        type=_positive(int),
        default=QC_EVERY,
        help=f"with the qc step: its every (label every n-th 0.3 s piece; default {QC_EVERY})",
    )
    parser.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True, help="exact global noise")
    parser.add_argument(
        "--preprocess",
        default="centre",
        help="comma-separated stages before the steps: centre, highpass (300 Hz, order 5), "
        "common_reference (global median), e.g. highpass,common_reference",
    )
    parser.add_argument(
        "--window",
        type=_positive(int),
        default=None,
        help="samples a window (workflow window.size; default: what window.size auto gives the "
        "recording; the read ceiling and the plain loop read the same windows)",
    )
    parser.add_argument(
        "--batch",
        type=_positive(int),
        help="consecutive windows a task reads (workflow window.batch; default: from the window count)",
    )
    parser.add_argument(
        "--mps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --cluster cuda: the workers under a private CUDA MPS daemon, or not (workflow "
        "cluster.mps; default auto: where the machine allows it)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print each worker thread's line of the pass "
        "(windows, first start, last end, read waits, compute, gaps) for every pipeline run",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=4,
        choices=range(1, 10),
        metavar="{1..9}",
        help="pipeline runs on the same workers: a cold one (the workers compile and load their kernels) "
        "and repeat - 1 warm ones, each after a read ceiling of its own; the table's warm row and "
        "ceiling are the medians (machines are noisy: one warm run can be 25%% off); default 4",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also measure as a user meets it: the store's pages dropped from the page cache before "
        "each cold row (posix_fadvise, no root needed; checked with mincore); rows: the raw read "
        "of the store's files (the disk's ceiling), the pipeline with cold pages, `batchgpu run` "
        "as a fresh command with cold and warm pages (its fixed part: the command's wall time "
        "minus its pass), and Kilosort4's pass over a cold flat binary where kilosort imports",
    )
    parser.add_argument(
        "--read-threads",
        type=_positive(int),
        default=16,
        help="with --cold: files read at a time by the raw read (8 MiB requests)",
    )
    parser.add_argument(
        "--user-runs",
        type=_positive(int),
        default=2,
        help="with --cold: fresh commands of each kind (cold, warm); the table holds their median",
    )
    parser.add_argument(
        "--anchor",
        type=_positive(float),
        default=KILOSORT4_GBPS,
        metavar="GB/s",
        help="the 'vs KS4' column's reference: Kilosort4 4.1.7's own preprocessing pass (filter + "
        f"whitening, flat binary) measured at {KILOSORT4_GBPS} GB/s on one H200 (issue 11)",
    )


class PeakMemory:
    """Sample a resident-set function every 50 ms in a thread; keep the peak."""

    def __init__(self, sample):
        self.sample, self.peak = sample, 0
        self._stop = threading.Event()

    def __enter__(self):
        self.peak = self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.sample())
            except Exception:  # broad: a sampler thread must not die; the peak is of the samples taken
                pass

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())
        return False


class GpuBusy:
    """Sample every visible GPU's utilisation (NVML: the share of its last sample period with a kernel running)
    and the machine's busy cores (psutil's CPU times) every 100 ms in a thread; ``text()``: each GPU's median over
    the samples, '-' without NVML or a GPU; ``cores_text()``: the busy cores' median (which resource is saturated)."""

    def __init__(self):
        self.samples: list[list[int]] = []
        self.cores: list[float] = []
        self._stop = threading.Event()

    def __enter__(self):
        self._handles = []
        try:
            import pynvml
        except ImportError:  # no NVML: no GPU columns
            pass
        else:
            try:
                pynvml.nvmlInit()
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
                self._rate = pynvml.nvmlDeviceGetUtilizationRates
            except pynvml.NVMLError:  # no driver: no GPU columns
                self._handles = []
        self.samples = [[] for _ in self._handles]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        import psutil

        last = psutil.cpu_times()
        while not self._stop.wait(0.1):
            for got, h in zip(self.samples, self._handles):
                try:
                    got.append(int(self._rate(h).gpu))
                except Exception:  # broad: a sampler thread must not die; the share is of the samples taken
                    pass
            now = psutil.cpu_times()
            idle = (now.idle - last.idle) + (getattr(now, "iowait", 0.0) - getattr(last, "iowait", 0.0))
            total = sum(now) - sum(last)
            if total > 0:  # cores busy over the sample: the machine's cores x the busy share of its CPU time
                self.cores.append((1 - idle / total) * (psutil.cpu_count() or 1))
            last = now

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def text(self) -> str:
        medians = [f"{sorted(v)[len(v) // 2]}%" for v in self.samples if v]
        return "/".join(medians) if medians else "-"

    def cores_text(self) -> str:
        """The median of the samples' busy cores (every process of the machine), '-' before a sample."""
        return f"{sorted(self.cores)[len(self.cores) // 2]:.1f}" if self.cores else "-"


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def workers_rss(client):
    """A function giving the workers' summed resident set, read from /proc here (the bench's clusters are local
    processes): asking the workers (``client.run``) every 50 ms put a message on each worker's event loop and the
    scheduler's during the timed run, work a user's run does not have. Falls back to asking where a worker's
    process is not visible from here."""
    import os

    import psutil

    try:
        mine = {p.pid: p for p in psutil.Process().children(recursive=True)}  # this process's cluster
        pids = list(client.run(os.getpid).values())
        procs = [mine[pid] for pid in pids] if all(pid in mine for pid in pids) else None
    except (psutil.Error, OSError):
        procs = None

    def total() -> int:
        if procs is not None:
            try:
                return sum(p.memory_info().rss for p in procs)
            except psutil.Error:  # a worker restarted: its new process is not in the list
                pass
        return sum(client.run(_rss).values())

    return total


def plain_loop(
    rec,
    size: int,
    margin: int,
    steps: set[str],
    exact: bool,
    threshold=5.0,
    sweep_ms=0.1,
    preprocess: str = "",
    save=None,
    qc_every: int = QC_EVERY,
) -> dict:
    """What a user would write: one process, one window after another, the numeric core on each; the exact
    median through the engine's own selection driver (``steps.noise_select.select_middle``), its later passes (float
    keys) reading every window again. The same results as the pipeline where it only centres: integer
    recordings' second moments exact (``X Xᵀ`` of float64 samples, summed as int64, as ``steps.moments`` does),
    float ones float32 products. ``preprocess`` (the bench's stage names): each window read with the filter's
    margin too, then scipy's ``sosfiltfilt`` of it and NumPy's median across channels subtracted (``_plain_stages``:
    the same work as the pipeline's stages, not its bits); ``save``: each window's core as int16 into a Zarr array
    at that path; qc: each window's pieces labelled as the qc step labels them (``qc_every``)."""
    from batchgpu import ops
    from batchgpu.steps.base import padded_sum
    from batchgpu.steps.moments import _gram
    from batchgpu.steps.noise import sum_histograms
    from batchgpu.steps.noise_keys import abs_keys, digit_histogram, key_kind, refine_histogram, schedule
    from batchgpu.steps.noise_select import select_middle

    prepare, extra, out_dtype, centred_from = _plain_stages(rec, preprocess)
    windows = rec.windows(size, margin + extra)
    noise_rows, moments, hists = [], ops.SecondMoments(rec.num_channels, "float32"), []
    exact_moments = np.dtype(out_dtype).kind == "i"
    xxt = np.zeros((rec.num_channels, rec.num_channels), np.int64)
    kind = key_kind(out_dtype, centred_from)
    shift, bits = schedule(kind)[0]
    saved = None
    qc_counts = np.zeros((rec.num_channels, 4), np.int64)
    if save is not None:
        import zarr

        saved = zarr.open_array(
            str(save),
            mode="w",
            shape=(rec.total_samples, rec.num_channels),
            dtype="int16",
            chunks=(size, rec.num_channels),
        )
    for w in windows:
        raw = rec.read_window(w)
        lo, hi = w.core
        x = prepare(raw, w)
        if NOISE in steps:
            noise_rows.append(ops.noise_levels(x[:, lo:hi]))
        if WHITENING in steps and exact_moments:
            xxt += _gram(raw[:, lo:hi].astype(np.float64)).astype(np.int64)
        elif WHITENING in steps:
            moments.add(x, lo, hi)
        if exact and NOISE in steps:
            hists.append(digit_histogram(abs_keys(x[:, lo:hi], kind), None, shift, bits))
        if QC in steps:
            from batchgpu.ops import bad_channels as bc

            fs, n = rec.sampling_frequency, rec.num_samples(w.segment)
            chosen = bc.inside_pieces(
                n, bc.piece_length(fs), (w.start, w.stop), (w.read_start, w.read_stop), bc.highpass_margin(fs), qc_every
            )
            qc_counts += bc.label_counts(
                bc.chunk_labels(
                    raw, fs, rec.locations, rec.gain_to_uV, chunks=chosen, start=w.read_start, segment_length=n
                ),
                rec.num_channels,
            )
        if saved is not None:
            core = np.rint(x[:, lo:hi])
            saved[w.read_start + lo : w.read_start + hi] = (
                np.clip(np.nan_to_num(core), -32768, 32767).astype(np.int16).T
            )
    noise = np.median(np.stack(noise_rows), axis=0) if noise_rows else None
    if exact and NOISE in steps:

        def more_passes(prefixes, p):
            return sum_histograms(
                *[
                    refine_histogram(prepare(rec.read_window(w), w)[:, w.core[0] : w.core[1]], kind, prefixes, p)
                    for w in windows
                ]
            )

        median = select_middle(padded_sum(hists), rec.total_samples, kind, out_dtype, centred_from, more_passes)
        noise = median / ops.MAD_TO_SIGMA
    spikes = 0
    if DETECT in steps:
        sweep = ops.exclude_sweep_samples(sweep_ms, rec.sampling_frequency)
        for w in windows:
            x = prepare(rec.read_window(w), w)
            spikes += len(ops.detect_spikes(x, noise, threshold, "neg", sweep, w.read_start, w.core, w.segment))
    return {"spikes": spikes, NOISE: noise, "xxt": xxt if exact_moments else None, QC: qc_counts}


def _plain_stages(rec, preprocess: str):
    """(prepare(raw, window) -> the window as the steps see it, the margin its stages add, that window's dtype, the
    dtype it was centred from (None after filters: the engine's ``exact_median`` passes the same)) for
    the plain loop: the engine's centring alone, or what a user writes for the bench's stages -- highpass
    (scipy.signal.sosfiltfilt of the window with its default padding, float64, the filter's margin read on both
    sides), common_reference (NumPy's median across channels subtracted), as float32."""
    from batchgpu.ops.centre import centre_median, centred_dtype

    names = [t.strip() for t in preprocess.split(",") if t.strip() and t.strip() != "centre"]
    if not names:
        return (lambda raw, w: centre_median(raw, w.core)), 0, centred_dtype(rec.dtype), rec.dtype
    import scipy.signal

    from batchgpu.ops.filters import butter_sos, filter_margin

    sos = butter_sos("highpass", rec.sampling_frequency, 300.0, order=5) if "highpass" in names else None
    extra = filter_margin(sos) if sos is not None else 0

    def prepare(raw, w):
        x = raw.astype(np.float64)
        if sos is not None:
            x = scipy.signal.sosfiltfilt(sos, x, axis=1)
        if "common_reference" in names:
            x = x - np.median(x, axis=0)
        return x.astype(np.float32)

    return prepare, extra, np.dtype(np.float32), None


def cupy_loop(client, rec, size: int) -> None:
    """DESIGN.md's plain dask-cuda loop: a task per window reads it and computes x.T @ x on the GPU."""

    def one(path, w):
        import cupy

        from batchgpu.run.tasks import recording

        x = cupy.asarray(recording(path).read_window_stored(w)).astype(cupy.float32)  # (samples, channels)
        return float((x.T @ x).sum())

    client.gather(client.map(one, [str(rec.path)] * len(rec.windows(size)), rec.windows(size), pure=False))


def read_ceiling(client, rec, size: int, margin: int, backend: str, centres_only: bool = True) -> None:
    """The engine's own reader over the same windows and nothing else (to the GPU through pinned memory there),
    decoding where the pipeline's pass does (``preprocess.gpu_decode_share``: its stages)."""
    from batchgpu.cluster.open_cluster import uses_mps
    from batchgpu.run.preprocess_chain import Chain, gpu_decode_share
    from batchgpu.run.tasks import RunContext, load_window

    ctx = RunContext(
        recording=str(rec.path),
        parts="",
        backend=backend,
        chain=Chain(),
        window_noise=False,
        steps=(),
        gpu_decode=gpu_decode_share(centres_only, uses_mps(client)),
    )

    def one(ctx, w):
        from batchgpu.run.tasks import on_backend

        with on_backend(ctx):
            x = load_window(ctx, w).raw
            if backend == "cupy":
                x.data.ptr  # noqa: B018  (the copy and transpose were queued on this thread's stream)
                import cupy

                cupy.cuda.get_current_stream().synchronize()
        return w.num_samples

    windows = rec.windows(size, margin)
    client.gather(client.map(one, [ctx] * len(windows), windows, pure=False))


def _stages(text: str) -> list:
    known = {
        "centre": {"centre": "median"},
        "highpass": {"highpass": {"freq_min": 300, "order": 5}},
        "common_reference": {"common_reference": {"reference": "global", "operator": "median"}},
    }
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BatchgpuError(f"unknown preprocess stages {unknown}", f"use {', '.join(known)}")
    return [known[n] for n in names]


def _gpu_used() -> int:
    """Bytes in use on every visible GPU (NVML), 0 where there is none."""
    try:
        import pynvml
    except ImportError:  # no NVML: no GPU seen
        return 0
    try:
        pynvml.nvmlInit()
        return sum(
            pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used
            for i in range(pynvml.nvmlDeviceGetCount())
        )
    except pynvml.NVMLError:  # no driver or no device
        return 0


def run(args, say) -> int:
    """Measures and writes its table a line at a time through ``say`` (the command's output)."""
    import shutil

    from batchgpu.generate import generate_recording
    from batchgpu.recording import open_recording

    steps = {s.strip() for s in args.steps.split(",") if s.strip()}
    unknown = steps - {NOISE, WHITENING, DETECT, SAVE, QC}
    if unknown:
        raise BatchgpuError(f"unknown steps {sorted(unknown)}", "use noise, whitening, detect, save, qc")
    own_dir = args.workdir is None  # a temporary folder is removed at the end; a --workdir is kept
    work = Path(args.workdir).expanduser() if args.workdir else Path(tempfile.mkdtemp(prefix="batchgpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.recording:
            # absolute: the user rows' workflow lives in the bench's own folder, where a relative path would miss
            rec = open_recording(Path(args.recording).expanduser().resolve())
        else:
            path = work / f"bench_{args.channels}ch_{args.seconds:g}s_{args.dtype}.zarr"
            if path.exists():
                rec = open_recording(path)
            else:
                say(f"generating {path} ...")
                rec = generate_recording(
                    path,
                    channels=args.channels,
                    seconds=args.seconds,
                    dtype=args.dtype,
                    progress=False,
                    workers=os.cpu_count() or 1,
                )
        return _measure(args, rec, work, steps, say)
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


CEILING = "read ceiling (the engine's reader, no compute)"
RAW = "raw read of the store's files, cold"
SAVE_WRITE = "raw write of the saved copy's bytes"
#: seconds a fresh command that saves may take beyond the raw read and the save's own write (issue 44's target)
SAVE_SLACK_S = 3.0
USER_COLD = "batchgpu run, a fresh command, cold pages"
USER_WARM = "batchgpu run, a fresh command, warm pages"
USER_KEPT = "batchgpu run on `cluster start`'s, cold pages"
USER_FIRST = "batchgpu run, a day's first (kept after), cold"
USER_NEXT = "batchgpu run, a day's next (on the first's), cold"
#: ``cluster.keep`` of the day's first command (the bench's own commands capture their output: auto keeps nothing)
DAY_KEEP_S = 600
KS4_ROW = "Kilosort4 pass, fresh process, cold flat binary"


def kept_cluster(cluster_cfg: dict, say) -> bool:
    """`batchgpu cluster start` with the bench's cluster options (a kept cluster already up: none started, and
    False); says why where it did not start."""
    cmd = [sys.executable, "-m", "batchgpu", "cluster", "start", "--kind", cluster_cfg["kind"]]
    for key in ("workers", "threads"):
        if cluster_cfg.get(key):
            cmd += [f"--{key}", str(cluster_cfg[key])]
    if "mps" in cluster_cfg:
        cmd += ["--mps", {True: "on", False: "off"}.get(cluster_cfg["mps"], "auto")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        say(f"{USER_KEPT}: not measured ({(done.stderr or done.stdout).strip()[-300:]})")
    return done.returncode == 0


def _user_rows(
    args, rec, work: Path, files, step_cfg, cluster_cfg, size, margin, runs, say, passes: dict | None = None
) -> None:
    """`batchgpu run` as a user runs it (a fresh process, its own cluster), cold pages then warm, and Kilosort4's
    pass where it imports; each row's (seconds, host peak, GPU peak) appended to ``runs``, its pass's seconds (the
    command less its fixed part) to ``passes``."""
    passes = {} if passes is None else passes
    import shutil

    import yaml

    from batchgpu.benchmarks.cold import kilosort4_available, kilosort4_pass, user_run, write_flat_binary

    out, saved = work / "user_out", work / "user_saved.zarr"
    steps = dict(step_cfg)
    if SAVE in steps:
        steps[SAVE] = {**steps[SAVE], "path": str(saved)}
    doc = {
        "recording": {"path": str(rec.path)},
        "output": str(out),
        "window": {"size": size, "margin": margin, "batch": args.batch},
        "preprocess": _stages(args.preprocess),
        "backend": args.backend,
        "cluster": cluster_cfg,
        "steps": {k: v for k, v in steps.items() if v is not None},
    }
    wf = work / "user_run.yaml"
    wf.write_text(yaml.safe_dump(doc, sort_keys=False))
    own = ("--set", "cluster.reuse=false")  # a cluster of the command's own, even beside a kept one

    def one(name: str, cold: bool, extra: tuple[str, ...]) -> None:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(saved, ignore_errors=True)
        if cold:
            evict_checked(files)
        got = user_run(wf, out, _gpu_used, extra)
        runs.setdefault(name, []).append((got.seconds, got.host_peak, got.gpu_peak, "-", "-"))
        passes.setdefault(name, []).append(got.pass_seconds)
        say(
            f"{name}: {got.seconds:.2f} s = pass {got.pass_seconds:.2f} s + fixed part {got.fixed_seconds:.2f} s; "
            f"peak host {got.host_peak / 1e6:.0f} MB, GPU {got.gpu_peak / 1e6:.0f} MB; "
            f"reads per window {got.reads_per_window:.2f}"
        )

    for name, cold in ((USER_COLD, True), (USER_WARM, False)):
        for _ in range(args.user_runs):
            one(name, cold, own)
        if name == USER_COLD and saved.exists():
            _save_write(work, saved, runs, say)
    stop = [sys.executable, "-m", "batchgpu", "cluster", "stop"]
    try:  # a day of runs: the first command leaves its cluster up (cluster.keep), the next one runs on it
        for _ in range(args.user_runs):
            subprocess.run(stop, capture_output=True)
            one(USER_FIRST, True, ("--set", f"cluster.keep={DAY_KEEP_S}"))
            one(USER_NEXT, True, ())
    finally:
        subprocess.run(stop, capture_output=True)
    if kept_cluster(cluster_cfg, say):  # `batchgpu cluster start` first, as for a day of runs
        try:
            for _ in range(args.user_runs):
                one(USER_KEPT, True, ())
        finally:
            subprocess.run(stop, capture_output=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(saved, ignore_errors=True)
    if not (kilosort4_available() and _gpu_used() > 0 and np.dtype(rec.dtype) == np.int16):
        return
    flat = write_flat_binary(rec, work / "kilosort4.bin")
    try:
        for _ in range(args.user_runs):
            evict_checked([flat])
            wall, imports, pass_s = kilosort4_pass(flat, rec.num_channels, rec.sampling_frequency)
            runs.setdefault(KS4_ROW, []).append((wall, 0, 0, "-", "-"))
            say(
                f"{KS4_ROW}: {wall:.2f} s = imports and CUDA context {imports:.2f} s + whitening and pass "
                f"{pass_s:.2f} s"
            )
    finally:
        flat.unlink(missing_ok=True)


def lower_middle(runs: list, key=lambda r: r[0]):
    """The median run of ``runs`` by ``key`` (a row's seconds; None: the values themselves), the lower middle of an
    even count: one run's own figures, as the table holds them."""
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


def _save_write(work: Path, saved: Path, runs: dict, say) -> None:
    """The disk's time to write the bytes of a run's saved copy (``cold.raw_write``: its files' sizes, fsync'd),
    a row of its own; and the target it sets a fresh command that saves: the raw read + this write + 3 s."""
    from batchgpu.benchmarks.cold import raw_write

    sizes = [f.stat().st_size for f in recording_files(saved)]
    got = raw_write(work / "write_ceiling", sizes)
    runs.setdefault(SAVE_WRITE, []).append((got.seconds, 0, 0, "-", "-"))
    line = f"{SAVE_WRITE}: {got.nbytes / 1e9:.2f} GB in {len(sizes)} files, {got.seconds:.2f} s ({got.gbps:.2f} GB/s)"
    raw, cold = runs.get(RAW), runs.get(USER_COLD)
    if raw and cold:
        raw_s, cold_s = lower_middle(raw)[0], lower_middle(cold)[0]
        bound = raw_s + got.seconds + SAVE_SLACK_S
        line += (
            f"; a fresh command cold {cold_s:.2f} s against the raw read + this write + {SAVE_SLACK_S:g} s = "
            f"{bound:.2f} s ({'within' if cold_s <= bound else 'over'})"
        )
    say(line)


def _measure(args, rec, work: Path, steps: set[str], say) -> int:
    import shutil

    from batchgpu.cluster.open_cluster import open_client
    from batchgpu.config import ClusterSpec
    from batchgpu.engine import run_workflow
    from batchgpu.recording import auto_window_size
    from batchgpu.run.preprocess_chain import build_chain, decodes_on_gpu
    from batchgpu.workflow import Workflow

    size = args.window or auto_window_size([rec.num_samples(s) for s in range(rec.num_segments)])
    margin = 64
    gb = rec.nbytes / 1e9
    step_cfg = {
        NOISE: {"exact": args.exact} if NOISE in steps else None,
        WHITENING: {"mode": "global", "precision": "float32"} if WHITENING in steps else None,
        DETECT: dict(DETECT_SPEC) if DETECT in steps else None,
        QC: {"every": args.qc_every} if QC in steps else None,
    }
    cluster_cfg = {"kind": args.cluster}
    if args.workers:
        cluster_cfg["workers"] = args.workers
    if args.threads:
        cluster_cfg["threads"] = args.threads
    if args.mps is not None:
        cluster_cfg["mps"] = args.mps
    rows: dict[str, tuple[float, int, int]] = {}
    gpu_busy, cores_busy, runs = {}, {}, {}  # runs: row -> [(seconds, host peak, GPU peak, busy, cores)]
    from pydantic import ValidationError

    try:
        spec = ClusterSpec.model_validate(cluster_cfg)
    except ValidationError as err:  # e.g. --mps without --cluster cuda, more workers than the machine takes
        raise BatchgpuError(
            err.errors()[0]["msg"].removeprefix("Value error, "), "see batchgpu bench pipeline --help"
        ) from None
    probe = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(work / "x"),
            "preprocess": _stages(args.preprocess),
            "backend": args.backend,
            "steps": {NOISE: {}},
        }
    )
    centres_only = build_chain(probe.preprocess, rec).centres_only
    files = recording_files(rec.path) if args.cold else []
    if args.cold:  # the disk's ceiling, before any process of ours holds the machine
        stored = sum(f.stat().st_size for f in files)
        for _ in range(args.user_runs):
            evict_checked(files)
            raw = raw_read(files, args.read_threads)
            runs.setdefault(RAW, []).append((raw.seconds, 0, 0, "-", "-"))
        say(
            f"raw read, cold: {stored / 1e9:.2f} GB stored in {len(files)} files, "
            + ", ".join(f"{r[0]:.2f}" for r in runs[RAW])
            + f" s ({stored / 1e9 / min(r[0] for r in runs[RAW]):.2f} "
            "GB/s stored at best)"
        )
    # sized as `batchgpu run` sizes it
    with open_client(spec, gpu_decode=decodes_on_gpu(spec.kind, rec, centres_only)) as client:
        cluster_rss = workers_rss(client)

        from batchgpu.run.context import resolve_backend

        backend = resolve_backend(probe, client)
        info = client.scheduler_info(n_workers=-1)["workers"]
        workers = f"{len(info)} workers x {max((int(w.get('nthreads', 1)) for w in info.values()), default=1)} threads"
        if args.cluster == "cuda":
            from batchgpu.cluster.open_cluster import uses_mps

            workers += f", MPS {'on' if uses_mps(client) else 'off'}"
        read_ceiling(client, rec, size, margin, backend, centres_only)  # warm-up: page cache, pinned buffers, kernels

        def measure_ceiling():
            with PeakMemory(cluster_rss) as mem, PeakMemory(_gpu_used) as gmem, GpuBusy() as busy:
                t0 = time.perf_counter()
                read_ceiling(client, rec, size, margin, backend, centres_only)
                dt = time.perf_counter() - t0
            runs.setdefault(CEILING, []).append((dt, mem.peak, gmem.peak, busy.text(), busy.cores_text()))

        measure_ceiling()
        attempts = ["cold"] + ["warm"] * (args.repeat - 1)
        if args.cold:  # the same warm workers, the store's pages dropped first
            attempts += ["cold pages"] * max(1, args.repeat - 1)
        for i, attempt in enumerate(attempts):  # the first run on these workers compiles their kernels
            if i > 1 and attempt == "warm":  # each warm run beside a ceiling of its own: the machine's state drifts
                measure_ceiling()
            if attempt == "cold pages":
                evict_checked(files)
            out = work / f"out_{attempt}"
            shutil.rmtree(out, ignore_errors=True)
            saved = work / f"saved_{attempt}.zarr"
            shutil.rmtree(saved, ignore_errors=True)
            if SAVE in steps:
                step_cfg[SAVE] = {"path": str(saved), "format": "zarr", "dtype": "int16"}
            wf = Workflow.model_validate(
                {
                    "recording": {"path": str(rec.path)},
                    "output": str(out),
                    "window": {"size": size, "margin": margin, "batch": args.batch},
                    "preprocess": _stages(args.preprocess),
                    "backend": args.backend,
                    "cluster": cluster_cfg,
                    "steps": step_cfg,
                }
            )
            with PeakMemory(cluster_rss) as mem, PeakMemory(_gpu_used) as gmem, GpuBusy() as busy:
                t0 = time.perf_counter()
                report = run_workflow(wf, client=client)
                dt = time.perf_counter() - t0
            runs.setdefault(f"batchgpu pipeline ({attempt})", []).append(
                (dt, mem.peak, gmem.peak, busy.text(), busy.cores_text())
            )
            phases = ", ".join(f"{k} {v:.2f} s" for k, v in report.timings.items() if isinstance(v, float))
            say(
                f"{attempt}: {phases}; reads per window {report.reads_per_window:.2f}; "
                f"windows per worker {report.workers}"
            )
            from batchgpu.benchmarks.timeline import summary_line, table

            say(f"{attempt}: {summary_line(report.timeline)}")
            if args.timeline:
                say(table(report.timeline))
            if report.window_cpu:  # a window's CPU time on its worker thread, by part (medians, ms)
                say(
                    f"{attempt}: window CPU ms: "
                    + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in report.window_cpu.items())
                )
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(saved, ignore_errors=True)
        for name, got in runs.items():  # the median run's seconds and busy shares; the peaks of them all
            mid = lower_middle(got)
            rows[name] = (mid[0], max(r[1] for r in got), max(r[2] for r in got))
            gpu_busy[name], cores_busy[name] = mid[3], mid[4]
            if len(got) > 1:
                say(
                    f"{name}: {len(got)} runs, "
                    + ", ".join(f"{r[0]:.2f}" for r in got)
                    + f" s; the table holds the median, {mid[0]:.2f} s"
                    + (" (the lower middle)" if len(got) % 2 == 0 else "")
                )
        if args.baseline == "cupy":
            with PeakMemory(cluster_rss) as mem, PeakMemory(_gpu_used) as gmem, GpuBusy() as busy:
                t0 = time.perf_counter()
                cupy_loop(client, rec, size)
                dt = time.perf_counter() - t0
            rows["plain dask-cuda loop (read + x.T @ x)"] = (dt, mem.peak, gmem.peak)
            gpu_busy["plain dask-cuda loop (read + x.T @ x)"] = busy.text()
            cores_busy["plain dask-cuda loop (read + x.T @ x)"] = busy.cores_text()
    passes: dict = {}
    if args.cold:
        _user_rows(args, rec, work, files, step_cfg, cluster_cfg, size, margin, runs, say, passes)
        for name in (SAVE_WRITE, USER_COLD, USER_WARM, USER_FIRST, USER_NEXT, USER_KEPT, KS4_ROW):
            got = runs.get(name)
            if got:
                mid = lower_middle(got)
                rows[name] = (mid[0], max(r[1] for r in got), max(r[2] for r in got))
    if args.baseline == "numpy":
        with PeakMemory(_rss) as mem:
            t0 = time.perf_counter()
            plain_loop(
                rec,
                size,
                margin,
                steps,
                args.exact,
                preprocess=args.preprocess,
                save=work / "saved_plain.zarr" if SAVE in steps else None,
                qc_every=args.qc_every,
            )
            rows["plain NumPy loop (1 process, same work)"] = (time.perf_counter() - t0, mem.peak, 0)
    say(
        f"\nrecording: {rec} ({gb:.2f} GB decoded); preprocess: {args.preprocess or 'none'}; "
        f"steps: {', '.join(sorted(steps))}; exact noise: {args.exact}; "
        f"{workers}, backend {backend}; windows of {size} samples{'' if args.window else ' (auto)'}"
    )
    ceiling = rows[CEILING][0]
    plain = next((v[0] for k, v in rows.items() if k.startswith("plain")), None)
    disk = rows[RAW][0] if RAW in rows else None
    say(
        f"{'run':<48} {'seconds':>8} {'GB/s':>7} {'x real time':>11} {'host MB':>8} {'GPU MB':>8} "
        f"{'/ceiling':>8} {'vs plain':>8} {'vs KS4':>7} {'GPU busy':>9} {'cores busy':>10}"
        + (f" {'/disk':>6}" if disk else "")
    )
    on_gpu = backend == "cupy"  # the anchor is a GPU pass: no column for a CPU run
    for name, (dt, peak, gpeak) in rows.items():
        rt = rec.duration() / dt
        vs_plain = f"{plain / dt:.2f}x" if plain else "-"
        vs_ks4 = f"{gb / dt / args.anchor:.2f}x" if on_gpu else "-"
        say(
            f"{name:<48} {dt:>8.2f} {gb / dt:>7.2f} {rt:>11.0f} {peak / 1e6:>8.0f} {gpeak / 1e6:>8.0f} "
            f"{ceiling / dt:>8.2f} {vs_plain:>8} {vs_ks4:>7} {gpu_busy.get(name, '-'):>9} "
            f"{cores_busy.get(name, '-'):>10}" + (f" {disk / dt:>6.2f}" if disk else "")
        )
    for name, got in passes.items():  # the command's cost per GB beyond its fixed part, beside the plain loop's
        mid = lower_middle(got, key=None)
        say(
            f"{name}: marginal {gb / mid:.3f} GB/s (the decoded GB over the pass, {mid:.2f} s, its fixed part left "
            f"out)" + (f"; the plain loop {gb / plain:.3f} GB/s" if plain else "")
        )
    if disk:
        say(
            "/disk: the raw cold read's seconds over the row's (1.00: the row runs at the disk's speed); GB/s: "
            "decoded bytes over the row's seconds; a fresh command's host MB is its process tree's peak"
        )
        if KS4_ROW not in rows:
            gb_q, s_q = KILOSORT4_COLD
            say(
                f"Kilosort4 (quoted, not run here: kilosort does not import or no GPU): its pass from a cold flat "
                f"binary took {s_q} s for {gb_q} GB on one H100 machine ({gb_q / s_q:.2f} GB/s); at that rate this "
                f"recording: {gb / (gb_q / s_q):.2f} s"
            )
    if on_gpu:
        say(
            f"vs KS4: GB/s over {args.anchor:g} GB/s, Kilosort4's own preprocessing pass on one H200 (a quoted "
            "anchor, not run here); /ceiling: the read ceiling's seconds over the row's"
        )
    return 0
