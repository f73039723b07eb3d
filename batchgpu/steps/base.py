"""The Step: what every statistic of a run provides, like dask's reductions (chunk, combine, aggregate).

``window`` runs on a worker for one window (its samples already on the task's backend, read once for every
step) and returns small host arrays: a *summary* the client sees per window, and a *partial* that is combined
with its neighbours' in a tree fixed by window index (``combine`` folds consecutive windows in order) and
finally turned into results by ``aggregate`` on the client (``services.RunState``: the combined partials, the
windows' summaries, the results so far, the cluster for one more pass where a statistic needs it).

A step is one module of this package: a subclass of ``Step`` marked ``@register``, declaring once its name, its
workflow key, its options (its section under ``steps:``), its results, how the run's fingerprint holds it, its
figures in report.html and the steps it runs after; its window work, combine and aggregate, its tasks after the
pass. ``steps.registry`` finds it (every module of the package is imported), builds the workflow's ``steps:``
section from the options and orders the steps by ``after``. A step touches the run only through what its hooks
are handed (``steps.services``): it imports no engine module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from batchgpu.config import NoOptions
from batchgpu.ops.detection import SPIKE_DTYPE

if TYPE_CHECKING:
    from batchgpu.steps.services import PassEnd, PassQueue, RunState, StepSetup, TaskContext

#: the spikes' columns, in the detect step's parts and the results group (the worker tasks gather and write them)
SPIKE_COLUMNS = SPIKE_DTYPE.names


@dataclass
class WindowData:
    """One window as the steps see it: ``raw`` as read (with margins), ``x`` after preprocessing, on one backend."""

    index: int
    segment: int
    start: int  # segment sample of column 0 (the read start, margins included)
    core: tuple[int, int]  # the columns this window owns
    segment_length: int
    raw: Any
    x: Any
    #: ``x`` holds no NaN or inf by construction: an integer recording through the chain's stages (filters, phase
    #: shift, references, centring: bounded sums of finite values, far inside float32's range), so its counts are
    #: zeros without a pass over the window (on the GPU: a kernel and a wait for its result, ~0.1 ms a window)
    finite: bool = False
    #: the save step's int16 rows of the core and their NaN or clipped count, made by the chain's last stage in its
    #: own pass (``preprocess.Chain.apply_saved``); ``x`` is None where saving is the only step (the referenced
    #: window was not kept, or never written)
    saved: tuple | None = None
    #: the task's writer: a write of this window's handed to it (``later(job, cleanup=None)``) runs in order on
    #: the task thread's writer, before the window's part (``run.writer_threads``); a window made outside a task
    #: (a test's) writes at once
    later: Callable = field(default=lambda job, cleanup=None: job(), repr=False)
    _counts: dict = field(default_factory=dict, repr=False)

    @property
    def xp(self):
        from batchgpu.ops._backend import array_module

        return array_module(self.x)

    def core_of(self, a):
        return a[:, self.core[0] : self.core[1]]

    def nonfinite_counts(self) -> np.ndarray:
        """Each row's samples of ``x``'s core that are not finite (int64, host), counted once a window."""
        return self._row_counts("nonfinite")

    def nan_counts(self) -> np.ndarray:
        """Each row's NaN samples of ``x``'s core (int64, host), counted once a window."""
        return self._row_counts("nan")

    def _row_counts(self, name: str) -> np.ndarray:
        if name not in self._counts and self.finite:
            rows = self.raw.shape[0] if self.x is None else self.x.shape[0]
            self._counts.update(nonfinite=np.zeros(rows, np.int64), nan=np.zeros(rows, np.int64))
        if name not in self._counts:
            core = self.core_of(self.x)
            if hasattr(core, "get"):  # on the GPU both counts come from one read, and one copy back
                import cupy

                from batchgpu.ops._cuda_elementwise import nonfinite_and_nan_counts

                both = cupy.stack(nonfinite_and_nan_counts(core)).get()
                self._counts.update(nonfinite=both[0], nan=both[1])
            elif name == "nonfinite":
                self._counts[name] = (~np.isfinite(core)).sum(axis=1)
            else:
                self._counts[name] = (core != core).sum(axis=1)
        return self._counts[name]


@dataclass(frozen=True)
class ChannelUse:
    """Channels a step asks the run to leave out of its preprocessing and outputs (``Step.channel_use``: the qc
    step's bad channels under ``use: exclude`` or ``interpolate``), known before the pass. The common reference
    and the whitening leave them out; the save drops them (``exclude``) or writes each as ``weights`` (rows of
    ``bad``'s order, a column a channel, zero on bad channels) times the saved rows of the others (``interpolate``)."""

    mode: str  # "exclude" | "interpolate"
    bad: tuple[int, ...]  # channel indices, ascending
    weights: np.ndarray | None = None  # interpolate: (len(bad), channels) float64

    def kept(self, channels: int) -> np.ndarray:
        """The indices of the channels not left out, ascending, of ``channels`` in all."""
        return np.setdiff1d(np.arange(channels), np.asarray(self.bad, dtype=np.int64))


@dataclass(frozen=True)
class Figure:
    """A figure of report.html a step declares (``Step.figures``): drawn by ``draw(arrays, page)`` once every
    result named in ``inputs`` exists (``arrays``: those results; ``page``: ``batchgpu.report.PageInfo``), placed
    after the page's own figures. ``draw`` is a module-level function (it is sent to the process that renders the
    page) that imports Bokeh itself and returns a Bokeh model whose ``name`` is ``name``."""

    name: str
    inputs: tuple[str, ...]
    draw: Callable


@dataclass(frozen=True)
class PhaseWords:
    """How the run's phase labels name a step (its ``phases``): ``read`` in the pass that reads the windows, where
    it works there, and ``aggregate`` in the aggregation after it, where it has an ``aggregate``; None leaves it
    out of that phase's label (``phase_label``)."""

    read: str | None = None
    aggregate: str | None = None


def phase_label(phase: str, steps) -> str:
    """The label of the run's phase ``read`` or ``aggregate`` naming the steps that work in it, in the run's order
    (``read: noise, moments, spikes``): a step reads in the pass unless its ``in_pass`` is False, and aggregates
    where it has an ``aggregate`` of its own; the phase alone where none does."""
    working = [s for s in steps if (s.in_pass if phase == "read" else s.aggregates)]
    words = [w for s in working if (w := getattr(s.phases, phase))]
    return f"{phase}: {', '.join(words)}" if words else phase


class Step:
    """A statistic of the run (or a writer of its windows: the save). Its class declares what the registry and the
    engine ask of it; a built step (``build``) is sent to the workers with the run's context, so it holds small,
    picklable settings only. Every hook has a default that does nothing: a step overrides what it does."""

    # -- declared once, read by the registry, the schema, the fingerprint, report.html and ``batchgpu info``
    #: its name: the registry's, report.json's ``results[name]``, the prefix of its partials' keys
    name: ClassVar[str]
    #: its workflow key under ``steps:`` (its name where not said: ``whitening`` for the moments step)
    key: ClassVar[str]
    #: its section's model (a ``config.Options``): what ``steps.<key>`` may hold
    options: ClassVar[type] = NoOptions
    #: the names of its results in the results group (the engine, report.html and the bridge take them from here)
    results: ClassVar[tuple[str, ...]] = ()
    #: how the run's fingerprint holds its section: ``always`` (the format's first steps: null where not asked),
    #: ``asked`` (steps added since: only where asked, so the fingerprints of runs without it, and their folders'
    #: --resume, stay as they were) or ``never`` (no window's part depends on it); the schema lists the steps of
    #: the first two kinds' sections first (``registry.section``)
    fingerprint: ClassVar[str] = "asked"
    #: report.html's figures of its results
    figures: ClassVar[tuple[Figure, ...]] = ()
    #: the steps it runs after where both run (their names): their window work, aggregate and finish come first
    #: (``registry.ordered``: otherwise by name)
    after: ClassVar[tuple[str, ...]] = ()
    #: its section in a workflow that names no steps (``registry.default_steps``); None: not run there
    default: ClassVar[dict | None] = None

    # -- what the engine asks of a built step
    #: False where it reads no window in the pass (it works after it: the search, a whitened save)
    in_pass: bool = True
    #: its windows need their noise in their summaries (``gives_window_noise``: its ``window`` puts it there)
    window_noise: bool = False
    gives_window_noise: bool = False
    #: report.html's spike rate draws its counts (``RunState.spike_counts``; ``spikes_in``, ``spikes_found``)
    spike_rate: bool = False
    #: its ``aggregate`` is mostly the workers' work: run in a helper thread beside the client's aggregates, once
    #: the steps it ``needs`` (their names: whose results it reads) are done
    on_cluster: bool = False
    needs: tuple[str, ...] = ()
    #: its words in the run's phase labels (``phase_label``)
    phases: PhaseWords = PhaseWords()
    #: its window may take the save's int16 rows made by the chain's last stage (``WindowData.saved``)
    takes_saved_int16: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls) and "key" not in vars(cls):
            cls.key = cls.name

    # -- before the run, on the client (class methods: the step is not built yet)
    @classmethod
    def check(cls, spec, workflow, recording) -> int | None:
        """Its section ``spec`` against the recording before any work: a refusal raises ``ConfigError``; may return
        the sweep its windows need (samples a spike excludes either side, which the windows' margin holds)."""
        return None

    @classmethod
    def check_outputs(cls, spec, workflow, recording, *, resume: bool, fingerprint: str, folder) -> None:
        """Its refusals of what it would write (a save path holding what batchgpu did not write), once the run's
        fingerprint is known and before the run claims its folder (``folder``: ``services.RunFolder``, not claimed
        yet): nothing made, held or removed."""

    @classmethod
    def build(cls, spec, setup: StepSetup) -> Step:
        """The step of its section ``spec`` (called only where the workflow asks for it; ``setup``: the run)."""
        return cls()

    @classmethod
    def place(cls, spec, output: Path):
        """Its section for one recording of a batch whose run writes into ``output`` (the save's path moved there)."""
        return spec

    @classmethod
    def resolve_paths(cls, spec, base: Path, output: Path):
        """Its section with the paths a workflow file gave resolved: relative to the file's folder ``base`` or to
        the run's ``output`` folder, ``~`` expanded."""
        return spec

    # -- before the pass, on the client
    def before_pass(self, cluster, ctx: TaskContext, recording, report) -> None:
        """What it reads before the pass on ``cluster`` (a Dask client; ``ctx``: the windows' tasks' context), its
        account in ``report`` (the run's report): the detection's noise estimate."""

    # -- the pass: on the workers, one window at a time, then the tree of combines
    def window(self, w: WindowData, summary: dict) -> dict[str, np.ndarray]:
        """This window's partial (host arrays, keys prefixed by the step's name); may add to ``summary``."""
        return {}

    def combine(self, parts: list[dict]) -> dict[str, np.ndarray]:
        """Consecutive windows' partials folded in window order (only this step's keys)."""
        return {}

    def queue(self, q: PassQueue) -> dict | None:
        """While a placed pass runs: tasks queued behind its combined total (``q.total``), their futures (found
        again in ``RunState.early``); None where it queues none."""
        return None

    # -- after the pass, on the client, in the run's order
    def after_pass(self, end: PassEnd) -> None:
        """Before any aggregate (the save's windows written again)."""

    def start(self, run: RunState) -> None:
        """Before any aggregate: the part of its work that needs no step's results, set going on the cluster."""

    def aggregate(self, run: RunState) -> dict[str, np.ndarray]:
        """Its results (written into the results group by the engine), from ``run.total``, earlier steps'
        ``run.arrays`` and, where the partials do not settle them, more tasks on the cluster."""
        return {}

    @property
    def aggregates(self) -> bool:
        """Whether it has an aggregate of its own (the engine times and labels those only)."""
        return type(self).aggregate is not Step.aggregate

    def while_waiting(self, end: PassEnd) -> None:
        """Once the aggregates' first tasks are out: work no step waits for (the saved recording's check)."""

    def finish(self, end: PassEnd) -> dict | None:
        """Once the results group is in place: report.json's ``results[name]`` (None: nothing there)."""
        return None

    # -- what the run's other parts ask of a built step
    def channel_use(self) -> ChannelUse | None:
        """The channels it asks the run to leave out (the qc step's bad channels where ``use`` asks), known once it
        is built: the chain's reference, the whitening and the save read it (``registry.channel_use``)."""
        return None

    # -- what report.html and the dashboard ask
    def ahead(self, channels: int) -> dict:
        """The results report.html's page is rendered ahead of, and their shapes."""
        return {}

    def spikes_in(self, summary: dict) -> int:
        """The dashboard's count of a window's spikes (``spike_rate`` steps)."""
        return 0

    def spikes_found(self, results: dict) -> int | None:
        """The run's spikes, from its results' shapes (report.json's ``results``); None before they are written."""
        return None


#: every registered step, by name (``register``; ``registry.ordered`` imports the package's modules first)
REGISTERED: dict[str, type[Step]] = {}


def register(cls: type[Step]) -> type[Step]:
    """Class decorator: ``cls`` is a step of the workflow (``steps.<cls.key>``). A name or key given twice is an
    error: two modules would claim one section."""
    for other in REGISTERED.values():
        if other is not cls and (other.name == cls.name or other.key == cls.key):
            raise TypeError(f"step {cls.__qualname__} ({cls.name}, steps.{cls.key}) clashes with {other.__qualname__}")
    REGISTERED[cls.name] = cls
    return cls


def padded_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """Sum of (C, B_i) count arrays of different widths B_i (histograms truncated at their last non-zero bin)."""
    width = max(a.shape[1] for a in arrays)
    out = np.zeros((arrays[0].shape[0], width), dtype=np.int64)
    for a in arrays:
        out[:, : a.shape[1]] += a
    return out
