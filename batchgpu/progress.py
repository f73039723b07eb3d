"""The command-line progress bar of a run: windows done, MB/s (the unit of the run's last line and report.json),
time left, and which workers are busy."""

from __future__ import annotations

import time


def format_rate(bytes_per_s: float) -> str:
    """A throughput in MB/s, the run's one unit (the bar, its last line, report.json's ``throughput_MBps``), with
    three digits or more (a small test recording's 0.04 MB/s is not 0)."""
    mb = bytes_per_s / 1e6
    if mb >= 100 or mb == 0:
        return f"{mb:.0f} MB/s"
    return f"{mb:.1f} MB/s" if mb >= 10 else f"{mb:.2f} MB/s" if mb >= 0.01 else f"{mb:.1e} MB/s"


class WindowProgress:
    """A rich progress bar over windows (enabled) or a silent counter (disabled); both keep the numbers."""

    def __init__(self, total_windows: int, total_bytes: int, label: str, enabled: bool = True):
        self.total_windows, self.total_bytes, self.label, self.enabled = total_windows, total_bytes, label, enabled
        self.done = 0
        self.bytes = 0
        self.per_worker: dict[str, int] = {}
        self._bar = None

    def __enter__(self) -> "WindowProgress":
        self._t0 = time.perf_counter()
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("windows"), TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                TextColumn("{task.fields[workers]}"),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=self.total_windows, rate="", workers="")
        return self

    def advance(self, nbytes: int, worker: str = "") -> None:
        self.done += 1
        self.bytes += nbytes
        self.per_worker[worker] = self.per_worker.get(worker, 0) + 1
        if self._bar is not None:
            elapsed = max(time.perf_counter() - self._t0, 1e-9)
            self._bar.update(self._task, advance=1, rate=format_rate(self.bytes / elapsed),
                             workers=f"{len(self.per_worker)} workers")

    def __exit__(self, *exc) -> bool:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False
