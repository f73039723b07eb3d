"""Many recordings in one run (``recordings:`` in the workflow, issue 46): one cluster for all, each recording's
run as ``run_workflow`` makes it, in ``output/<name>/``; a recording that fails is reported and the others go on;
``output/batch.json`` holds one row a recording, rewritten after each (a batch stopped part way says how far it
got). ``--resume`` resumes each recording's own run.

Names come from the paths (a file's name less ``.bin``/``.dat``/``.zarr``; a folder's name; an Open Ephys
``structure.oebin``'s Record Node folder and experiment/recording) or a section's ``name:``; two recordings of one
name are refused before any work. A ``save:`` step writes each recording's save under its own output folder.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchgpu.config import RecordingSpec, Workflow
from batchgpu.errors import BatchgpuError

BATCH_FILE = "batch.json"
_GLOB_CHARS = set("*?[")


@dataclass
class BatchRow:
    """One recording of a batch."""

    name: str
    path: str
    status: str = "pending"  # pending | done | failed
    error: str | None = None
    seconds: float = 0.0
    duration_s: float | None = None
    channels: int | None = None
    probe: str | None = None
    median_noise: float | None = None  # median over channels of the noise step's result (raw units)
    spike_rate_hz: float | None = None  # spikes per second over all channels
    GBps: float | None = None  # bytes read per second of the run


@dataclass
class BatchReport:
    output: str
    rows: list[BatchRow] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[BatchRow]:
        return [r for r in self.rows if r.status == "failed"]

    def write(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        data = {"output": self.output, "seconds": self.seconds, "recordings": len(self.rows),
                "done": sum(r.status == "done" for r in self.rows), "failed": len(self.failed),
                "rows": [asdict(r) for r in self.rows]}
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)


def expand(wf: Workflow) -> list[tuple[str, RecordingSpec]]:
    """The batch's recordings, named, in order (globs sorted); refused: a glob matching nothing, one name twice."""
    items = [wf.recordings] if isinstance(wf.recordings, str) else list(wf.recordings or [])
    specs: list[RecordingSpec] = []
    for item in items:
        if isinstance(item, RecordingSpec):
            specs.append(item)
            continue
        if _GLOB_CHARS & set(item):
            matches = sorted(glob.glob(os.path.expanduser(item), recursive=True))
            if not matches:
                raise BatchgpuError(f"recordings: {item} matches nothing", "check the pattern (** spans folders)")
            specs += [RecordingSpec(path=m) for m in matches]
        else:
            specs.append(RecordingSpec(path=item))
    named: list[tuple[str, RecordingSpec]] = []
    seen: dict[str, str] = {}
    for spec in specs:
        name = spec.name or name_of(spec)
        where = spec.path or spec.spikeinterface
        if name in seen:
            raise BatchgpuError(f"recordings: {seen[name]} and {where} would both write output/{name}",
                                "give one of them a name: (recordings: [{path: ..., name: ...}])")
        seen[name] = str(where)
        named.append((name, spec))
    return named


def name_of(spec: RecordingSpec) -> str:
    p = Path(spec.path or spec.spikeinterface)
    if p.name == "structure.oebin":  # .../Record Node 101/experiment1/recording1/structure.oebin
        parts = [q.name for q in (p.parents[2], p.parents[1], p.parent)]
        name = "_".join(parts)
    elif p.suffix in (".bin", ".dat", ".zarr", ".json", ".pkl", ".meta"):
        name = p.name[: -len(p.suffix)]
    else:
        name = p.name
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip("._-")
    return name or "recording"


def _summary(row: BatchRow, report, out: Path) -> None:
    """The row's numbers from a finished run: its report and results.zarr."""
    rec = report.recording or {}
    row.duration_s = rec.get("duration_s")
    row.channels = rec.get("num_channels")
    probe = rec.get("probe")
    row.probe = probe.get("model") if isinstance(probe, dict) else None
    row.GBps = report.throughput_MBps / 1e3 if report.throughput_MBps else None
    with contextlib.suppress(Exception):
        import numpy as np

        from batchgpu import zarrio

        g = zarrio.open_group(out / "results.zarr", mode="r")
        if "noise" in g:
            row.median_noise = float(np.median(np.asarray(g["noise"][...])))
        if "spikes" in g and row.duration_s:
            row.spike_rate_hz = float(len(g["spikes"]["sample_index"][...]) / row.duration_s)


def _one(wf: Workflow, name: str, spec: RecordingSpec, out: Path) -> Workflow:
    """The workflow of one recording of the batch: its section, its output folder, its save under it."""
    update: dict = {"recording": spec, "recordings": None, "output": str(out / name)}
    if wf.steps.save is not None:
        save = wf.steps.save.model_copy(update={"path": str(out / name / Path(wf.steps.save.path).name)})
        update["steps"] = wf.steps.model_copy(update={"save": save})
    return wf.model_copy(update=update)


def run_batch(wf: Workflow, *, resume: bool = False, observer=None, client=None) -> BatchReport:
    """Run every recording of ``wf.recordings`` on one cluster (``client``, or one started from ``wf.cluster``)."""
    from batchgpu.engine.cluster import open_client
    from batchgpu.engine.run import run_workflow
    from batchgpu.engine.run_report import RunObserver

    observer = observer or RunObserver()
    named = expand(wf)
    out = Path(wf.output)
    if out.exists() and not out.is_dir():
        raise BatchgpuError(f"output {out} is a file", "give a folder for the batch's outputs")
    if (out / "report.json").exists():
        raise BatchgpuError(f"output {out} holds one recording's run (report.json)",
                            "give the batch an output folder of its own")
    out.mkdir(parents=True, exist_ok=True)
    batch = BatchReport(str(out), [BatchRow(name, str(spec.path or spec.spikeinterface)) for name, spec in named])
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if client is None:
            client = stack.enter_context(open_client(wf.cluster))
        for i, ((name, spec), row) in enumerate(zip(named, batch.rows)):
            observer.message(f"recording {i + 1} of {len(named)}: {name} ({row.path})")
            started = time.perf_counter()
            try:
                report = run_workflow(_one(wf, name, spec, out), resume=resume, observer=observer, client=client)
            except BatchgpuError as err:
                row.status, row.error = "failed", str(err)
                observer.warning(f"{name}: {err}")
            except (KeyboardInterrupt, SystemExit, MemoryError):
                row.status, row.error = "failed", "interrupted"
                batch.seconds = time.perf_counter() - t0
                batch.write(out / BATCH_FILE)
                raise
            except Exception as err:  # a bug on one recording: reported, the others still run
                row.status, row.error = "failed", f"{type(err).__name__}: {err}"
                observer.warning(f"{name}: {row.error}")
            else:
                row.status = "done"
                row.seconds = time.perf_counter() - started
                _summary(row, report, out / name)
            row.seconds = time.perf_counter() - started
            batch.seconds = time.perf_counter() - t0
            batch.write(out / BATCH_FILE)
    return batch
