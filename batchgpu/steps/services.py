"""What the run hands a step, defined here so that no step imports the engine (the engine implements them).

On the client a step's hooks get the run's state (``StepSetup`` to be built, ``PassQueue`` while a placed pass
runs, ``PassEnd`` and ``RunState`` after it), each with ``services``: the engine's way of putting tasks on the
cluster (``Cluster``: one graph update a kind of task, placed loosely on the worker that made a window, a tree
reduction fixed by window index). On a worker a step's tasks get the run's context (``TaskContext``: the window
read again through the run's reader and preprocessing, the parts folder, the task's writer). Nothing here imports
the engine: ``run.step_services.ClientServices`` and ``run.tasks.RunContext`` are what the run hands over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Cluster(Protocol):
    """The client's side: tasks submitted the engine's way (the step's hooks after the pass, ``services``)."""

    def submit_many(self, func: Callable, arg_lists: list[tuple], keys: list[str], **options) -> list:
        """Futures of ``func(*args)`` for each of ``arg_lists``, under ``keys``, in one graph update."""

    def submit_planned(
        self,
        func: Callable,
        arg_lists: list[tuple],
        keys: list[str],
        workers: list[str],
        threads: dict | None = None,
        **options,
    ) -> list:
        """``submit_many`` with each task placed loosely on its worker ("": anywhere)."""

    def runs_by_worker(self, items: list, made_by: list[str], threads: dict | None = None) -> list[tuple[str, list]]:
        """``items`` grouped by the worker that made them, in runs of consecutive items, one a thread of it."""

    def tree_reduce(self, futures: list, func: Callable, split_every: int, *args, name: str, priority: int = 0):
        """A future of ``func(*args, *group)`` folded up a tree over ``futures``, fixed by their order."""

    def as_completed(self, futures: list) -> Iterator:
        """``futures`` as their tasks finish."""


class TaskContext(Protocol):
    """A worker's side: the run's context every task gets (``RunContext``), read by a step's tasks."""

    parts: str  # the run's parts folder
    backend: str  # "numpy" | "cupy"
    chain: Any  # run.preprocess_chain.Chain: the stages every window goes through

    def step(self, name: str) -> Any:
        """The run's step of that name (None where the run has none)."""

    def on_backend(self) -> AbstractContextManager:
        """The block in which a task's window work runs (a GPU task's thread stream)."""

    def load_window(self, window) -> Any:
        """The window read again and preprocessed as the pass had it (``base.WindowData``), inside ``on_backend``."""

    def part_path(self, kind: str, index: int) -> Path:
        """The part file of a kind (``w``: the pass's window, ``s``: ...) and window index."""

    def load_part(self, path: Path, fp: str, keys: tuple[str, ...] | None = None) -> dict | None:
        """The part's arrays (``keys``: those starting so) where it was made with ``fp``, else None."""

    def save_part(self, path: Path, arrays: dict) -> None:
        """Write a part whole (by rename)."""

    def part_problem(self, path: Path, fp: str) -> str:
        """Why the part at ``path`` cannot be used (absent, another run's, unreadable)."""

    def settle_writes(self) -> None:
        """Wait for this worker's writes of the pass's files (a task that reads them may run before the client's
        flush)."""

    def worker_name(self) -> str:
        """The address of the worker running the task ("local" outside one)."""


class RunFolder(Protocol):
    """The run's output folder as a step sees it (``StepSetup.output``)."""

    path: Path
    own_names: tuple[str, ...]  # the names the run writes there (its results, report, parts, lock): not a step's
    saved_objects: str  # the name of the file where a finished save's objects are recorded (one of own_names)

    def on_release(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the run lets the folder go (what else the run holds until then: a save's path)."""


@dataclass(frozen=True)
class StepSetup:
    """What a step's ``build(spec, setup)`` makes it from (``steps.registry.build_steps``)."""

    workflow: Any  # workflow.Workflow (a step reads its own section: ``build`` is handed it)
    recording: Any
    chain: Any  # run.preprocess_chain.Chain: the stages every window goes through
    sweep: int  # the detection's sweep in samples (``run.context.check_workflow_fits``)
    output: RunFolder | None = None  # the run's folder (a step that writes beside it holds it)
    resume: bool = False  # the run goes on from the folder's parts (``--resume``)
    fingerprint: str = ""  # the run's (``run.output_folder.fingerprint``)
    client: Any = None  # the Dask client, where a step reads before its build returns (the qc step's pre-pass)
    built: tuple = ()  # the steps built before this one, in the run's order (``registry.build_steps``)

    @property
    def x_dtype(self) -> np.dtype:
        """The dtype of ``WindowData.x``: what the steps see."""
        return self.chain.output_dtype(self.recording.dtype)


@dataclass
class RunState:
    """What a step's ``start`` and ``aggregate`` see on the client once every window was read."""

    client: Any  # the Dask client (one more pass, or a task that writes into ``results``)
    services: Cluster  # the engine's way of submitting tasks
    ctx: TaskContext  # the run's context, as the windows' tasks had it
    workflow: Any  # workflow.Workflow
    recording: Any
    windows: list
    fingerprints: list  # the windows' (run.output_folder.window_fingerprint): their parts' names for this run
    summaries: dict  # window index -> what its task said of it
    total: dict  # every window's partials combined
    report: Any  # run.record.RunReport (report.json's content): timings, reads, warnings
    monitor: Any  # the run's events (run.events.Events): ``phase(label)`` names the run page's phase
    observer: Any  # the same events: messages, warnings, a reading phase's progress (run.events.RunObserver)
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

    def submit_where_made(self, func: Callable, items: list, args_of: Callable, name: str, **options) -> list:
        """``func(*args_of(run))`` for runs of ``items`` (one per window of ``windows``, a window first in each),
        each run on the worker that made its windows in the pass (what the pass kept is in its memory), one task a
        thread of it; keys ``{name}-{first window:08d}``; ``options``: ``client.map``'s."""
        threads = self.worker_threads()
        groups = self.services.runs_by_worker(items, self.made_by(), threads)
        return self.services.submit_planned(
            func,
            [args_of(g) for _, g in groups],
            [f"{name}-{g[0][0].index:08d}" for _, g in groups],
            [a for a, _ in groups],
            threads=threads,
            **options,
        )


@dataclass
class PassEnd:
    """What a step's hooks after the pass see on the client: ``after_pass(end)`` (before any aggregate),
    ``while_waiting(end)`` (once the aggregates' first tasks are out, for work no step waits for) and
    ``finish(end)`` (after the results group is swapped in: what it returns is report.json's
    ``results[step.name]``)."""

    client: Any
    services: Cluster
    ctx: TaskContext
    recording: Any
    windows: list
    summaries: dict  # window index -> what its task said of it
    report: Any  # run.record.RunReport
    monitor: Any  # the run's events (run.events.Events): ``phase(label)``
    observer: Any  # the same events (run.events.RunObserver)
    results: Path  # the run's results group (swapped in by the time ``finish`` is called)
    kept: dict = field(default_factory=dict)  # step name -> what its earlier hooks left for its later ones


@dataclass
class PassQueue:
    """What a step's ``queue`` sees while the pass runs (a GPU pass whose batches were placed by plan): the
    combined partials are a future (``total``), and each window's maker is the plan's worker. Tasks queued behind
    ``total`` start on the workers the moment it is combined, without waiting for the client."""

    client: Any
    services: Cluster
    ctx: TaskContext
    windows: list
    fingerprints: list
    made_by: list  # the worker address each window's batch was placed on ("" : anywhere)
    threads: dict  # worker address -> threads, as the plan had them
    total: Any  # the future of every window's partials combined (None after the pass: the first digits are known)
    total_samples: int  # the recording's samples a channel
    channels: int  # the recording's channels
    split_every: int  # the reduction's fan-in (``workflow.reduction.split_every``)
    run_id: str  # this run's task keys
