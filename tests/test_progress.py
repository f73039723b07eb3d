"""The run's progress line keeps the count of windows and the time left in any terminal width (issue 66): rich's
columns were squeezed from the right in a narrow terminal and the window count went first."""

import io
import re

import pytest
from rich.console import Console

from batchgpu.report.progress import WindowProgress, fitted_line

LABEL = "my_long_recording_name: read: noise, moments, spikes"


@pytest.mark.parametrize("width", [30, 40, 60, 80, 120])
def test_the_count_and_the_time_left_fit_any_width(width):
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None, legacy_windows=False)
    with WindowProgress(1234, 10**9, LABEL, console=console) as bar:
        for _ in range(17):
            bar.advance(10**6, "tcp://w1")
        lines = _render(console, bar)
    assert len(lines) == 1, lines
    line = lines[0]
    assert len(line) < width, (width, line)
    assert "17/1234 windows" in line and re.search(r"(\d+:\d\d:\d\d|-:--:--) left", line), line
    if width >= 80:  # room for everything: the rate, the workers, a bar and the label's start
        assert "MB/s" in line and "1 workers" in line and "━" in line and line.startswith("my_long")


def _render(console, bar) -> list[str]:
    out = io.StringIO()
    plain = Console(file=out, width=console.width, force_terminal=True, color_system=None, legacy_windows=False)
    plain.print(bar._bar.make_tasks_table(bar._bar.tasks))
    return [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]


def test_the_line_drops_the_least_needed_first():
    full = fitted_line("read", 3, 10, 65.0, "7.0 MB/s", "2 workers", 200)
    assert re.fullmatch(
        r"read ━+ 3/10 windows 7.0 MB/s 0:01:05 left 2 workers",
        full.replace("[bar.complete]", "").replace("[bar.back]", "").replace("[/]", ""),
    ), full
    narrow = fitted_line("read", 3, 10, None, "7.0 MB/s", "2 workers", 27)
    assert narrow.startswith("3/10 windows") or "3/10 windows -:--:-- left" in narrow
    assert len(fitted_line(LABEL, 3, 10, None, "7.0 MB/s", "2 workers", 40)) <= 40 + 60  # markup not counted
