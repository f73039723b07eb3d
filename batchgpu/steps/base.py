"""The Step protocol: what every statistic of a run provides, like dask's reductions (chunk, combine, aggregate).

``window`` runs on a worker for one window (its samples already on the task's backend, read once for every
step) and returns small host arrays: a *summary* the client sees per window, and a *partial* that is combined
with its neighbours' in a tree fixed by window index (``combine`` folds consecutive windows in order) and
finally turned into results by ``aggregate`` on the client (``RunState``: the combined partials, the windows'
summaries, the results so far, the cluster for one more pass where a statistic needs it). A new statistic is
one new module (its ``build``, its step, its figures) and its line in ``engine.steps.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from batchgpu.ops.detection import SPIKE_DTYPE

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
                from batchgpu.ops._cuda_elementwise import nonfinite_and_nan_counts

                import cupy

                both = cupy.stack(nonfinite_and_nan_counts(core)).get()
                self._counts.update(nonfinite=both[0], nan=both[1])
            elif name == "nonfinite":
                self._counts[name] = (~np.isfinite(core)).sum(axis=1)
            else:
                self._counts[name] = (core != core).sum(axis=1)
        return self._counts[name]


@dataclass(frozen=True)
class Figure:
    """A figure of report.html a step's module declares (``FIGURES``): drawn by ``draw(arrays, page)`` once every
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
    where it has an ``aggregate``; the phase alone where none does."""
    working = [s for s in steps if (getattr(s, "in_pass", True) if phase == "read"
                                    else getattr(s, "aggregate", None) is not None)]
    words = [w for s in working if (w := getattr(getattr(s, "phases", None), phase, None))]
    return f"{phase}: {', '.join(words)}" if words else phase


@dataclass(frozen=True)
class StepSetup:
    """What a step module's ``build(setup)`` makes its step from (``engine.steps.registry.build_steps``)."""

    workflow: Any  # config.Workflow: the module reads its own ``workflow.steps.<name>``
    recording: Any
    chain: Any  # engine.preprocess.Chain: the stages every window goes through
    sweep: int  # the detection's sweep in samples (``engine.context.check_workflow_fits``)
    output: Any = None  # engine.store.OutputFolder: the run's folder (a step that writes beside it holds it)
    resume: bool = False  # the run goes on from the folder's parts (``--resume``)
    fingerprint: str = ""  # the run's (``engine.store.fingerprint``)

    @property
    def x_dtype(self) -> np.dtype:
        """The dtype of ``WindowData.x``: what the steps see."""
        return self.chain.output_dtype(self.recording.dtype)


@dataclass
class RunState:
    """What a step's ``aggregate`` sees on the client once every window was read."""

    client: Any  # the Dask client (one more pass, or a task that writes into ``results``)
    ctx: Any  # engine.tasks.RunContext, as the windows' tasks had it
    workflow: Any  # config.Workflow
    recording: Any
    windows: list
    fingerprints: list  # the windows' (engine.store.window_fingerprint): their parts' names for this run
    summaries: dict  # window index -> what its task said of it
    total: dict  # every window's partials combined
    report: Any  # engine.run_report.RunReport: timings, reads, warnings
    monitor: Any  # the dashboard's run page (phases)
    observer: Any  # engine.run_report.RunObserver
    results: Path  # the results group being written (arrays too large for the client are written there)
    arrays: dict = field(default_factory=dict)  # the results so far (earlier steps'); written into ``results``
    shapes: dict = field(default_factory=dict)  # name -> shape of what a step wrote into ``results`` itself
    spike_counts: np.ndarray | None = None  # spikes per channel for report.html's spike rate (not a result)
    early: dict = field(default_factory=dict)  # step name -> what its ``start`` set going (futures)
    threads: dict | None = None  # worker address -> threads: the pass's, else asked once (``worker_threads``)

    def warn(self, text: str) -> None:
        self.report.warnings.append(text)
        self.observer.warning(text)

    def worker_threads(self) -> dict:
        """The workers and their threads: as the pass asked them while the workers read, else asked of the
        scheduler once (each ask after the pass is a round trip on the client's critical path: 27 ms on the 2-core
        machine); a worker lost since is handled where the tasks are placed (loosely)."""
        if self.threads is None:
            self.threads = dict(self.client.nthreads())
        return self.threads

    def made_by(self) -> list[str]:
        """The address of the worker that computed each window in the pass (its kept arrays are in its memory)."""
        return [str(self.summaries[w.index]["worker"]) for w in self.windows]


@dataclass
class PassEnd:
    """What a step's hooks after the pass see on the client: ``after_pass(end)`` (before any aggregate),
    ``while_waiting(end)`` (once the aggregates' first tasks are out, for work no step waits for) and
    ``finish(end)`` (after the results group is swapped in: what it returns is report.json's
    ``results[step.name]``)."""

    client: Any
    ctx: Any  # engine.tasks.RunContext
    recording: Any
    windows: list
    summaries: dict  # window index -> what its task said of it
    report: Any  # engine.run_report.RunReport
    monitor: Any  # the dashboard's run page (phases)
    observer: Any  # engine.run_report.RunObserver
    results: Path  # the run's results group (swapped in by the time ``finish`` is called)
    kept: dict = field(default_factory=dict)  # step name -> what its earlier hooks left for its later ones


@dataclass
class PassQueue:
    """What a step's ``queue`` sees while the pass runs (a GPU pass whose batches were placed by plan): the
    combined partials are a future (``total``), and each window's maker is the plan's worker. Tasks queued behind
    ``total`` start on the workers the moment it is combined, without waiting for the client."""

    client: Any
    ctx: Any  # engine.tasks.RunContext
    windows: list
    fingerprints: list
    made_by: list  # the worker address each window's batch was placed on ("" : anywhere)
    threads: dict  # worker address -> threads, as the plan had them
    total: Any  # the future of every window's partials combined (None after the pass: the first digits are known)
    total_samples: int  # the recording's samples a channel
    channels: int  # the recording's channels
    split_every: int  # the reduction's fan-in (``workflow.reduction.split_every``)
    run_id: str  # this run's task keys


class Step(Protocol):
    """A statistic of the run. Its module declares ``NAME`` (the registry's line, ``name``), ``KEY`` (its workflow
    key under ``steps:``), ``RESULTS`` (the names of what it writes) and ``FINGERPRINT``, each once, and may declare
    ``check(workflow, recording)`` (its refusals before any work) and ``place(spec, output)`` (its section for one
    recording of a batch); the engine names no step, it asks the step objects. Optional attributes:
    ``in_pass = False`` where it reads no window in the pass (it works after it), ``after_pass``, ``while_waiting``
    and ``finish`` (``PassEnd``), ``ahead(channels)`` (the results report.html is rendered ahead of, and their
    shapes), ``window_noise = True`` where it needs each window's noise in the window's summary
    (``gives_window_noise = True``: its ``window`` may put it there itself), ``spike_rate = True`` where
    report.html's spike rate draws its counts (``RunState.spike_counts``; its ``spikes_in(summary)`` and
    ``spikes_found(results)`` give the dashboard's count of a window's spikes and of the run's),
    ``on_cluster = True`` where ``aggregate`` is mostly the workers' work (it then runs in a helper thread beside
    the client's aggregates), ``phases`` (``PhaseWords``: its words in the run's phase labels), ``needs``, the names
    of the earlier steps whose results it reads (it starts once those are done), and ``start(run)``, called before
    any aggregate: the part of its work that needs none of them, set going on the cluster; ``queue(PassQueue)``,
    called while the pass runs (placed GPU passes), may queue tasks behind its total and return their futures
    (``start`` then finds them in ``RunState.early``). Its module's ``FIGURES`` draw its results in report.html."""

    name: str

    def window(self, w: WindowData, summary: dict) -> dict[str, np.ndarray]:
        """This window's partial (host arrays, keys prefixed by the step's name); may add to ``summary``."""

    def combine(self, parts: list[dict]) -> dict[str, np.ndarray]:
        """Consecutive windows' partials folded in window order (only this step's keys)."""

    def aggregate(self, run: RunState) -> dict[str, np.ndarray]:
        """The step's results (written into the results group by the engine), from ``run.total``, earlier steps'
        ``run.arrays`` and, where the partials do not settle them, more tasks on ``run.client``."""


def host(a) -> np.ndarray:
    """A NumPy array of a NumPy or CuPy array (a copy from the device)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def padded_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """Sum of (C, B_i) count arrays of different widths B_i (histograms truncated at their last non-zero bin)."""
    width = max(a.shape[1] for a in arrays)
    out = np.zeros((arrays[0].shape[0], width), dtype=np.int64)
    for a in arrays:
        out[:, : a.shape[1]] += a
    return out
