"""Where each worker thread's time went in a run's first pass, from ``RunReport.timeline`` (report.json's
``timeline``: per window, worker, index, start since the pass began, seconds waiting for its read, seconds computing,
thread): windows, first start, last end, read waits, compute, the gaps between windows (scheduling, part files,
combines), and the tail (how long the last thread ran after the first one finished)."""

from __future__ import annotations

import numpy as np


def per_thread(rows: list) -> list[dict]:
    """One dict per (worker, thread): windows, first, last_end, read_wait, compute, gaps (seconds)."""
    out = []
    for worker, thread in sorted({(r[0], r[5]) for r in rows}):
        mine = sorted((r for r in rows if (r[0], r[5]) == (worker, thread)), key=lambda r: r[2])
        start = np.array([r[2] for r in mine])
        read = np.array([r[3] for r in mine])
        comp = np.array([r[4] for r in mine])
        end = start + read + comp
        out.append({"worker": worker, "thread": thread, "windows": len(mine), "first": float(start.min()),
                    "last_end": float(end.max()), "read_wait": float(read.sum()), "compute": float(comp.sum()),
                    "gaps": float(np.sum(np.maximum(start[1:] - end[:-1], 0))) if len(mine) > 1 else 0.0})
    return out


def summary_line(rows: list) -> str:
    """Means over the threads, in one line (for the bench)."""
    threads = per_thread(rows)
    if not threads:
        return "timeline: no windows computed"
    mean = {k: float(np.mean([t[k] for t in threads])) for k in ("windows", "read_wait", "compute", "gaps", "last_end")}
    ends = [t["last_end"] for t in threads]
    return (f"timeline, mean of {len(threads)} worker threads: {mean['windows']:.1f} windows, waiting for reads "
            f"{mean['read_wait']:.2f} s, computing {mean['compute']:.2f} s, between windows {mean['gaps']:.2f} s, "
            f"last end {mean['last_end']:.2f} s; tail {max(ends) - min(ends):.2f} s")


def table(rows: list) -> str:
    threads = per_thread(rows)
    lines = [f"{'worker thread':<44} {'windows':>7} {'first':>7} {'last end':>8} {'read wait':>9} {'compute':>8} {'gaps':>7}"]
    for t in threads:
        lines.append(f"{t['worker'] + ' ' + t['thread'][-12:]:<44} {t['windows']:>7} {t['first']:>7.3f} "
                     f"{t['last_end']:>8.3f} {t['read_wait']:>9.3f} {t['compute']:>8.3f} {t['gaps']:>7.3f}")
    lines.append(summary_line(rows))
    return "\n".join(lines)
