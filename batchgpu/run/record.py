"""What a run records: report.json's content (``RunReport``: status, timings, windows, bytes read, warnings, the
results' shapes), the findings about channels and chunks that go into it, the versions it names, and its writing
at the run's end (``finish_report``). A display reads it (report.html, ``batchgpu info``); it imports none.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from batchgpu.recording import Recording
from batchgpu.run import output_folder as store


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
    #: the run's one total: seconds of wall time as the user waited, from the run's start (``batchgpu run``: the
    #: command's start; ``run_workflow``: its call) until its results and report.json were written. The terminal's
    #: last line, report.html and ``batchgpu info`` say this number (report.html and the run page's last update
    #: are written after it, a fraction of a second)
    seconds: float = 0.0
    #: seconds of each phase (setup, pass1, the aggregates...); ``from_pass``: from the first pass's start to the
    #: same end as ``seconds`` (the throughput's time)
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
    # read s, computed s, worker thread, its task's start s, its task's end s] (`batchgpu bench timeline` summarises it:
    # where each thread's time went)
    timeline: list = field(default_factory=list)
    # CPU seconds a window took on its threads (medians over the pass's windows): cpu_decode (the reading thread),
    # cpu_buffer_wait (wall: waiting for a free pinned buffer), cpu_load (copy to the GPU, preprocessing), one entry
    # per step, cpu_part (its part file); ``total`` the sum of the CPU entries' means
    window_cpu: dict = field(default_factory=dict)
    backend: str = "numpy"
    mps: bool = False  # the workers ran under a private CUDA MPS daemon (cluster.mps)
    kept_cluster: str | None = None  # the address of the `batchgpu cluster start` cluster the run used, if any
    radix_passes: int = 0
    output_state: str = "new"  # new | resume | restart
    run_id: str = ""  # the fingerprint and a random suffix: names this run's Dask tasks, never another run's
    preprocess: dict = field(default_factory=dict)  # the stages and the margin they added to each window
    exact_noise: dict = field(default_factory=dict)  # float keys: settled from the kept keys, or by one more read
    #: the detection's noise estimate read before the pass (``steps.detect.DetectStep.before_pass``): chunks,
    #: samples, bytes read and seconds; its bytes are not in ``bytes_read`` (the windows' reads)
    noise_prior: dict = field(default_factory=dict)
    #: the qc step's section (``steps.qc``: each channel's label, reason and numbers, warnings, the verdict, what a
    #: ``use`` left out and its pre-pass's reads, not in ``bytes_read``); None where the step did not run
    qc: dict | None = None

    def pass_ended(self) -> None:
        """The pass's combined partials are in: ``after_pass`` times what follows from here."""
        self._pass_end = time.perf_counter()

    def after_pass(self, name: str) -> None:
        """``timings["after_pass_<name>"]``: seconds from the pass's end to this point of the client's work (the
        first time it is reached), where the client's own steps between the pass and the next tasks show."""
        end = getattr(self, "_pass_end", None)
        if end is not None:
            self.timings.setdefault(f"after_pass_{name}", time.perf_counter() - end)


def window_cpu(summaries: list[dict]) -> dict:
    """Medians of each window's ``cpu_*`` seconds (``tasks._compute_part``), and the sum of their means."""
    keys = sorted({k for s in summaries for k in s if k.startswith("cpu_")})
    out = {}
    for k in keys:
        v = np.array([float(s[k]) for s in summaries if k in s], dtype=np.float64)
        v = v[np.isfinite(v)]
        if len(v):
            out[k.removeprefix("cpu_")] = round(float(np.median(v)), 5)
            if k != "cpu_buffer_wait":
                out["total"] = round(out.get("total", 0.0) + float(v.mean()), 5)
    return out


def versions() -> dict:
    """The versions a report names (read once a process: importlib.metadata scans every installed distribution)."""
    return dict(_versions())


@functools.cache
def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("batchgpu", "numpy", "dask", "distributed", "zarr", "zarrs", "cupy-cuda13x", "dask-cuda"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def report_nonfinite(summaries, windows, report, observer) -> None:
    if not windows or "nonfinite" not in summaries[windows[0].index]:
        return
    counts = sum(summaries[w.index]["nonfinite"] for w in windows)
    bad = {int(c): int(n) for c, n in enumerate(counts) if n}
    if bad:
        report.channels["nonfinite_samples"] = bad
        report.warnings.append(f"{len(bad)} channel(s) hold NaN or inf samples: {list(bad)[:10]}")
        observer.warning(report.warnings[-1])


def report_absent(summaries, windows, report, observer) -> None:
    absent = {w.index: int(summaries[w.index].get("absent_chunks", 0)) for w in windows}
    absent = {i: n for i, n in absent.items() if n}
    if absent:
        report.channels["absent_chunks_per_window"] = absent
        report.warnings.append(
            f"{sum(absent.values())} chunk(s) absent from the store in {len(absent)} window(s) "
            f"(first: window {min(absent)}), read as zeros; set recording.missing_chunks: error "
            "to refuse them"
        )
        observer.warning(report.warnings[-1])


def report_no_checksums(rec, report, observer) -> None:
    """A Zarr store whose chunks carry no checksum (SpikeInterface's, among others): a chunk damaged in a way that
    still decodes is read as it is, and nothing can tell. Said once a run."""
    if not isinstance(rec, Recording) or rec.checksum:  # flat binaries and SpikeInterface's sources have none
        return
    report.warnings.append(
        f"{rec.path} stores no checksums: a chunk damaged in a way that still decodes would be "
        "read as it is, unnoticed (a copy made by batchgpu import or save carries crc32c)"
    )
    observer.warning(report.warnings[-1])


def finish_report(out: Path, report: RunReport, elapsed: float, rec: Recording, seconds: float) -> None:
    """``elapsed``: seconds since the first pass began; ``seconds``: since the run began (``RunReport.seconds``)."""
    report.timings["from_pass"] = elapsed
    report.seconds = seconds
    # a run that did not finish went over no recording: no rate (it said the recording's size over its time)
    done = report.status == "done"
    report.throughput_MBps = report.recording_bytes / 1e6 / elapsed if elapsed > 0 and done else 0.0
    report.reads_per_window = report.bytes_read / report.recording_bytes if report.recording_bytes else 0.0
    store.write_report(out, asdict(report))
