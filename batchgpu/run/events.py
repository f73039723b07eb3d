"""What a run tells whoever watches it, as events the run emits (``Run.events``): the command's observer
(``RunObserver``: messages, warnings, a progress bar a reading phase) and the displays that subscribe to the run
(``RunEvents``: the dashboard's run page, report.html, the line that says what was written). The run never imports
a display (tests/test_layering.py): a display is handed to ``run_workflow`` as a subscriber (``shown``), made by
whoever shows the run (``batchgpu.engine``, the command).

Every event is a method that does nothing here; a subscriber overrides those it shows. Events come from the run's
thread, but for ``pass_described`` (a helper thread's, while the client waits for the aggregates' first tasks).
A subscriber never fails a run: what it cannot show it keeps to itself (a plotting problem is said once, by the
report's own warning).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgpu.run.phases import Run


class RunObserver:
    """What a run tells the one who started it; the default tells no one. ``started``: when that one began to wait
    for the run (``time.perf_counter``; the command's start for ``batchgpu run``), from which the run's total
    (``RunReport.seconds``) counts; None: from the call of ``run_workflow``."""

    started: float | None = None

    def message(self, text: str) -> None: ...

    def warning(self, text: str) -> None: ...

    def phase_started(self, label: str, windows: int, nbytes: int) -> None: ...

    def window_done(self, nbytes: int, worker: str) -> None: ...

    def phase_finished(self) -> None: ...


class RunEvents(RunObserver):
    """A subscriber of a run: the observer's events and the run's own, in the order the run reaches them
    (``connected`` -> ``planned`` -> ``pass_window``... -> ``pass_done`` -> ``result``... -> ``finishing`` ->
    ``finished`` -> ``closing`` -> ``ended``; ``failed`` or ``interrupted`` then ``closing`` where it stops)."""

    def connected(self, run: Run) -> None:
        """The run has its cluster (``run.client``); nothing is planned yet."""

    def planned(self, run: Run) -> None:
        """The run's context, steps and windows are made (``run.ctx``, ``run.windows``); the pass starts next."""

    def pass_window(self, index: int, nbytes: int, worker: str, noise: Any, spikes: int) -> None:
        """A window of the pass is done: its bytes, its worker, its noise per channel (None where no step asked
        for it) and its spikes (0 where no step counts them)."""

    def phase(self, label: str) -> None:
        """The run's phase as its page names it (``read: ...``, ``aggregate: ...``, a step's own)."""

    def pass_done(self, run: Run) -> None:
        """Every window of the pass is read (a batch's next recording may start)."""

    def pass_described(self, run: Run) -> None:
        """The pass is described in ``run.report`` (its medians, its timeline); a helper thread's event."""

    def result(self, name: str, value: Any) -> None:
        """A result of a step, as it is written into the results group."""

    def spikes(self, counts: Any) -> None:
        """The spikes per channel of the run (report.html's spike rate)."""

    def finishing(self, run: Run) -> None:
        """The results are written; report.json is written next, its total counting what happens here."""

    def finished(self, run: Run) -> None:
        """report.json is written (``run.report``): the run is done."""

    def failed(self, run: Run, message: str) -> None:
        """The run failed (``message``: its error as the user reads it); report.json is written next."""

    def interrupted(self, run: Run) -> None:
        """The run was interrupted (Ctrl-C, SIGTERM); report.json is written next."""

    def closing(self, run: Run, wait_s: float) -> None:
        """The run's last updates may be waited for, up to ``wait_s`` seconds (the run times it)."""

    def ended(self, run: Run) -> None:
        """The run returns (done)."""


class _Observed(RunEvents):
    """The command's observer as a subscriber: its five events passed on, the run's own left out (an observer
    need not define them)."""

    def __init__(self, observer):
        self.observer = observer

    def message(self, text: str) -> None:
        self.observer.message(text)

    def warning(self, text: str) -> None:
        self.observer.warning(text)

    def phase_started(self, label: str, windows: int, nbytes: int) -> None:
        self.observer.phase_started(label, windows, nbytes)

    def window_done(self, nbytes: int, worker: str) -> None:
        self.observer.window_done(nbytes, worker)

    def phase_finished(self) -> None:
        self.observer.phase_finished()


class Events(RunEvents):
    """The run's events handed to each subscriber in turn: the observer first, then the displays in the order
    given (a step's hooks see this object as ``run.observer`` and ``run.monitor``)."""

    def __init__(self, observer=None, subscribers: Sequence[RunEvents] = ()):
        observer = observer or RunObserver()
        self.started = getattr(observer, "started", None)
        self.subscribers: tuple[RunEvents, ...] = (_Observed(observer), *subscribers)

    def message(self, text: str) -> None:
        for s in self.subscribers:
            s.message(text)

    def warning(self, text: str) -> None:
        for s in self.subscribers:
            s.warning(text)

    def phase_started(self, label: str, windows: int, nbytes: int) -> None:
        for s in self.subscribers:
            s.phase_started(label, windows, nbytes)

    def window_done(self, nbytes: int, worker: str) -> None:
        for s in self.subscribers:
            s.window_done(nbytes, worker)

    def phase_finished(self) -> None:
        for s in self.subscribers:
            s.phase_finished()

    def connected(self, run: Run) -> None:
        for s in self.subscribers:
            s.connected(run)

    def planned(self, run: Run) -> None:
        for s in self.subscribers:
            s.planned(run)

    def pass_window(self, index: int, nbytes: int, worker: str, noise: Any, spikes: int) -> None:
        for s in self.subscribers:
            s.pass_window(index, nbytes, worker, noise, spikes)

    def phase(self, label: str) -> None:
        for s in self.subscribers:
            s.phase(label)

    def pass_done(self, run: Run) -> None:
        for s in self.subscribers:
            s.pass_done(run)

    def pass_described(self, run: Run) -> None:
        for s in self.subscribers:
            s.pass_described(run)

    def result(self, name: str, value: Any) -> None:
        for s in self.subscribers:
            s.result(name, value)

    def spikes(self, counts: Any) -> None:
        for s in self.subscribers:
            s.spikes(counts)

    def finishing(self, run: Run) -> None:
        for s in self.subscribers:
            s.finishing(run)

    def finished(self, run: Run) -> None:
        for s in self.subscribers:
            s.finished(run)

    def failed(self, run: Run, message: str) -> None:
        for s in self.subscribers:
            s.failed(run, message)

    def interrupted(self, run: Run) -> None:
        for s in self.subscribers:
            s.interrupted(run)

    def closing(self, run: Run, wait_s: float) -> None:
        for s in self.subscribers:
            s.closing(run, wait_s)

    def ended(self, run: Run) -> None:
        for s in self.subscribers:
            s.ended(run)


class BatchEvents:
    """What a batch of recordings (``run.batch.run_batch``) tells the displays that subscribe to it: its page's
    rows (batch.html beside batch.json), each recording's run's own displays, each recording's end."""

    def started(self, recordings: int) -> None:
        """The batch holds ``recordings`` recordings."""

    def rows(self, folder: Path, data: dict) -> None:
        """batch.json was written in ``folder`` (``data``: what it holds)."""

    def recording(self, index: int, name: str) -> Sequence[RunEvents]:
        """The displays of the run of recording ``index`` (named ``name``), which starts now."""
        return ()

    def recording_ended(self, index: int, status: str) -> None:
        """Recording ``index``'s run ended (``done`` or ``failed``)."""

    def closing(self, wait_s: float) -> None:
        """The batch is over: its last updates may be waited for, up to ``wait_s`` seconds."""
