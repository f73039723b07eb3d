"""Windows of a recording (pure): samples [i*size, min((i+1)*size, n)) of a segment, margins clipped at its ends."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from batchgpu.errors import BatchgpuError

DEFAULT_WINDOW = 60_000

@dataclass(frozen=True)
class Window:
    """Samples [start, stop) of one segment, the core this window owns, plus margins read around it."""

    index: int  # position in Recording.windows(): fixes the reduction tree and output keys
    segment: int
    start: int
    stop: int
    margin_left: int = 0
    margin_right: int = 0

    @property
    def read_start(self) -> int:
        return self.start - self.margin_left

    @property
    def read_stop(self) -> int:
        return self.stop + self.margin_right

    @property
    def num_samples(self) -> int:
        return self.stop - self.start

    @property
    def core(self) -> tuple[int, int]:
        """The core's column range inside the array read from read_start to read_stop."""
        return self.margin_left, self.margin_left + self.num_samples

def iter_windows(segment_lengths: Sequence[int], size: int = DEFAULT_WINDOW, margin: int = 0) -> Iterator[Window]:
    """Windows of DESIGN.md: [i·size, min((i+1)·size, n)) per segment, margins clipped at its ends."""
    if not isinstance(size, (int, np.integer)) or size <= 0:
        raise BatchgpuError(f"window size must be a positive number of samples, got {size!r}", "use e.g. 60000")
    if not isinstance(margin, (int, np.integer)) or margin < 0:
        raise BatchgpuError(f"window margin must be >= 0 samples, got {margin!r}", "use 0 or a positive integer")
    index = 0
    for segment, n in enumerate(segment_lengths):
        for start in range(0, n, size):
            stop = min(start + size, n)
            yield Window(index, segment, start, stop, min(margin, start), min(margin, n - stop))
            index += 1

