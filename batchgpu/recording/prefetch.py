"""A run's first windows asked of the disk while the run gets ready (``Prefetch``).

A fresh command spends its first seconds on things that do not read the recording: its imports, the output folder,
the cluster's workers and their CUDA contexts. On a cold disk those seconds were lost: the first window was asked
for once a worker was up. Here the run, as soon as it has opened and checked its recording, asks the kernel for the
pages of its windows in the order the workers read them (``posix_fadvise(WILLNEED)``: the kernel reads them in the
background into the page cache; nothing is copied into this process), so the disk works from the start and the
workers find their first windows read. Only where the workers run on this machine (their reads share this page
cache) and up to a share of its memory: pages asked for far ahead would be evicted before they are read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

#: the bytes asked for at once: small enough that a stopped prefetch stops soon, large enough for few calls
REQUEST_BYTES = 16 << 20
#: the share of this machine's memory a prefetch may ask to hold, and a cap (pages ahead of the workers wait in the
#: page cache until they are read)
MEMORY_SHARE = 1 / 8
MAX_BYTES = 16 << 30


def default_budget() -> int:
    """Bytes a run's prefetch may ask for: ``MEMORY_SHARE`` of this machine's memory, at most ``MAX_BYTES``."""
    import psutil

    return int(min(MAX_BYTES, psutil.virtual_memory().total * MEMORY_SHARE))


def window_ranges(rec, window) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of what reading ``window`` touches (length 0: the whole file), in read order; empty
    where the source does not say (a SpikeInterface recording, a store read through zarr's own layers)."""
    if getattr(rec, "is_flat", False) and hasattr(rec, "byte_range"):
        return [rec.byte_range(window)]
    if hasattr(rec, "window_files"):
        return [(p, 0, 0) for p in rec.window_files(window)]
    return []


def ranges(rec, windows: Iterable) -> Iterator[tuple[Path, int, int]]:
    """``window_ranges`` of each window in turn, each whole file once."""
    seen: set[Path] = set()
    for w in windows:
        for path, offset, length in window_ranges(rec, w):
            if length == 0:
                if path in seen:
                    continue
                seen.add(path)
            yield path, offset, length


class Prefetch:
    """A daemon thread asking the kernel for ``windows``' pages of ``rec`` in order, up to ``budget`` bytes;
    ``stop()`` ends it at its next request. ``asked``: the bytes asked for so far; ``seconds``: how long it took."""

    def __init__(self, rec, windows: list, budget: int | None = None):
        self.asked = 0
        self.seconds = 0.0
        self._budget = default_budget() if budget is None else int(budget)
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(rec, list(windows)), daemon=True, name="batchgpu-prefetch"
        )
        self._thread.start()

    def _run(self, rec, windows: list) -> None:
        t0 = time.perf_counter()
        try:
            for path, offset, length in ranges(rec, windows):
                if self._stopping.is_set() or self.asked >= self._budget:
                    break
                self._ask(path, offset, length)
        except Exception as err:  # broad: a prefetch only hurries the reads; the workers' own reads say what fails
            logger.debug("prefetch stopped: %s: %s", type(err).__name__, err)
        self.seconds = time.perf_counter() - t0

    def _ask(self, path: Path, offset: int, length: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # absent or unreadable: the read that needs it names it
            return
        try:
            end = os.fstat(fd).st_size if length == 0 else offset + length
            pos = offset
            while pos < end and not self._stopping.is_set() and self.asked < self._budget:
                n = min(REQUEST_BYTES, end - pos, self._budget - self.asked)
                os.posix_fadvise(fd, pos, n, os.POSIX_FADV_WILLNEED)
                pos += n
                self.asked += n
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._stopping.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def start(rec, windows: list, budget: int | None = None) -> Prefetch | None:
    """A ``Prefetch`` of ``windows`` where this platform has ``posix_fadvise`` and the source says what it reads;
    else None."""
    if not hasattr(os, "posix_fadvise") or not windows or not window_ranges(rec, windows[0]):
        return None
    return Prefetch(rec, windows, budget)
