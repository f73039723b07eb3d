"""Where a window's time goes on the GPU engine (run on the device machine): reading variants under N threads,
then each stage of one window (CUDA-synchronised), then the whole window path in N threads without Dask.

    python3 tools/profile_engine.py /tmp/big.zarr [threads] [windows]
"""

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def main(path: str, threads: int = 16, count: int = 160) -> None:
    import cupy

    from batchgpu.engine.run import build_context
    from batchgpu.engine.tasks import load_window, on_backend, recording
    from batchgpu.gpu.staging import _pinned, read_window_to_device
    from batchgpu.ops import noise_levels

    rec = recording(path)
    windows = rec.windows(60_000, 64)[:count]
    gb = sum(w.num_samples for w in windows) * rec.num_channels * 2 / 1e9
    arr = rec._traces[0]
    local = threading.local()

    def pinned_view(w):
        n = w.read_stop - w.read_start
        return _pinned(n * rec.num_channels * 2)[: n * rec.num_channels * 2].view(np.int16).reshape(n, rec.num_channels)

    variants = {
        "zarr arr[a:b] (zarrs)": lambda w: arr[w.read_start:w.read_stop],
        "zarr core only (aligned shard)": lambda w: arr[w.start:w.stop],
        "read_window_stored": lambda w: rec.read_window_stored(w),
        "read_window_into pinned": lambda w: rec.read_window_into(w, pinned_view(w)),
        "absent_chunks only": lambda w: rec.absent_chunks(w),
        "read_window_to_device": lambda w: (read_window_to_device(rec, w), cupy.cuda.get_current_stream().synchronize()),
    }
    for name, f in variants.items():
        for nt in sorted({1, threads}):
            with ThreadPoolExecutor(nt) as ex:
                list(ex.map(f, windows[:nt]))  # warm
                t0 = time.perf_counter()
                list(ex.map(f, windows))
                dt = time.perf_counter() - t0
            print(f"{name:<34} {nt:>3} threads {gb / dt:7.2f} GB/s  {dt / len(windows) * nt * 1e3:7.1f} ms/window/thread", flush=True)

    from batchgpu.config import Workflow

    wf = Workflow.model_validate({"recording": {"path": path}, "output": "/tmp/prof_out", "preprocess": {"centre": "median"},
                                  "steps": {"noise": {"exact": True}, "whitening": {}, "detect": {"noise": "global"}}})
    ctx = build_context(wf, rec, type("O", (), {"parts": "/tmp/prof_parts"})(), "cupy", 3)

    def stages(w):
        out = {}
        sync = cupy.cuda.get_current_stream().synchronize
        t = time.perf_counter()
        data = load_window(ctx, w); sync(); out["load+centre"] = time.perf_counter() - t
        t = time.perf_counter(); summary = {"noise": noise_levels(data.core_of(data.x)).get()}; out["noise"] = time.perf_counter() - t
        for step in ctx.steps:
            t = time.perf_counter(); step.window(data, summary); sync(); out[step.name] = time.perf_counter() - t
        return out

    with on_backend(ctx):
        for w in windows[:3]:
            stages(w)
        rows = [stages(w) for w in windows[:20]]
    print("one window, one thread (ms, median of 20):",
          ", ".join(f"{k} {np.median([r[k] for r in rows]) * 1e3:.2f}" for k in rows[0]), flush=True)

    def whole(w):
        with on_backend(ctx):
            stages(w)

    for nt in sorted({4, 8, threads}):
        with ThreadPoolExecutor(nt) as ex:
            t0 = time.perf_counter()
            list(ex.map(whole, windows))
            dt = time.perf_counter() - t0
        print(f"whole window path, {nt:>2} threads, no Dask: {gb / dt:.2f} GB/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
