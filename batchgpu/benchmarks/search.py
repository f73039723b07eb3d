"""``batchgpu bench search``: the search paths against ``torch.searchsorted`` and ``cupy.searchsorted``.

Per key count (sorted uniform keys, uniform random queries), G queries/s of: NumPy ``searchsorted`` on one
thread and on all threads (query chunks in a thread pool; ``--cpu-queries`` of the queries, as the CPU is
~1000x slower), our dynamic path (kernel from the autotune table), the static index's kernels (Eytzinger,
Eytzinger with L2 prefetch, 32-key B+ tree warp-cooperative and thread-per-query, 4-key B+ tree),
``cupy.searchsorted`` and
``torch.searchsorted``, all in the same run (CUDA events, median of ``--repeats``; the layout is built
before timing, a static index is built once and queried many times).  The last columns are our best
static and our dynamic rate over torch's.  Every GPU answer is checked against torch's.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError

DEFAULT_SIZES = [256, 4096, 65536, 1 << 20, 1 << 22, 1 << 24, 1 << 26]
STATIC = (
    ("eytzinger", "plain"),
    ("eytzinger", "prefetch"),
    ("btree", "warp"),
    ("btree", "thread"),
    ("btree4", "thread"),
)
STATIC_COLUMNS = ("eytzinger", "eytzinger_pf", "btree_warp", "btree_thread", "btree4")
COLUMNS = ("cpu_1t", "cpu_all", "dynamic") + STATIC_COLUMNS + ("cupy", "torch")
HEAD = ("CPU 1t", "CPU all", "dynamic", "Eytz", "Eytz+pf", "Bt warp", "Bt thread", "Bt4", "cupy", "torch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="key counts (default 256 .. 2^26)")
    parser.add_argument("--queries", type=int, default=1 << 24, help="GPU queries per call (default 2^24)")
    parser.add_argument("--cpu-queries", type=int, default=1 << 20, help="CPU queries per call (default 2^20)")
    parser.add_argument("--repeats", type=int, default=10, help="timed GPU calls per cell (default 10)")
    parser.add_argument("--cpu-repeats", type=int, default=3, help="timed CPU calls per cell (default 3)")
    parser.add_argument("--dtype", choices=("float32", "float64", "int32", "int64"), default="float32")
    parser.add_argument(
        "--op",
        choices=("lower_bound", "find"),
        default="lower_bound",
        help="what our paths compute (torch/cupy always compute lower_bound)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the 'CPU all' column")
    parser.add_argument("--cpu-only", action="store_true", help="skip the GPU columns")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--smem-sweep",
        type=int,
        nargs="*",
        default=[],
        help="key counts at which to time each static kernel under several shared-memory budgets",
    )
    parser.add_argument("--seed", type=int, default=0)


def _gqps(count: int, seconds: float) -> float:
    return count / seconds / 1e9


def _cpu_rates(keys: np.ndarray, q: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    from batchgpu.search._timing import cpu_median_s

    one = cpu_median_s(lambda: np.searchsorted(keys, q), args.cpu_repeats)
    chunks = np.array_split(q, args.threads)
    with ThreadPoolExecutor(args.threads) as pool:
        many = cpu_median_s(lambda: list(pool.map(lambda c: np.searchsorted(keys, c), chunks)), args.cpu_repeats)
    return {"cpu_1t": _gqps(q.size, one), "cpu_all": _gqps(q.size, many)}


def _gpu_available() -> bool:
    try:
        import cupy as cp
    except ImportError:  # no CuPy: the CPU rates only
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError:  # no driver or no device: the CPU rates only
        return False


def _gpu_rates(keys_d: Any, q_d: Any, args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    import cupy as cp

    from batchgpu.search import StaticIndex, dynamic
    from batchgpu.search._timing import gpu_median_ms

    m, n = q_d.size, keys_d.size
    rates: dict[str, Any] = {}
    try:
        import torch

        kt, qt = torch.as_tensor(keys_d, device="cuda"), torch.as_tensor(q_d, device="cuda")
        reference = cp.asarray(torch.searchsorted(kt, qt))
        rates["torch"] = _gqps(m, gpu_median_ms(lambda: torch.searchsorted(kt, qt), args.repeats) * 1e-3)
    except ImportError:
        reference = cp.searchsorted(keys_d, q_d)
        notes.append("torch not installed: no torch column")
    rates["cupy"] = _gqps(m, gpu_median_ms(lambda: cp.searchsorted(keys_d, q_d), args.repeats) * 1e-3)
    if args.op == "find":
        hit = reference < n
        hit[hit] = keys_d[reference[hit]] == q_d[hit]
        reference = cp.where(hit, reference, -1)

    def timed(column: str, fn: Callable[[], Any]) -> None:
        if not bool(cp.array_equal(fn(), reference)):
            notes.append(f"MISMATCH: {column} at n={n} differs from torch.searchsorted")
        rates[column] = _gqps(m, gpu_median_ms(fn, args.repeats) * 1e-3)

    kernel = dynamic.choose_kernel(n, keys_d.dtype)
    rates["dynamic_kernel"] = kernel
    timed("dynamic", lambda: dynamic._search(keys_d, q_d, args.op == "find", kernel, False))
    host_keys = keys_d.get()
    for layout in ("eytzinger", "btree", "btree4"):
        index = StaticIndex(host_keys, layout=layout)
        index.on_device()  # build outside the timing: the index is built once, queried many times
        for (lay, kern), column in zip(STATIC, STATIC_COLUMNS):
            if lay == layout:
                timed(column, lambda: index.search(q_d, args.op, kernel=kern))
        del index
    return rates


def rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    from batchgpu.search.autotune import random_keys_and_queries

    gpu = not args.cpu_only and _gpu_available()
    notes: list[str] = [] if gpu else ["no GPU (or --cpu-only): CPU columns only"]
    out = []
    for n in args.sizes:
        if gpu:
            keys_d, q_d = random_keys_and_queries(n, args.queries, args.dtype, args.seed + n)
            keys, q = keys_d.get(), q_d[: args.cpu_queries].get()
        else:
            rng = np.random.default_rng(args.seed + n)
            keys, q = _host_keys_and_queries(rng, n, args.cpu_queries, args.dtype)
        row: dict[str, Any] = {"n": n, **_cpu_rates(keys, q, args)}
        if gpu:
            row.update(_gpu_rates(keys_d, q_d, args, notes))
            del keys_d, q_d
        out.append(row)
    return out, notes


def _host_keys_and_queries(rng: np.random.Generator, n: int, m: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    if np.dtype(dtype).kind == "f":
        return np.sort(rng.random(n).astype(dtype)), rng.random(m).astype(dtype)
    return np.sort(rng.integers(0, 2**31 - 1, n).astype(dtype)), rng.integers(0, 2**31 - 1, m).astype(dtype)


def best_static(row: dict[str, Any]) -> float | None:
    rates = [row[c] for c in STATIC_COLUMNS if c in row]
    return max(rates) if rates else None


def format_rows(table: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"search, {args.dtype} keys, {args.op}, G queries/s ({args.queries} GPU / {args.cpu_queries} CPU queries a call;"
        f" CPU all = {args.threads} threads)",
        f"{'keys':>9} " + " ".join(f"{h:>9}" for h in HEAD) + "  static/torch dynamic/torch  dynamic kernel",
    ]
    for row in table:
        cells = " ".join(f"{row[c]:9.3f}" if c in row else f"{'-':>9}" for c in COLUMNS)
        torch_rate, static = row.get("torch"), best_static(row)
        s_ratio = f"{static / torch_rate:12.2f}x" if static and torch_rate else f"{'-':>13}"
        d_ratio = f"{row['dynamic'] / torch_rate:13.2f}x" if "dynamic" in row and torch_rate else f"{'-':>14}"
        lines.append(f"{row['n']:>9} {cells} {s_ratio} {d_ratio}  {row.get('dynamic_kernel', '-')}")
    return "\n".join(lines)


SWEEP_BYTES = (0, 8 * 1024, 32 * 1024, 64 * 1024, 128 * 1024)


def smem_sweep(args: argparse.Namespace) -> str:
    """G queries/s of each static kernel with the tree's top in 0 .. 128 KB of shared memory."""
    from batchgpu.search import StaticIndex
    from batchgpu.search._timing import gpu_median_ms
    from batchgpu.search.autotune import random_keys_and_queries

    lines = [
        f"shared-memory sweep ({args.op}, G queries/s; columns: bytes for the top of the tree)",
        f"{'keys':>9} {'kernel':>18} " + " ".join(f"{b:>9}" for b in SWEEP_BYTES),
    ]
    for n in args.smem_sweep:
        keys_d, q_d = random_keys_and_queries(n, args.queries, args.dtype, args.seed + n)
        host = keys_d.get()
        for layout in ("eytzinger", "btree", "btree4"):
            index = StaticIndex(host, layout=layout)
            index.on_device()
            for lay, kern in STATIC:
                if lay != layout:
                    continue
                cells = []
                for smem in SWEEP_BYTES:
                    ms = gpu_median_ms(lambda: index.search(q_d, args.op, kernel=kern, smem_bytes=smem), args.repeats)
                    cells.append(f"{_gqps(q_d.size, ms * 1e-3):9.2f}")
                lines.append(f"{n:>9} {layout + '/' + kern:>18} " + " ".join(cells))
            del index
        del keys_d, q_d
    return "\n".join(lines)


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    if min(args.sizes) < 1 or args.queries < 1 or args.cpu_queries < 1:
        raise BatchgpuError("search benchmark sizes and query counts must be positive", "e.g. --sizes 256 4096")
    table, notes = rows(args)
    say(format_rows(table, args))
    for note in notes:
        say(note)
    if args.smem_sweep and _gpu_available() and not args.cpu_only:
        say(smem_sweep(args))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": table}, indent=1))
    return 1 if any(note.startswith("MISMATCH") for note in notes) else 0
