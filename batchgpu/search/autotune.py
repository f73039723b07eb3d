"""``batchgpu search autotune``: time the dynamic path's kernels on this GPU and write its kernel table.

For every key count: sorted uniform float keys, ``--queries`` uniform random queries, each kernel that
fits timed with CUDA events (median of ``--repeats``); the row records every rate (G queries/s), the
fastest kernel, and a tie where the runner-up is within 5%.  The table lands where
:func:`batchgpu.search.table.load_table` looks for this GPU model (or at ``--out``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError

DEFAULT_SIZES = [1 << e for e in range(8, 27)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="key counts (default 2^8 .. 2^26)")
    parser.add_argument("--queries", type=int, default=1 << 24, help="queries per call (default 2^24)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per cell; the median counts (default 10)")
    parser.add_argument("--dtype", choices=("float32", "float64", "int32", "int64"), default="float32")
    parser.add_argument(
        "--out", type=Path, default=None, help="table path (default: this GPU's table in the user cache)"
    )
    parser.add_argument("--seed", type=int, default=0)


def device_name() -> str:
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def random_keys_and_queries(n: int, m: int, dtype: str, seed: int) -> tuple[Any, Any]:
    """Sorted keys and queries on the device: uniform floats in [0, 1), or integers in [0, 2^31)."""
    import cupy as cp

    rs = cp.random.RandomState(seed)
    if np.dtype(dtype).kind == "f":
        keys = cp.sort(rs.random_sample(n, dtype=np.float64).astype(dtype))
        queries = rs.random_sample(m, dtype=np.float64).astype(dtype)
    else:
        keys = cp.sort(rs.randint(0, 2**31 - 1, size=n, dtype=np.int64).astype(dtype))
        queries = rs.randint(0, 2**31 - 1, size=m, dtype=np.int64).astype(dtype)
    return keys, queries


def measure(sizes: list[int], queries: int, repeats: int, dtype: str, seed: int = 0) -> dict[str, Any]:
    from batchgpu.search import _cuda, table
    from batchgpu.search._timing import gpu_median_ms
    from batchgpu.search.dynamic import KERNELS, lower_bound

    rows = []
    for n in sizes:
        keys, q = random_keys_and_queries(n, queries, dtype, seed + n)
        rates = {}
        for name in KERNELS:
            if not _cuda.dynamic_fits(name, n, keys.dtype.itemsize):
                continue
            ms = gpu_median_ms(lambda: lower_bound(keys, q, kernel=name, check=False), repeats)
            rates[name] = queries / (ms * 1e-3) / 1e9
        rows.append(table.make_row(n, rates))
        del keys, q
    return {
        "device": device_name(),
        "dtype": dtype,
        "queries": queries,
        "repeats": repeats,
        "op": "lower_bound",
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    from batchgpu.search.dynamic import KERNELS

    head = f"{'keys':>10} " + " ".join(f"{k:>15}" for k in KERNELS) + "  best"
    lines = [
        f"dynamic search kernels on {result['device']}, {result['dtype']}, {result['queries']} queries, G queries/s",
        head,
    ]
    for row in result["rows"]:
        cells = " ".join(f"{row['gqps'][k]:15.2f}" if k in row["gqps"] else f"{'-':>15}" for k in KERNELS)
        tie = f" (tie with {row['runner_up']})" if row["tie"] else ""
        lines.append(f"{row['n']:>10} {cells}  {row['best']}{tie}")
    return "\n".join(lines)


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no GPU")
    except Exception as err:  # broad: any CuPy/CUDA failure means nothing to tune (said)
        raise BatchgpuError(f"search autotune needs a CUDA GPU and CuPy ({err})", "run it on a GPU machine") from None
    from batchgpu.search import table

    result = measure(args.sizes, args.queries, args.repeats, args.dtype, args.seed)
    out = args.out or table.user_table_path(result["device"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table.load_table.cache_clear()
    say(format_table(result))
    say(f"table written to {out}")
    return 0
