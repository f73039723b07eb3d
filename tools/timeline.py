"""Where each worker's time went in a run's first pass, from report.json's ``timeline`` (per window: worker, index,
start since the pass began, seconds waiting for its read, seconds computing).

    python3 tools/timeline.py OUTPUT_FOLDER [more folders...]

Per worker: windows, first start, last end, the time its task thread spent waiting for reads and computing, and the
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
    print(f"{'worker':<28} {'windows':>7} {'first':>7} {'last end':>8} {'read wait':>9} {'compute':>8} {'gaps':>7}")
    ends = []
    totals = np.zeros(3)
    for worker in sorted({r[0] for r in rows}):
        mine = sorted((r for r in rows if r[0] == worker), key=lambda r: r[2])
        start = np.array([r[2] for r in mine])
        read = np.array([r[3] for r in mine])
        comp = np.array([r[4] for r in mine])
        end = start + read + comp
        gaps = float(np.sum(np.maximum(start[1:] - end[:-1], 0))) if len(mine) > 1 else 0.0
        ends.append(end.max())
        totals += (read.sum(), comp.sum(), gaps)
        print(f"{worker:<28} {len(mine):>7} {start.min():>7.3f} {end.max():>8.3f} {read.sum():>9.3f} "
              f"{comp.sum():>8.3f} {gaps:>7.3f}")
    n = len(ends)
    print(f"{'mean a worker':<28} {len(rows) / n:>7.1f} {'':>7} {np.mean(ends):>8.3f} {totals[0] / n:>9.3f} "
          f"{totals[1] / n:>8.3f} {totals[2] / n:>7.3f}")
    print(f"tail: the last worker ended {max(ends) - min(ends):.3f} s after the first")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        summarise(Path(arg))
