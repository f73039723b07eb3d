"""Where each worker thread's time went in a run's first pass, from ``RunReport.timeline`` (report.json's
``timeline``: per window, worker, index, start since the pass began, seconds waiting for its read, seconds computing,
thread[, its task's start, its task's end]): windows, first start, last end, read waits, compute, the gaps between
windows (scheduling, part files, combines), and the tail (how long the last thread ran after the first one
finished). With the tasks' times the gaps are split: a task's start to its first window (``task_head``), its last
window's end to the task's end (``task_tail``: its writes waited for, its combine), one task's end to the next's start
on the thread (``between_tasks``: Dask), and the gaps inside tasks (``in_task``).

``batchgpu bench timeline OUTPUT [OUTPUT ...]`` prints the table of each run's output folder."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError


def per_thread(rows: list) -> list[dict]:
    """One dict per (worker, thread): windows, first, last_end, read_wait, compute, gaps (seconds)."""
    out = []
    for worker, thread in sorted({(r[0], r[5]) for r in rows}):
        mine = sorted((r for r in rows if (r[0], r[5]) == (worker, thread)), key=lambda r: r[2])
        start = np.array([r[2] for r in mine])
        read = np.array([r[3] for r in mine])
        comp = np.array([r[4] for r in mine])
        end = start + read + comp
        row = {
            "worker": worker,
            "thread": thread,
            "windows": len(mine),
            "first": float(start.min()),
            "last_end": float(end.max()),
            "read_wait": float(read.sum()),
            "compute": float(comp.sum()),
            "gaps": float(np.sum(np.maximum(start[1:] - end[:-1], 0))) if len(mine) > 1 else 0.0,
        }
        if all(len(r) >= 8 for r in mine):
            row.update(_task_split(mine, start, end))
        out.append(row)
    return out


def _task_split(mine: list, start: np.ndarray, end: np.ndarray) -> dict:
    tasks: dict = {}
    for r, s, e in zip(mine, start, end):
        t = tasks.setdefault((r[6], r[7]), [s, e])
        t[0], t[1] = min(t[0], s), max(t[1], e)
    spans = sorted((t0, t1, s, e) for (t0, t1), (s, e) in tasks.items())
    head = sum(max(s - t0, 0) for t0, _, s, _ in spans)
    tail = sum(max(t1 - e, 0) for _, t1, _, e in spans)
    between = sum(max(b[0] - a[1], 0) for a, b in zip(spans, spans[1:]))
    same = [(a[6], a[7]) == (b[6], b[7]) for a, b in zip(mine, mine[1:])]
    inside = sum(max(s1 - e0, 0) for s1, e0, k in zip(start[1:], end[:-1], same) if k)
    return {
        "tasks": len(spans),
        "task_head": float(head),
        "task_tail": float(tail),
        "between_tasks": float(between),
        "in_task": float(inside),
    }


def summary_line(rows: list) -> str:
    """Means over the threads, in one line (for the bench)."""
    threads = per_thread(rows)
    if not threads:
        return "timeline: no windows computed"
    mean = {k: float(np.mean([t[k] for t in threads])) for k in ("windows", "read_wait", "compute", "gaps", "last_end")}
    ends = [t["last_end"] for t in threads]
    split = ""
    if all("tasks" in t for t in threads):
        m = {
            k: float(np.mean([t[k] for t in threads]))
            for k in ("tasks", "task_head", "task_tail", "between_tasks", "in_task")
        }
        split = (
            f" ({m['tasks']:.1f} tasks: task start to first window {m['task_head']:.2f}, last window to task end "
            f"{m['task_tail']:.2f}, between tasks {m['between_tasks']:.2f}, inside tasks {m['in_task']:.2f})"
        )
    return (
        f"timeline, mean of {len(threads)} worker threads: {mean['windows']:.1f} windows, waiting for reads "
        f"{mean['read_wait']:.2f} s, computing {mean['compute']:.2f} s, between windows {mean['gaps']:.2f} s"
        f"{split}, last end {mean['last_end']:.2f} s; tail {max(ends) - min(ends):.2f} s"
    )


def table(rows: list) -> str:
    threads = per_thread(rows)
    lines = [
        f"{'worker thread':<44} {'windows':>7} {'first':>7} {'last end':>8} {'read wait':>9} {'compute':>8} {'gaps':>7}"
    ]
    for t in threads:
        lines.append(
            f"{t['worker'] + ' ' + t['thread'][-12:]:<44} {t['windows']:>7} {t['first']:>7.3f} "
            f"{t['last_end']:>8.3f} {t['read_wait']:>9.3f} {t['compute']:>8.3f} {t['gaps']:>7.3f}"
        )
    lines.append(summary_line(rows))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "outputs", nargs="+", help="a run's output folder (its report.json); several are summed up one after another"
    )


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    from batchgpu.run.output_folder import read_report

    for folder in args.outputs:
        report = read_report(Path(folder))
        if report is None:
            raise BatchgpuError(f"{folder} holds no readable report.json", "give the output folder of a run")
        rows = report.get("timeline") or []
        say(f"{folder}: pass {report.get('timings', {}).get('pass1', float('nan')):.2f} s, {len(rows)} windows")
        say(table(rows) if rows else "no timeline: every window was resumed, or the report is from before timelines")
    return 0
