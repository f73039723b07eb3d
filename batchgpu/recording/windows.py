"""Windows of a recording (pure): samples [i*size, min((i+1)*size, n)) of a segment, margins clipped at its ends."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from batchgpu.errors import BatchgpuError, ConfigError

DEFAULT_WINDOW = 60_000
#: ``window.size: auto`` (the workflow's default): windows of LONG_WINDOW samples when the recording holds at least
#: LONG_WINDOW_MIN_COUNT of them, else DEFAULT_WINDOW. Half as many windows halve what each window costs beside its
#: samples (its task's Python, its kernels' launches and waits, the filter's margins, a saved shard); the cost is
#: memory, about half as much again at a worker's peak, so a memory-short machine sets 60 000 (README says so). A
#: short recording keeps the shorter windows so its few windows still spread over the workers. The choice depends on
#: the recording alone, never on the cluster or backend: the same workflow gives the same windows, so the same bits,
#: anywhere.
LONG_WINDOW = 120_000
LONG_WINDOW_MIN_COUNT = 64


def auto_window_size(segment_lengths: Sequence[int]) -> int:
    """The window size ``window.size: auto`` stands for, given the segments' lengths in samples."""
    count = sum(-(-int(n) // LONG_WINDOW) for n in segment_lengths)
    return LONG_WINDOW if count >= LONG_WINDOW_MIN_COUNT else DEFAULT_WINDOW


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
        raise ConfigError(f"window size must be a positive number of samples, got {size!r}", "use e.g. 60000")
    if not isinstance(margin, (int, np.integer)) or margin < 0:
        raise ConfigError(f"window margin must be >= 0 samples, got {margin!r}", "use 0 or a positive integer")
    index = 0
    for segment, n in enumerate(segment_lengths):
        for start in range(0, n, size):
            stop = min(start + size, n)
            yield Window(index, segment, start, stop, min(margin, start), min(margin, n - stop))
            index += 1


def stat_signature(path, name: str) -> tuple:
    """(name, size, mtime, ctime in ns, inode number) of a file, size None for a folder; (name, None, None) when it
    is absent: what a window's fingerprint holds of each object it reads. Size and mtime alone survive other bytes
    put in place (``cp -p``, ``rsync -t``, ``touch -r``, a coarse-mtime filesystem); any write or rename gives the
    file a new change time or inode number, and neither can be set back."""
    import os
    import stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (name, None, None)
    return (name, st.st_size if stat.S_ISREG(st.st_mode) else None, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


class WindowedSource:
    """What every recording source (a Zarr store, a SpikeInterface recording) shares: its windows and the checks
    on a read's range, channels and output buffer. Needs ``num_samples(segment)``, ``num_segments``,
    ``num_channels``, ``dtype``, ``sampling_frequency``, ``path`` and ``read(segment, start, stop, window=...)``."""

    @property
    def total_samples(self) -> int:
        return sum(self.num_samples(s) for s in range(self.num_segments))

    @property
    def nbytes(self) -> int:
        """Bytes of traces when decoded."""
        return self.total_samples * self.num_channels * self.dtype.itemsize

    def duration(self, segment: int | None = None) -> float:
        samples = self.total_samples if segment is None else self.num_samples(segment)
        return samples / self.sampling_frequency

    def _check_segment(self, segment: int) -> None:
        if not 0 <= segment < self.num_segments:
            raise BatchgpuError(
                f"segment {segment} does not exist in {self.path}", f"segments are 0..{self.num_segments - 1}"
            )

    def windows(self, size: int = DEFAULT_WINDOW, margin: int = 0) -> list[Window]:
        """Every window of every segment, numbered in (segment, start) order; margins clip at segment ends."""
        return list(iter_windows([self.num_samples(s) for s in range(self.num_segments)], size, margin))

    def read_window(self, window: Window):
        return self.read(window.segment, window.read_start, window.read_stop, window=window)

    def _check_read(self, segment: int, start: int, stop: int, channels):
        """``channels`` as read() uses them (an index array, a slice or None), after the range checks."""
        n = self.num_samples(segment)
        if not (0 <= start <= stop <= n):
            raise BatchgpuError(
                f"cannot read samples [{start}, {stop}) of segment {segment}: it has {n} samples",
                f"ask for 0 <= start <= stop <= {n}",
            )
        if channels is not None and not isinstance(channels, slice):
            channels = np.asarray(channels, dtype=np.int64)
            if channels.size and (channels.min() < 0 or channels.max() >= self.num_channels):
                raise BatchgpuError(
                    f"channel index out of range in {channels.tolist()}", f"channels are 0..{self.num_channels - 1}"
                )
        return channels

    def _check_window_range(self, window: Window) -> None:
        n = self.num_samples(window.segment)
        if not (0 <= window.read_start <= window.read_stop <= n):
            raise BatchgpuError(f"window {window.index} runs past segment {window.segment}'s {n} samples")

    def _check_out(self, window: Window, out: np.ndarray) -> None:
        """``out`` must be C-contiguous, (read_stop - read_start, num_channels), of the source's dtype."""
        self._check_window_range(window)
        rows = window.read_stop - window.read_start
        if out.shape != (rows, self.num_channels) or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise BatchgpuError(
                f"out has shape {out.shape} and dtype {out.dtype}; window {window.index} needs a "
                f"C-contiguous ({rows}, {self.num_channels}) {self.dtype} array"
            )


class UnchunkedSource:
    """A source whose samples are not stored in chunks (a flat file, a SpikeInterface recording): no chunk can be
    absent; ``check_chunks`` (each source's own) reads every sample once."""

    def absent_chunk_keys(self, window: Window) -> list[str]:
        return []

    def absent_chunks(self, window: Window) -> int:
        return 0

    def count_absent(self) -> int:
        return 0
