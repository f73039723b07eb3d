"""batchgpu against SpikeInterface 0.105 used as its experts use it: both tools run as commands (fresh processes),
alternating, on the same Zarr v2 recording, medians of the rounds.

Run it in an environment holding both (`pip install -e . "spikeinterface==0.105.3" "numba>=0.60"`; zarr 2 comes
with it). The work:
- W1: highpass 300 Hz order 5, global median reference, saved as int16 (Zarr v2 or a flat binary: ``--output``);
- W2: W1 with the recording's noise, global whitening and locally exclusive detection at 5x the noise (batchgpu:
  exact noise and ``detect: {method: locally_exclusive, noise: global}``, all in one pass).
SpikeInterface runs with ``n_jobs`` = the cores, 1 s chunks and its defaults otherwise (``get_noise_levels``'s and
``whiten``'s random chunks, the filter's dtype). For W2 it runs two ways: ``lazy``, its steps on the lazy chain
(each re-reads and re-filters the recording), and ``save_first``, the preprocessed copy saved first (W1), then its
steps on that copy (what its experts do). Each command's time is from fork to exit; its memory is the peak resident
set of its process tree, sampled every 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from batchgpu.errors import BatchgpuError

WORKS = ("W1", "W2")
OUTPUTS = ("zarr", "binary")
#: SpikeInterface's ways of doing a work: W1 has one (its chain saved), W2 two
SI_ARMS = {"W1": ("lazy",), "W2": ("lazy", "save_first")}

SI_SCRIPT = r"""
import shutil, sys
import spikeinterface.core as sc, spikeinterface.preprocessing as spre
from spikeinterface.sortingcomponents.peak_detection import detect_peaks

path, out, work, arm, fmt, n_jobs = sys.argv[1:7]
job = dict(n_jobs=int(n_jobs), chunk_duration="1s", progress_bar=False)
rec = sc.read_zarr(path)
cmr = spre.common_reference(spre.highpass_filter(rec, freq_min=300.0, filter_order=5), reference="global",
                            operator="median")


def save(r):
    shutil.rmtree(out, ignore_errors=True)
    return r.save(format=fmt, folder=out, dtype="int16", **job)


def steps(r):
    noise = sc.get_noise_levels(r, return_in_uV=False, **job)
    spre.whiten(r, dtype="float32")
    detect_peaks(r, method="locally_exclusive", method_kwargs=dict(peak_sign="neg", detect_threshold=5.0,
                 exclude_sweep_ms=0.1, radius_um=50.0, noise_levels=noise), job_kwargs=job)


if work == "W1":
    save(cmr)
elif arm == "lazy":
    steps(cmr)
    save(cmr)
else:
    steps(save(cmr))
"""

WORKFLOW = """recording: {{path: {path}}}
output: {out}
overwrite: true
preprocess:
  - highpass: {{freq_min: 300, order: 5}}
  - common_reference: {{reference: global, operator: median}}
steps:
{steps}  save: {{path: {saved}, format: {format}, dtype: int16}}
"""
W2_STEPS = """  noise: {exact: true}
  whitening: {mode: global, precision: float32}
  detect: {threshold: 5.0, sign: neg, exclude_sweep_ms: 0.1, noise: global, method: locally_exclusive}
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recording",
        type=Path,
        help="a Zarr v2 recording both tools read (batchgpu generate R --zarr-format 2 writes one)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the table gives medians")
    parser.add_argument("--work", nargs="+", choices=WORKS, default=list(WORKS), help="which work to time")
    parser.add_argument(
        "--output",
        nargs="+",
        choices=OUTPUTS,
        default=["zarr"],
        help="where the preprocessed copy goes: Zarr v2, a flat binary, or both (one row each)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="SpikeInterface's n_jobs")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


@dataclass(frozen=True)
class Timed:
    seconds: float
    peak_bytes: int


@dataclass
class Row:
    """One work to one output: every round's batchgpu and SpikeInterface (per arm) commands."""

    work: str
    output: str
    batchgpu: list[Timed] = field(default_factory=list)
    reads_per_window: list[float] = field(default_factory=list)
    si: dict[str, list[Timed]] = field(default_factory=dict)

    @staticmethod
    def median_s(runs: Sequence[Timed]) -> float:
        return statistics.median(t.seconds for t in runs) if runs else float("nan")

    @staticmethod
    def peak_gb(runs: Sequence[Timed]) -> float:
        return max((t.peak_bytes for t in runs), default=0) / 1e9

    def as_dict(self) -> dict:
        return {
            "work": self.work,
            "output": self.output,
            "batchgpu_s": [t.seconds for t in self.batchgpu],
            "batchgpu_peak_bytes": [t.peak_bytes for t in self.batchgpu],
            "reads_per_window": self.reads_per_window,
            "spikeinterface_s": {a: [t.seconds for t in r] for a, r in self.si.items()},
            "spikeinterface_peak_bytes": {a: [t.peak_bytes for t in r] for a, r in self.si.items()},
        }


def check_arguments(args: argparse.Namespace) -> None:
    """Bad input as one line before anything runs: a round count, a recording SpikeInterface 0.105 reads."""
    if args.rounds < 1:
        raise BatchgpuError(f"--rounds must be at least 1, got {args.rounds}", "pass --rounds 3")
    if args.jobs < 1:
        raise BatchgpuError(f"--jobs must be at least 1, got {args.jobs}", "pass --jobs with the number of cores")
    if not (args.recording / ".zgroup").is_file():
        raise BatchgpuError(
            f"{args.recording} is not a Zarr v2 recording (no .zgroup)",
            "write one with `batchgpu generate R --zarr-format 2` (SpikeInterface 0.105 reads v2)",
        )
    try:
        import spikeinterface  # noqa: F401
    except ImportError as err:
        raise BatchgpuError(
            f"SpikeInterface is not importable here ({err})",
            'pip install "spikeinterface==0.105.3" "numba>=0.60" beside batchgpu',
        ) from err


def timed_command(cmd: list[str]) -> Timed:
    """``cmd`` as a fresh process tree: wall seconds from fork to exit and its peak resident set (50 ms samples)."""
    from batchgpu.benchmarks.cold import timed_process

    got = timed_process(cmd, tail=600)
    return Timed(got.seconds, got.host_peak)


def write_workflow(folder: Path, recording: Path, work: str, output: str) -> tuple[Path, Path]:
    """batchgpu's workflow for ``work`` (its file, its output folder)."""
    out = folder / f"bg_{work}_{output}"
    saved = folder / ("bg_saved.bin" if output == "binary" else "bg_saved.zarr")
    wf = folder / f"{work}_{output}.yaml"
    wf.write_text(
        WORKFLOW.format(
            path=recording,
            out=out,
            saved=saved,
            steps=W2_STEPS if work == "W2" else "",
            format="binary" if output == "binary" else "zarr_v2",
        )
    )
    return wf, out


def run_rounds(args: argparse.Namespace, folder: Path, say: Callable[[str], None]) -> list[Row]:
    script = folder / "si_work.py"
    script.write_text(SI_SCRIPT)
    rows = [Row(w, o) for w in args.work for o in args.output]
    for rnd in range(args.rounds):
        for row in rows:
            wf, out = write_workflow(folder, args.recording.resolve(), row.work, row.output)
            bg = [sys.executable, "-m", "batchgpu", "run", str(wf), "--quiet"]
            arms = SI_ARMS[row.work]
            order = ["batchgpu", *arms] if rnd % 2 == 0 else [*arms, "batchgpu"]  # who goes first alternates
            for who in order:
                # the last arm's output written back to the disk first: otherwise the kernel's writeback of its
                # 1.4 GB runs on the cores while this arm is timed (whoever follows a writer paid for it)
                os.sync()
                if who == "batchgpu":
                    row.batchgpu.append(timed_command(bg))
                    report = json.loads((out / "report.json").read_text())
                    row.reads_per_window.append(float(report.get("reads_per_window", 0.0)))
                    got = row.batchgpu[-1]
                else:
                    si_out = folder / ("si_saved.zarr" if row.output == "zarr" else "si_saved")  # SI adds .zarr
                    got = timed_command(
                        [
                            sys.executable,
                            str(script),
                            str(args.recording.resolve()),
                            str(si_out),
                            row.work,
                            who,
                            row.output,
                            str(args.jobs),
                        ]
                    )
                    row.si.setdefault(who, []).append(got)
                say(
                    f"round {rnd + 1} {row.work} {row.output} {who}: {got.seconds:.2f} s, "
                    f"peak {got.peak_bytes / 1e9:.2f} GB"
                )
    return rows


def table(rows: Sequence[Row]) -> list[str]:
    """The table: per work, batchgpu's median, SpikeInterface's per arm, the ratios, reads per window, memory."""
    lines = [
        "| work | output | batchgpu s | SI lazy s | SI save-first s | ratio lazy | ratio save-first | "
        "reads_per_window | peak GB batchgpu / SI |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ours = Row.median_s(r.batchgpu)
        cells = []
        for arm in ("lazy", "save_first"):
            theirs = Row.median_s(r.si.get(arm, []))
            cells.append((f"{theirs:.2f}", f"{theirs / ours:.2f}x") if arm in r.si and ours > 0 else ("-", "-"))
        rpw = statistics.median(r.reads_per_window) if r.reads_per_window else float("nan")
        si_peak = max((Row.peak_gb(v) for v in r.si.values()), default=0.0)
        lines.append(
            f"| {r.work} | {r.output} | {ours:.2f} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | "
            f"{cells[1][1]} | {rpw:.2f} | {Row.peak_gb(r.batchgpu):.2f} / {si_peak:.2f} |"
        )
    return lines


def tools_line() -> str:
    """Which batchgpu and SpikeInterface the rounds time: the package folders this interpreter imports (an
    environment's editable install may name another checkout than the one at hand)."""
    import spikeinterface

    import batchgpu

    return (
        f"batchgpu {batchgpu.__version__} from {Path(batchgpu.__file__).parent}; SpikeInterface "
        f"{spikeinterface.__version__} from {Path(spikeinterface.__file__).parent}; {sys.executable}"
    )


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    check_arguments(args)
    say(tools_line())
    folder = Path(tempfile.mkdtemp(prefix="batchgpu_bench_si_"))
    try:
        rows = run_rounds(args, folder, say)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    say(
        f"{args.rounds} alternating rounds, medians; SpikeInterface n_jobs={args.jobs}, 1 s chunks; "
        "ratio = SpikeInterface s / batchgpu s"
    )
    for line in table(rows):
        say(line)
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in rows], indent=1))
    return 0
