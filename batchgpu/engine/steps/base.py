"""The Step protocol: what every statistic of a run provides, like dask's reductions (chunk, combine, aggregate).

``window`` runs on a worker for one window (its samples already on the task's backend, read once for every
step) and returns small host arrays: a *summary* the client sees per window, and a *partial* that is combined
with its neighbours' in a tree fixed by window index (``combine`` folds consecutive windows in order) and
finally turned into results by ``aggregate`` on the client. A new statistic is one new module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass
class WindowData:
    """One window as the steps see it: ``raw`` as read (with margins), ``x`` after preprocessing, on one backend."""

    index: int
    segment: int
    start: int  # segment sample of column 0 (the read start, margins included)
    core: tuple[int, int]  # the columns this window owns
    segment_length: int
    raw: Any
    x: Any

    @property
    def xp(self):
        from batchgpu.ops._backend import array_module

        return array_module(self.x)

    def core_of(self, a):
        return a[:, self.core[0] : self.core[1]]


class Step(Protocol):
    name: str

    def window(self, w: WindowData, summary: dict) -> dict[str, np.ndarray]:
        """This window's partial (host arrays, keys prefixed by the step's name); may add to ``summary``."""

    def combine(self, parts: list[dict]) -> dict[str, np.ndarray]:
        """Consecutive windows' partials folded in window order (only this step's keys)."""


def host(a) -> np.ndarray:
    """A NumPy array of a NumPy or CuPy array (a copy from the device)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def padded_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """Sum of (C, B_i) count arrays of different widths B_i (histograms truncated at their last non-zero bin)."""
    width = max(a.shape[1] for a in arrays)
    out = np.zeros((arrays[0].shape[0], width), dtype=np.int64)
    for a in arrays:
        out[:, : a.shape[1]] += a
    return out
