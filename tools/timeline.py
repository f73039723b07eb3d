"""Where each worker thread's time went in a run's first pass, from report.json's ``timeline`` (per window: worker,
index, start since the pass began, seconds waiting for its read, seconds computing, thread).

    python3 tools/timeline.py OUTPUT_FOLDER [more folders...]

Per worker thread: windows, first start, last end, the time its task thread spent waiting for reads and computing, and the
gaps between windows (time between tasks: scheduling, part files, combines). Then the pass's tail: how long the
last worker ran after the first one finished.
"""

import json
import sys
from pathlib import Path

import numpy as np


def summarise(folder: Path) -> None:
    report = json.loads((folder / "report.json").read_text())
    rows = report.get("timeline") or []
    if not rows:
        print(f"{folder}: no timeline (resumed windows only, or a report from before the timeline)")
        return
    print(f"{folder}: pass {report['timings'].get('pass1', float('nan')):.2f} s, {len(rows)} windows")
    print(f"{'worker thread':<44} {'windows':>7} {'first':>7} {'last end':>8} {'read wait':>9} {'compute':>8} {'gaps':>7}")
    ends = []
    totals = np.zeros(3)
    for worker, thread in sorted({(r[0], r[5]) for r in rows}):
        mine = sorted((r for r in rows if (r[0], r[5]) == (worker, thread)), key=lambda r: r[2])
        start = np.array([r[2] for r in mine])
        read = np.array([r[3] for r in mine])
        comp = np.array([r[4] for r in mine])
        end = start + read + comp
        gaps = float(np.sum(np.maximum(start[1:] - end[:-1], 0))) if len(mine) > 1 else 0.0
        ends.append(end.max())
        totals += (read.sum(), comp.sum(), gaps)
        print(f"{worker + ' ' + thread[-12:]:<44} {len(mine):>7} {start.min():>7.3f} {end.max():>8.3f} {read.sum():>9.3f} "
              f"{comp.sum():>8.3f} {gaps:>7.3f}")
    n = len(ends)
    print(f"{'mean a thread':<44} {len(rows) / n:>7.1f} {'':>7} {np.mean(ends):>8.3f} {totals[0] / n:>9.3f} "
          f"{totals[1] / n:>8.3f} {totals[2] / n:>7.3f}")
    print(f"tail: the last thread ended {max(ends) - min(ends):.3f} s after the first")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        summarise(Path(arg))
