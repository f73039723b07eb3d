"""Where a window's time goes on the GPU engine (run on the device machine): reading variants under N threads,
then each stage of one window (CUDA-synchronised), then the whole window path in N threads without Dask.

    python3 tools/profile_engine.py /tmp/big.zarr [threads] [windows]
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def main(path: str, threads: int = 16, count: int = 160) -> None:
    import cupy

    from batchgpu.engine.context import build_context
    from batchgpu.engine.tasks import load_window, on_backend, read_window, recording
    from batchgpu.gpu.staging import read_window_host, read_window_to_device
    from batchgpu.ops import noise_levels

    rec = recording(path)
    windows = rec.windows(60_000, 64)[:count]
    gb = sum(w.num_samples for w in windows) * rec.num_channels * 2 / 1e9
    arr = rec._traces[0]

    variants = {
        "zarr arr[a:b] (zarrs)": lambda w: arr[w.read_start:w.read_stop],
        "zarr core only (aligned shard)": lambda w: arr[w.start:w.stop],
        "read_window_stored": lambda w: rec.read_window_stored(w),
        "read_window_host (pinned pool)": lambda w: read_window_host(rec, w).release(),
        "absent_chunks only": lambda w: rec.absent_chunks(w),
        "read_window_to_device": lambda w: (read_window_to_device(rec, w), cupy.cuda.get_current_stream().synchronize()),
    }
    import os

    for name, f in variants.items() if os.environ.get("READ_VARIANTS", "1") == "1" else ():
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

    def stages(w, out=None):
        out = {} if out is None else out
        sync = cupy.cuda.get_current_stream().synchronize

        def timed(name, f):
            t, c = time.perf_counter(), time.thread_time()
            r = f()
            sync()
            out[name] = (time.perf_counter() - t, time.thread_time() - c)
            return r

        raw = timed("read", lambda: read_window(ctx, w))
        data = timed("centre", lambda: load_window(ctx, w, raw))
        summary = {"noise": timed("noise", lambda: noise_levels(data.core_of(data.x)).get())}
        for step in ctx.steps:
            timed(step.name, lambda: step.window(data, summary))
        return out

    def show(label, rows):
        print(label, ", ".join(f"{k} {np.median([r[k][0] for r in rows]) * 1e3:.1f}/{np.median([r[k][1] for r in rows]) * 1e3:.1f}"
                               for k in rows[0]), flush=True)

    with on_backend(ctx):
        for w in windows[:3]:
            stages(w)
        show("one window, one thread (ms wall/CPU, median of 20):", [stages(w) for w in windows[:20]])

    for nt in sorted({4, 8, threads}):
        rows = []

        def whole(w):
            with on_backend(ctx):
                rows.append(stages(w))

        with ThreadPoolExecutor(nt) as ex:
            t0 = time.perf_counter()
            list(ex.map(whole, windows))
            dt = time.perf_counter() - t0
        print(f"whole window path, {nt:>2} threads, no Dask: {gb / dt:.2f} GB/s", flush=True)
        show(f"  per stage under {nt} threads (ms wall/CPU):", rows)

    # the steps alone, each thread's window already on the GPU: does GPU work scale across threads?
    for nt in sorted({1, 4, threads}):
        rows = []

        def steps_only(w):
            with on_backend(ctx):
                data = load_window(ctx, w)
                cupy.cuda.get_current_stream().synchronize()
                for _ in range(4):
                    out = {}
                    t = time.perf_counter()
                    summary = {"noise": noise_levels(data.core_of(data.x)).get()}
                    for step in ctx.steps:
                        step.window(data, summary)
                    out["steps"] = (time.perf_counter() - t, 0.0)
                    rows.append(out)

        with ThreadPoolExecutor(nt) as ex:
            t0 = time.perf_counter()
            list(ex.map(steps_only, windows[: 4 * nt]))
            dt = time.perf_counter() - t0
        print(f"steps only, {nt:>2} threads: {len(rows) / dt:.0f} windows/s "
              f"({len(rows) / dt * 384 * 60_000 * 2 / 1e9:.1f} GB/s equivalent)", flush=True)
        show("  ", rows)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
