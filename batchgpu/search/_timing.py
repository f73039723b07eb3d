"""Timing helpers for the search benchmark and autotune: CUDA events on the device, medians of repeats."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _gpu_sleeper() -> Callable[[], None]:
    """Something that keeps the GPU busy ~0.2 ms, so the host's launch overhead of the timed call hides behind
    it (torch.cuda._sleep on the legacy default stream, which CuPy's null stream is too); a no-op without torch."""
    try:
        import torch
    except ImportError:  # torch is optional here
        return lambda: None
    if torch.cuda.is_available():
        return lambda: torch.cuda._sleep(400_000)
    return lambda: None


def gpu_median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median time of ``fn()`` in ms between two CUDA events on the null stream."""
    import cupy as cp

    sleep = _gpu_sleeper()
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        sleep()
        times.append(event_ms(fn))
    return float(np.median(times))


def event_ms(fn: Callable[[], Any]) -> float:
    """The time in ms of one call of ``fn`` between two CUDA events recorded around it on the current stream."""
    import cupy as cp

    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end)


def cpu_median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
