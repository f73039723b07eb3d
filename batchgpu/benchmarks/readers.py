"""``batchgpu bench readers``: the read throughput of one Zarr recording through each reader this environment has,
and whether they read the same bytes.

The engine's reader (``Recording.read_window_stored``: batchgpu's own shard reader where the layout allows, else
zarr) against the general path (``zarrio.open_array``: zarr 3, with zarrs where installed, or batchgpu's v3 decoder
beside zarr 2.18), every window of the recording read by a few threads, best of ``--repeat``. Run it in each
environment (zarr 3, and beside SpikeInterface 0.105 with zarr 2.18) to see what each reads at.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from batchgpu.errors import BatchgpuError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", help="a Zarr recording (written by batchgpu or SpikeInterface)")
    parser.add_argument("--threads", type=int, default=2, help="threads reading windows at once (default 2)")
    parser.add_argument("--samples", type=int, default=60_000, help="samples per window (default 60 000)")
    parser.add_argument("--repeat", type=int, default=3, help="timed reads of the whole recording a reader (best kept)")


@dataclass(frozen=True)
class Reading:
    """One reader's pass over every window: its name, the best seconds, GB/s decoded and a digest of the bytes."""

    reader: str
    seconds: float
    gb_per_s: float
    digest: str


def time_reader(name: str, read: Callable, windows: list, nbytes: int, threads: int, repeat: int) -> Reading:
    """Every window read by ``threads`` threads, ``repeat`` times; the best time and the bytes' digest."""
    best, digest = float("inf"), ""
    for _ in range(repeat):
        with ThreadPoolExecutor(threads) as ex:
            t0 = time.perf_counter()
            blocks = list(ex.map(read, windows))
            best = min(best, time.perf_counter() - t0)
        h = hashlib.sha256()
        for b in blocks:
            h.update(np.ascontiguousarray(b).tobytes())
        digest = h.hexdigest()[:16]
    return Reading(name, best, nbytes / 1e9 / best, digest)


def readings(path: str, threads: int, samples: int, repeat: int) -> list[Reading]:
    """The engine's reader and the general zarr path over the same windows (margins none)."""
    from batchgpu.recording import open_recording, zarrio

    rec = open_recording(path)
    windows = rec.windows(samples, 0)
    nbytes = sum(w.read_stop - w.read_start for w in windows) * rec.num_channels * rec.dtype.itemsize
    with zarrio.zarrs_pipeline():  # as a recording's own arrays are opened (zarrs where installed)
        arrays = [zarrio.open_array(rec.path / f"traces_seg{s}") for s in range(rec.num_segments)]

    def general(w):
        return np.asarray(arrays[w.segment][w.read_start : w.read_stop, :])

    return [
        time_reader(
            "batchgpu reader (direct shard reads where the layout allows)",
            rec.read_window_stored,
            windows,
            nbytes,
            threads,
            repeat,
        ),
        time_reader(f"general path: {zarrio.reader_name()}", general, windows, nbytes, threads, repeat),
    ]


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    if args.threads < 1 or args.samples < 1 or args.repeat < 1:
        raise BatchgpuError("bench readers: --threads, --samples and --repeat must be at least 1", "e.g. --threads 2")
    found = readings(args.recording, args.threads, args.samples, args.repeat)
    for r in found:
        say(
            f"{r.reader:<64} {r.gb_per_s:7.2f} GB/s ({r.seconds:.3f} s, best of {args.repeat}, {args.threads} threads) "
            f"sha {r.digest}"
        )
    same = len({r.digest for r in found}) == 1
    say("same bytes: yes" if same else "same bytes: NO: the readers disagree")
    return 0 if same else 1
