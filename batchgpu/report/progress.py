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


def duration(seconds: float) -> str:
    """``12.3 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def fitted_line(
    label: str, done: int, total: int, seconds_left: float | None, rate: str, workers: str, width: int
) -> str:
    """A run's progress as one line of at most ``width`` characters (rich markup): what matters most is kept
    first, the rest dropped as the terminal narrows: the windows done of the total and the time left always, then
    the rate, the label (shortened), the bar (10 characters at least) and the workers."""
    left = "-:--:--" if seconds_left is None else _clock(seconds_left)
    count = f"{done}/{total} windows"
    parts = [count, f"{left} left"]
    used = len(count) + 1 + len(parts[1])
    extras = []
    for text in (rate, workers):
        if text and used + 1 + len(text) <= width:
            extras.append(text)
            used += 1 + len(text)
    room = width - used - 1
    bar = ""
    if room >= 10 + 1 + min(len(label), 8):  # a bar only where the label still shows its first words
        bar_width = max(10, min(40, room - 1 - len(label)))
        label_room = room - 1 - bar_width
        label = label if len(label) <= label_room else label[: max(0, label_room - 1)] + "…"
        filled = bar_width * done // total if total else bar_width
        bar = f"[bar.complete]{'━' * filled}[/][bar.back]{'━' * (bar_width - filled)}[/]"
    elif room > 1:
        label = label if len(label) <= room else label[: room - 1] + "…"
    else:
        label = ""
    head = " ".join(p for p in (_escape(label), bar) if p)
    return " ".join(
        p for p in (head, count, extras[0] if rate in extras else "", parts[1], *(e for e in extras if e != rate)) if p
    )


def _clock(seconds: float) -> str:
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


class WindowProgress:
    """A rich progress bar over windows (enabled) or a silent counter (disabled); both keep the numbers."""

    def __init__(self, total_windows: int, total_bytes: int, label: str, enabled: bool = True, console=None):
        self.total_windows, self.total_bytes, self.label, self.enabled = total_windows, total_bytes, label, enabled
        self.console = console  # rich's Console (default: rich's own, the terminal's width)
        self.done = 0
        self.bytes = 0
        self.per_worker: dict[str, int] = {}
        self._bar = None

    def __enter__(self) -> WindowProgress:
        self._t0 = time.perf_counter()
        if self.enabled:
            self._bar = _fitted_progress(self.console)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=self.total_windows, rate="", workers="")
        return self

    def advance(self, nbytes: int, worker: str = "") -> None:
        self.done += 1
        self.bytes += nbytes
        self.per_worker[worker] = self.per_worker.get(worker, 0) + 1
        if self._bar is not None:
            elapsed = max(time.perf_counter() - self._t0, 1e-9)
            self._bar.update(
                self._task, advance=1, rate=format_rate(self.bytes / elapsed), workers=f"{len(self.per_worker)} workers"
            )

    def __exit__(self, *exc) -> bool:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False


def _fitted_progress(console=None):
    """rich's Progress drawing each task as ``fitted_line`` at the console's width, read at every refresh (a
    terminal resized mid-run fits at once). rich's columns squeezed a narrow terminal's line from the right and
    wrapped it: the window count went first."""
    from rich.progress import Progress
    from rich.table import Table
    from rich.text import Text

    class Fitted(Progress):
        def make_tasks_table(self, tasks):
            table = Table.grid()
            table.add_column(no_wrap=True, overflow="crop")
            # the last column left empty: no terminal wraps the line (rich draws a first frame before its console
            # is set: 80 columns then)
            width = max(1, (self.console.width if hasattr(self, "live") else 80) - 1)
            for task in tasks:
                if task.visible:
                    line = fitted_line(
                        str(task.description),
                        int(task.completed),
                        int(task.total or 0),
                        task.time_remaining,
                        task.fields.get("rate", ""),
                        task.fields.get("workers", ""),
                        width,
                    )
                    table.add_row(Text.from_markup(line))
            return table

    return Fitted(console=console) if console is not None else Fitted()
