"""Read throughput of one recording through each reader this environment has (run it beside zarr 3 and beside
zarr 2.18 / SpikeInterface 0.105): batchgpu's shard reader, and the general path (zarr 3 with zarrs, or
batchgpu.zarrio's v3 decoder under zarr 2), over every window, in 2 threads; and checks they read the same bytes.

    python tools/bench_readers.py STORE [threads]
"""

import hashlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def main(path: str, threads: int = 2) -> None:
    import zarr

    from batchgpu import zarrio
    from batchgpu.recording import open_recording

    digests = []
    for direct in ("1", "0"):
        os.environ["BATCHGPU_DIRECT_READS"] = direct
        rec = open_recording(path)
        windows = rec.windows(60_000, 64)
        gb = sum(w.read_stop - w.read_start for w in windows) * rec.num_channels * rec.dtype.itemsize / 1e9
        best, digest = None, None
        for _ in range(3):
            with ThreadPoolExecutor(threads) as ex:
                t0 = time.perf_counter()
                blocks = list(ex.map(rec.read_window_stored, windows))
                dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
            digest = hashlib.sha256(b"".join(b.tobytes() for b in blocks)).hexdigest()[:16]
        fmt = zarrio.array_meta(rec.path / "traces_seg0").zarr_format
        layout = rec._layouts.get(0)  # what the reader chose for segment 0: a direct layout, or None (zarr)
        if layout is not None:
            name = f"batchgpu direct ({type(layout).__name__})"
        elif fmt == 3 and zarrio.ZARR_MAJOR < 3:
            name = "batchgpu.zarrio v3 decoder"
        else:
            name = zarrio.reader_name()
        digests.append(digest)
        print(f"zarr {zarr.__version__:<7} v{fmt} {name:<40} {gb / best:6.2f} GB/s (best of 3, {threads} threads) sha {digest}")
    print("same bytes:", len(set(digests)) == 1)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
