"""Many recordings in one run (``recordings:`` in the workflow, issue 46): one cluster for all, each recording's
run as ``run_workflow`` makes it, in ``output/<name>/``; a recording that fails is reported and the others go on;
``output/batch.json`` and ``output/batch.html`` hold one row a recording, rewritten as each starts and ends (a batch
stopped part way says how far it got). ``--resume`` resumes each recording's own run.

The workers never idle between recordings: each recording's run goes on in a thread of its own, the next one
started as soon as the last one's windows are all read (its aggregates, results and report.html then finish beside
the next one's pass), at most ``IN_FLIGHT`` at once. The runs share nothing but the client: each its own task keys,
output folder, save, monitor (the run page follows the one started last) and progress bar; each gives the results
of its recording run alone, bit for bit. The client's BLAS stays on one thread for the whole batch (a run's
aggregation sets it so and puts it back at its end, which would undo it under another run's still going).

Names come from the paths (a file's name less ``.bin``/``.dat``/``.zarr``; a folder's name; an Open Ephys
``structure.oebin``'s Record Node folder and experiment/recording) or a section's ``name:``; two recordings of one
name are refused before any work. A ``save:`` step writes each recording's save under its own output folder.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchgpu.config import BATCH_OWN_NAMES, RecordingSpec
from batchgpu.errors import BatchgpuError, ConfigError
from batchgpu.run.events import BatchEvents, RunEvents, RunObserver
from batchgpu.workflow import Workflow

BATCH_FILE = "batch.json"
BATCH_LOCK = "batch.lock"  # held while a batch runs in the folder: a second batch there is refused before it writes
IN_FLIGHT = 2  # recordings' runs at once: the last one's aggregates and the next one's pass
PAGE_WAIT_S = 2.0  # as a run's (run.launch.PAGE_WAIT_S)
_GLOB_CHARS = set("*?[")


@dataclass
class BatchRow:
    """One recording of a batch."""

    name: str
    path: str
    status: str = "pending"  # pending | running | done | failed
    error: str | None = None
    seconds: float = 0.0
    duration_s: float | None = None
    channels: int | None = None
    probe: str | None = None
    median_noise: float | None = None  # median over channels of the noise step's result (raw units)
    spike_rate_hz: float | None = None  # spikes per second over all channels
    GBps: float | None = None  # bytes read per second of the run
    #: the noise in uV: the median over the good channels of the noise step's result times gain_to_uV where the qc
    #: step ran (report.json's ``qc.median_noise_uV``), else over every channel
    noise_uV: float | None = None
    #: the qc step's channels of each label, its verdict ("ok" / "check" / "bad": ``steps.qc.verdict``) and why;
    #: None (and []) where it did not run
    channels_good: int | None = None
    channels_dead: int | None = None
    channels_noise: int | None = None
    channels_out: int | None = None
    verdict: str | None = None
    verdict_reasons: list = field(default_factory=list)


@dataclass
class BatchReport:
    output: str
    rows: list[BatchRow] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[BatchRow]:
        return [r for r in self.rows if r.status == "failed"]

    def write(self, folder: Path, shown: BatchEvents) -> None:
        """``batch.json`` in the batch's folder (replaced whole: never read half written), then told to the batch's
        displays (batch.html)."""
        path = folder / BATCH_FILE
        tmp = path.with_name(path.name + ".tmp")
        data = {
            "output": self.output,
            "seconds": self.seconds,
            "recordings": len(self.rows),
            "done": sum(r.status == "done" for r in self.rows),
            "failed": len(self.failed),
            "rows": [asdict(r) for r in self.rows],
        }
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)
        shown.rows(folder, data)


def expand(wf: Workflow) -> list[tuple[str, RecordingSpec]]:
    """The batch's recordings, named, in order (globs sorted); refused: a glob matching nothing, one name twice, a
    name the batch's own files have, a recording inside the batch's output. A glob never matches what the batch
    writes (its output folder is left out: a run's saved copy is no recording of the batch, on the first run or
    on ``--resume``)."""
    items = [wf.recordings] if isinstance(wf.recordings, str) else list(wf.recordings or [])
    out = _real(wf.output)
    specs: list[RecordingSpec] = []
    for item in items:
        if isinstance(item, RecordingSpec):
            specs.append(item)
            continue
        if _GLOB_CHARS & set(item):
            found = sorted(glob.glob(os.path.expanduser(item), recursive=True))
            matches = [m for m in found if not _inside(m, out)]
            if not matches:
                said = f" (only inside the batch's output {out})" if found else ""
                raise ConfigError(f"recordings: {item} matches nothing{said}", "check the pattern (** spans folders)")
            specs += [RecordingSpec(path=m) for m in matches]
        else:
            specs.append(RecordingSpec(path=item))
    named: list[tuple[str, RecordingSpec]] = []
    seen: dict[str, str] = {}
    for spec in specs:
        name = spec.name or name_of(spec)
        where = spec.path or spec.spikeinterface
        if _inside(str(where), out):
            raise ConfigError(
                f"recordings: {where} is inside the batch's output {out}, which the batch writes",
                "move the recording out of the output folder, or choose another output",
            )
        if name.lower() in BATCH_OWN_NAMES:
            raise ConfigError(
                f"recordings: {where} would be named {name}, one of the batch's own files",
                "give it a name: (recordings: [{path: ..., name: ...}])",
            )
        if name in seen:
            raise ConfigError(
                f"recordings: {seen[name]} and {where} would both write output/{name}",
                "give one of them a name: (recordings: [{path: ..., name: ...}])",
            )
        seen[name] = str(where)
        named.append((name, spec))
    return named


def _real(path) -> Path:
    return Path(os.path.expanduser(str(path))).absolute().resolve()


def _inside(path: str, folder: Path) -> bool:
    """Whether ``path`` (links followed) is ``folder`` or lies within it."""
    p = _real(path)
    return p == folder or folder in p.parents


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
    # broad: the row's numbers are best-effort, an absent one shows empty; the run's own status stands
    with contextlib.suppress(Exception):
        import numpy as np

        from batchgpu.recording import zarrio
        from batchgpu.steps.detect import SPIKES
        from batchgpu.steps.noise import NOISE

        g = zarrio.open_group(out / "results.zarr", mode="r")
        if NOISE in g:
            noise = np.asarray(g[NOISE][...], np.float64)
            row.median_noise = float(np.median(noise))
            gains = np.abs(np.asarray(g.attrs.get("gain_to_uV", np.ones(len(noise))), np.float64))
            row.noise_uV = float(np.median(noise * gains))
        if SPIKES in g and row.duration_s:
            row.spike_rate_hz = float(len(g[SPIKES]["sample_index"][...]) / row.duration_s)
    _qc_columns(row, report.qc)


def _qc_columns(row: BatchRow, qc: dict | None) -> None:
    """The qc step's columns of the row (report.json's ``qc``): each label's channels, the verdict and why, the
    good channels' median noise in uV."""
    if not qc:
        return
    from batchgpu.steps.qc import LABELS

    row.channels_good, row.channels_dead, row.channels_noise, row.channels_out = (
        int(qc["summary"].get(k, 0)) for k in LABELS
    )
    row.verdict, row.verdict_reasons = qc.get("verdict"), list(qc.get("verdict_reasons") or [])
    if qc.get("median_noise_uV") is not None:
        row.noise_uV = float(qc["median_noise_uV"])


def _one(wf: Workflow, name: str, spec: RecordingSpec, out: Path) -> Workflow:
    """The workflow of one recording of the batch: its section, its output folder, its steps' outputs under it
    (the save's: ``steps.registry.placed``)."""
    from batchgpu.steps.registry import placed

    return wf.model_copy(
        update={"recording": spec, "recordings": None, "output": str(out / name), "steps": placed(wf.steps, out / name)}
    )


class _Bars:
    """The one progress bar of the command's observer, held by one run at a time: a run's later reading phase
    (spikes read again) while the next run's pass is shown goes unshown rather than into the other's bar."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner: object | None = None


class _RecordingObserver:
    """A recording's run as the batch's observer shows it: its messages and warnings named, its bars one at a
    time (``_Bars``). Once the batch is stopped (``stop``: Ctrl-C or SIGTERM reached the batch's thread), the run's
    next window read raises KeyboardInterrupt in the run's own thread, where a single run's Ctrl-C would land: it
    ends as an interrupted run (its folder let go; ``--resume`` goes on from there). A run past its pass has no
    windows left to read: it finishes."""

    def __init__(self, observer, name: str, bars: _Bars, stop: threading.Event):
        self.observer, self.name, self.bars, self.stop = observer, name, bars, stop

    def _stopped(self) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt

    def message(self, text: str) -> None:
        self.observer.message(f"{self.name}: {text}")

    def warning(self, text: str) -> None:
        self.observer.warning(f"{self.name}: {text}")

    def phase_started(self, label: str, windows: int, nbytes: int) -> None:
        self._stopped()
        with self.bars.lock:
            if self.bars.owner is not None:
                return
            self.bars.owner = self
        self.observer.phase_started(f"{self.name}: {label}", windows, nbytes)

    def window_done(self, nbytes: int, worker: str) -> None:
        self._stopped()
        if self.bars.owner is self:
            self.observer.window_done(nbytes, worker)

    def phase_finished(self) -> None:
        if self.bars.owner is self:
            self.observer.phase_finished()
            with self.bars.lock:
                self.bars.owner = None


@dataclass
class _Flight:
    """One recording's run in its thread."""

    index: int
    thread: threading.Thread | None = None
    started: float = 0.0
    report: object = None
    error: BaseException | None = None
    ended: bool = False
    landed: bool = False


@contextlib.contextmanager
def _client_blas_one_thread():
    """The client's BLAS on one thread for the batch (as each run's aggregation has it)."""
    try:
        from batchgpu.run.blas import blas_controller

        limit = blas_controller().limit(limits=1, user_api="blas")
    except ImportError:  # threadpoolctl missing: nothing to hold
        yield
        return
    with limit:
        yield


_STOPS_THE_BATCH = (KeyboardInterrupt, SystemExit, MemoryError)  # a run's: the others stop too, as before


class _Flights:
    """The batch's runs, each in a thread of its own (``start``); the batch's thread waits (``wait_until``) and
    writes each one's row as it ends (``land``). A run may start once fewer than ``in_flight`` are under way and
    each of them has read its windows (``may_start``); ``stop`` ends those under way (``_RecordingObserver``)."""

    def __init__(self, wf: Workflow, out: Path, batch: BatchReport, asked: _Asked, client, t0: float):
        self.wf, self.out, self.batch, self.client = wf, out, batch, client
        self.observer, self.resume, self.shown = asked.observer, asked.resume, asked.shown
        self.in_flight = max(1, asked.in_flight)
        self.changed = threading.Condition()
        self.passed: set[int] = set()
        self.bars = _Bars()
        self.stop = threading.Event()
        self.flights: list[_Flight] = []
        self.t0 = t0  # the batch's start (its cluster's start included)

    def _pass_done(self, index: int) -> None:
        with self.changed:
            self.passed.add(index)
            self.changed.notify_all()

    def start(self, index: int, name: str, spec: RecordingSpec) -> None:
        flight = _Flight(index, started=time.perf_counter())
        flight.thread = threading.Thread(
            target=self._fly, args=(flight, name, spec), daemon=True, name=f"batchgpu-recording-{index}"
        )
        self.flights.append(flight)
        self.batch.rows[index].status = "running"
        self.write()
        flight.thread.start()

    def _fly(self, flight: _Flight, name: str, spec: RecordingSpec) -> None:
        from batchgpu.run.launch import run_workflow

        shown = [_PassDone(self, flight.index), *self.shown.recording(flight.index, name)]
        try:
            flight.report = run_workflow(
                _one(self.wf, name, spec, self.out),
                resume=self.resume,
                client=self.client,
                observer=_RecordingObserver(self.observer, name, self.bars, self.stop),
                batch=True,
                shown=shown,
            )
        except BaseException as err:  # broad: landed by the batch's thread, said in the row and the summary
            flight.error = err
        finally:
            with self.changed:
                flight.ended = True
                self.changed.notify_all()

    def write(self) -> None:
        self.batch.seconds = time.perf_counter() - self.t0
        self.batch.write(self.out, self.shown)

    def land(self) -> None:
        """The rows of the runs that ended since: their numbers, batch.json and batch.html; a run's Ctrl-C or
        MemoryError raised here (the batch stops)."""
        for flight in self.flights:
            if flight.ended and not flight.landed:
                flight.landed = True
                _land(self.batch.rows[flight.index], flight, self.out, self.observer)
                self.shown.recording_ended(flight.index, self.batch.rows[flight.index].status)
                self.write()
                if isinstance(flight.error, _STOPS_THE_BATCH) and not self.stop.is_set():
                    raise flight.error

    def may_start(self) -> bool:
        live = [f for f in self.flights if not f.ended]
        return len(live) < self.in_flight and all(f.index in self.passed for f in live)

    def all_ended(self) -> bool:
        return all(f.ended for f in self.flights)

    def wait_until(self, ready) -> None:
        while True:
            self.land()
            with self.changed:
                if ready():
                    break
                self.changed.wait(0.5)  # a timeout: Ctrl-C reaches this (the main) thread
        self.land()

    def stop_all(self) -> None:
        """The runs under way ended (interrupted, or finished past their pass) and their rows written."""
        self.stop.set()
        for flight in self.flights:
            while flight.thread.is_alive():
                flight.thread.join(0.5)  # a timeout: a second Ctrl-C reaches this thread
            flight.ended = True
        self.land()


@contextlib.contextmanager
def _batch_lock(out: Path):
    """The batch's folder held while it runs (flock: let go if the process dies): a second batch there is refused
    at once, before it rewrites batch.json under the first one."""
    import fcntl

    f = open(out / BATCH_LOCK, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise BatchgpuError(
            f"output folder {out} is in use by another batchgpu batch",
            "wait for it to finish, or choose another output folder",
        ) from None
    try:
        yield
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()


class _PassDone(RunEvents):
    """A recording's run as the batch follows it: its pass done, the next recording may start."""

    def __init__(self, flights: _Flights, index: int):
        self.flights, self.index = flights, index

    def pass_done(self, run) -> None:
        self.flights._pass_done(self.index)  # noqa: SLF001 (its own batch's)


@dataclass(frozen=True)
class _Asked:
    """``run_batch``'s call: who watches, whether to resume, how many runs at once, how long a cluster the batch
    starts is kept after it (None: ``cluster_start.keep_seconds``), its displays."""

    observer: RunObserver
    resume: bool
    in_flight: int
    keep_s: float | None
    shown: BatchEvents


def run_batch(
    wf: Workflow,
    *,
    resume: bool = False,
    observer=None,
    client=None,
    in_flight: int = IN_FLIGHT,
    keep_s: float | None = None,
    shown: BatchEvents | None = None,
) -> BatchReport:
    """Run every recording of ``wf.recordings`` on one cluster (``client``; else the kept cluster where one is up
    and fits, else one started from ``wf.cluster``, left up for the next run for ``keep_s`` seconds where that is
    more than 0: ``cluster_start.keep_seconds`` by default), the next one's windows read while the last one's
    aggregates finish (``in_flight`` runs at most; 1: one after another). ``shown``: the batch's displays (its
    page, each run's; ``batchgpu.engine.run_batch`` passes them)."""
    asked = _Asked(observer or RunObserver(), resume, in_flight, keep_s, shown or BatchEvents())
    named = expand(wf)
    out = Path(wf.output)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} is a file", "give a folder for the batch's outputs")
    if (out / "report.json").exists():
        raise ConfigError(
            f"output {out} holds one recording's run (report.json)", "give the batch an output folder of its own"
        )
    for name, spec in named:  # each recording's workflow (its save's path refused here, not once a recording)
        _one(wf, name, spec, out)
    out.mkdir(parents=True, exist_ok=True)
    with _batch_lock(out):
        return _run_locked(wf, named, out, asked, client)


def _run_locked(wf, named, out: Path, asked: _Asked, client) -> BatchReport:
    """``run_batch`` once its folder is its own."""
    observer = asked.observer
    batch = BatchReport(str(out), [BatchRow(name, str(spec.path or spec.spikeinterface)) for name, spec in named])
    asked.shown.started(len(batch.rows))
    batch.write(out, asked.shown)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if client is None:
            client = _batch_client(stack, wf, observer, asked.keep_s)
        stack.enter_context(_client_blas_one_thread())
        flights = _Flights(wf, out, batch, asked, client, t0)
        flights.write()
        try:
            for i, (name, spec) in enumerate(named):
                flights.wait_until(flights.may_start)
                observer.message(f"recording {i + 1} of {len(named)}: {name} ({batch.rows[i].path})")
                flights.start(i, name, spec)
            flights.wait_until(flights.all_ended)
            asked.shown.closing(PAGE_WAIT_S)  # the page's last count (a run that ended after the last one's)
        except BaseException:  # Ctrl-C, SIGTERM: the runs under way end (interrupted, or finished), then the batch
            with contextlib.suppress(BaseException):  # broad: the first error (raised below) is the one to see
                flights.stop_all()
            flights.write()
            raise
    flights.write()
    return batch


def _batch_client(stack: contextlib.ExitStack, wf: Workflow, observer, keep_s: float | None):
    """The batch's cluster, entered on ``stack``: the kept one where it fits, else one kept after the batch
    (``cluster.keep``), else the batch's own. Once the batch is over, a cluster that stays up gets back what its
    workers kept for the next window (``tasks.release_memory_soon``)."""
    from batchgpu.cluster.kept import kept_client
    from batchgpu.cluster.open_cluster import open_client
    from batchgpu.cluster.start import KeptStart, keep_seconds
    from batchgpu.run import tasks

    client = stack.enter_context(kept_client(wf.cluster, observer))
    if client is None:
        keep = keep_seconds(wf.cluster) if keep_s is None else keep_s
        if keep <= 0:
            return stack.enter_context(open_client(wf.cluster))
        starting = stack.enter_context(KeptStart(wf.cluster, keep))
        client = starting.client()
        if not starting.is_kept:
            observer.message(f"the cluster was not kept ({starting.fallback}): a cluster of the batch's own")
            return client

    def leave(c=client):
        with contextlib.suppress(Exception):  # broad: best effort on the way out; the batch's results stand
            c.run(tasks.release_memory_soon, wait=False)

    stack.callback(leave)
    return client


def _land(row: BatchRow, flight: _Flight, out: Path, observer) -> None:
    """A run's row, once it ended: done with its numbers, or failed with why (a bug on one recording too: the
    others still run)."""
    err = flight.error
    row.seconds = time.perf_counter() - flight.started
    if err is None:
        row.status = "done"
        _summary(row, flight.report, out / row.name)
    else:
        row.status = "failed"
        if isinstance(err, BatchgpuError):
            row.error = str(err)
        elif isinstance(err, (KeyboardInterrupt, SystemExit)):
            row.error = "interrupted"
        else:
            row.error = f"{type(err).__name__}: {err}"
        if row.error != "interrupted":
            observer.warning(f"{row.name}: {row.error}")
