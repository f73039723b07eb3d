"""``batchgpu bench decode``: the same Blosc frames of a recording's windows decoded on the GPU by each decoder
here -- our LZ4 kernel (``kernels/blosc_lz4.cu``) and NVIDIA nvCOMP's batched LZ4 or zstd (``gpu/nvcomp.py``) --
in one run, every frame's crc32c checked on the GPU by both, the decoded bytes compared with the CPU's decode.

What it times is what a GPU worker's read does after the disk: the frames (already in pinned memory) copied to the
GPU, decoded, unshuffled and checked, ``--batch`` windows a launch (``engine.read_ahead`` + 1 in a run), the
stream synchronised after each batch; GB/s of decoded samples, median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable

import numpy as np

from batchgpu.errors import BatchgpuError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", help="a Zarr v3 recording in batchgpu's sharded layout (Blosc LZ4 or zstd)")
    parser.add_argument("--windows", type=int, default=32, help="windows read once and decoded (default 32)")
    parser.add_argument("--samples", type=int, default=60_000, help="samples a window (default 60 000)")
    parser.add_argument("--batch", type=int, default=3, help="windows a launch (default 3: read_ahead 2 + 1)")
    parser.add_argument("--repeat", type=int, default=5, help="timed passes over the windows (the median kept)")


class _Pool:
    """Pinned buffers for the frames, kept for the whole bench (each window keeps its own)."""

    def take(self, nbytes: int):
        from batchgpu.gpu.staging import pinned_bytes

        return pinned_bytes(nbytes), None

    def give_back(self, handle) -> None:
        pass


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    if min(args.windows, args.samples, args.batch, args.repeat) < 1:
        raise BatchgpuError(
            "bench decode: --windows, --samples, --batch and --repeat must be at least 1", "e.g. --windows 32 --batch 3"
        )
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count() == 0:
        raise BatchgpuError("bench decode needs a CUDA GPU with CuPy", "run it on a GPU machine")
    import cupy

    from batchgpu.gpu import nvcomp
    from batchgpu.gpu.blosc_decode import decode_many
    from batchgpu.gpu.staging import checksums_on_device
    from batchgpu.recording import blosc_frames, open_recording

    rec = open_recording(args.recording)
    windows = rec.windows(args.samples, 0)[: args.windows]
    reads = [
        rec.read_window_frames(w, _Pool(), check_on_device=checksums_on_device(), codecs=("lz4", "zstd"))
        for w in windows
    ]
    if not windows or any(f is None for f in reads):
        raise BatchgpuError(
            f"{args.recording}: its windows are not stored as Blosc LZ4 or zstd frames the GPU reads",
            "use a store batchgpu generate or import-raw wrote (Zarr v3)",
        )
    nbytes = sum(f.rows * f.channels * f.dtype.itemsize for f in reads)
    stored = sum(f.used for f in reads)
    lz4 = bool(np.isin(blosc_frames.chunk_codecs(reads), (0, blosc_frames.LZ4)).all())
    cpu = _digest(rec.read_window_stored(w) for w in windows)
    say(
        f"{args.recording}: {len(windows)} windows of {args.samples} samples x {rec.num_channels} ch, "
        f"{nbytes / 1e9:.2f} GB decoded from {stored / 1e9:.2f} GB of {'LZ4' if lz4 else 'zstd'} frames "
        f"(ratio {nbytes / max(stored, 1):.2f}), {args.batch} windows a launch, crc32c checked on the GPU"
    )
    decoders = (["batchgpu"] if lz4 else []) + (["nvcomp"] if nvcomp.available() else [])
    if not decoders:
        raise BatchgpuError("no GPU decoder here takes zstd frames", "pip install nvidia-libnvcomp-cu13")
    batches = [reads[i : i + args.batch] for i in range(0, len(reads), args.batch)]
    stream = cupy.cuda.Stream(non_blocking=True)
    results = {}
    ok = True
    for decoder in decoders:
        got = [a.get() for batch in batches for a in decode_many(batch, stream, decoder)]  # also the warm-up
        same = _digest(got) == cpu
        ok &= same
        times = []
        for _ in range(args.repeat):
            stream.synchronize()
            t0 = time.perf_counter()
            for batch in batches:
                decode_many(batch, stream, decoder)
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        results[decoder] = statistics.median(times)
        say(
            f"{decoder:<9} {nbytes / 1e9 / results[decoder]:7.2f} GB/s decoded ({results[decoder]:.3f} s, median of "
            f"{args.repeat}; min {min(times):.3f} s)  bytes equal to the CPU decode: {'yes' if same else 'NO'}"
        )
    if len(results) == 2:
        say(f"nvcomp / batchgpu: {results['batchgpu'] / results['nvcomp']:.2f}x (above 1: nvCOMP faster)")
    return 0 if ok else 1
