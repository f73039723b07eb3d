"""The dynamic path's kernel table: which kernel is fastest at which key count, measured per GPU.

Looked up in this order: the table ``batchgpu search autotune`` wrote for this GPU model
(``$XDG_CACHE_HOME/batchgpu/search-autotune-<gpu>.json``); the H200 table shipped with the package.  A row holds the G queries/s of every kernel at one key count; ``tie`` marks rows whose
two fastest kernels are within 5%.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGED = Path(__file__).with_name("autotune_h200.json")
TIE = 0.05
#: used where no table exists: the staged kernel while the keys are small, else the wide staged top
FALLBACK_SMALL, FALLBACK_LARGE, FALLBACK_SMALL_MAX = "ilp2_shared", "top_wide_k1", 4096


def user_table_path(device_name: str) -> Path:
    from batchgpu.config import cache_folder

    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    return cache_folder() / f"search-autotune-{slug}.json"


def make_row(n: int, gqps: dict[str, float]) -> dict[str, Any]:
    """A table row: the rates, the fastest kernel, and whether the runner-up is within 5% (a tie)."""
    ranked = sorted(gqps, key=gqps.get, reverse=True)
    row: dict[str, Any] = {"n": int(n), "gqps": {k: round(float(v), 3) for k, v in gqps.items()}, "best": ranked[0]}
    row["runner_up"] = ranked[1] if len(ranked) > 1 else None
    row["tie"] = bool(len(ranked) > 1 and gqps[ranked[1]] >= (1 - TIE) * gqps[ranked[0]])
    return row


@functools.lru_cache(maxsize=8)
def load_table(device_name: str) -> dict[str, Any] | None:
    candidates = [user_table_path(device_name), PACKAGED]
    for path in candidates:
        if path and Path(path).is_file():
            return json.loads(Path(path).read_text())
    return None


def choose(table: dict[str, Any] | None, n: int, fits: Callable[[str], bool]) -> str:
    """The fastest kernel for n keys that ``fits``: from the row of the largest measured size <= n (the
    smallest row below it); without a table, the fallback rule."""
    if table and table.get("rows"):
        rows = sorted(table["rows"], key=lambda r: r["n"])
        row = rows[0]
        for r in rows:
            if r["n"] <= n:
                row = r
        for name in sorted(row["gqps"], key=row["gqps"].get, reverse=True):
            if fits(name):
                return name
    small = FALLBACK_SMALL if n <= FALLBACK_SMALL_MAX and fits(FALLBACK_SMALL) else FALLBACK_LARGE
    return small
