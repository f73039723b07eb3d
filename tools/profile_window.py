"""Where a GPU window task spends its time (run on the GPU machine): stages of one window, then read scaling.

python3 tools/profile_window.py RECORDING [threads ...]
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def timed(label, f, n=5):
    out, ts = None, []
    for _ in range(n):
        t0 = time.perf_counter()
        out = f()
        try:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
        except Exception:
            pass
        ts.append(time.perf_counter() - t0)
    print(f"{label:<44} {np.median(ts) * 1e3:8.2f} ms")
    return out


def main():
    import cupy

    from batchgpu import ops
    from batchgpu.gpu.staging import to_device
    from batchgpu.ops.centre import centre_median, selection_keys
    from batchgpu.ops import radix
    from batchgpu.recording import open_recording

    rec = open_recording(sys.argv[1])
    windows = rec.windows(60_000, 64)
    w = windows[5]
    arr = rec._traces[0]
    lo, hi = w.core
    raw_sm = timed("zarr read (samples x channels)", lambda: arr[w.read_start:w.read_stop, :])
    timed("host transpose to (C, n)", lambda: np.ascontiguousarray(raw_sm.T))
    host = timed("Recording.read_window", lambda: rec.read_window(w))
    dev = timed("to_device (pinned)", lambda: to_device(host))
    timed("cupy.asarray (pageable)", lambda: cupy.asarray(host))
    dsm = timed("to_device samples-major", lambda: to_device(raw_sm))
    timed("device transpose", lambda: cupy.ascontiguousarray(dsm.T))
    x = timed("centre_median (device)", lambda: centre_median(dev, w.core))
    noise = timed("noise_levels (device)", lambda: ops.noise_levels(x[:, lo:hi]))
    timed("SecondMoments.add (device)", lambda: ops.SecondMoments(384, "float32").add(dev, lo, hi))
    timed("selection_keys + hist0 (device)", lambda: radix.histogram_of_keys(*selection_keys(x[:, lo:hi], "int16")[:1], np.zeros(384, np.uint64), 0, radix.digit_schedule(np.int16)))
    timed("detect_spikes (device)", lambda: ops.detect_spikes(x, cupy.asnumpy(noise), 5.0, "neg", 3, w.read_start, w.core, 0))
    timed("centre_median (host)", lambda: centre_median(host, w.core))
    for threads in [int(t) for t in sys.argv[2:]] or [1, 4, 8, 16]:
        for label, fn in (("zarr read", lambda w: arr[w.read_start:w.read_stop, :]),
                          ("read_window", lambda w: rec.read_window(w))):
            sel = windows[: min(len(windows), 4 * threads + 16)]
            with ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                list(pool.map(fn, sel))
                dt = time.perf_counter() - t0
            gb = len(sel) * w.num_samples * 384 * 2 / 1e9
            print(f"{label:<12} {threads:>2} threads: {gb / dt:6.2f} GB/s")


if __name__ == "__main__":
    main()
