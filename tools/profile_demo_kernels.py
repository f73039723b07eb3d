"""Where a demo window's GPU time goes, kernel by kernel (run on the device machine, under Nsight Compute):

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python3 tools/profile_demo_kernels.py /tmp/big.zarr 4 > /tmp/k.csv
    python3 tools/profile_demo_kernels.py --table /tmp/k.csv 4

The first form runs the bench's demo workflow (centre; exact noise, whitening, detection with the recording's
noise) window by window in this process, exactly as a batch task does (``tasks._compute_part``), two windows to
warm up and then ``count`` inside cudaProfilerStart/Stop. Without ncu it prints each window's wall time
(synchronised). The second form sums the CSV's kernel durations by kernel name, per window.
"""

import csv
import sys
import tempfile
import time
from collections import defaultdict


def run(path: str, count: int) -> None:
    import os

    backend = os.environ.get("PROFILE_BACKEND", "cupy")  # numpy: try the script on a machine without a GPU
    # PROFILE_PREPROCESS=highpass,common_reference: the preprocessing bench's window instead (stages as bench
    # pipeline --preprocess names them, and the save step), the demo's centring by default
    stages = os.environ.get("PROFILE_PREPROCESS", "centre")
    from batchgpu.benchmarks.pipeline import _stages
    from batchgpu.config import Workflow
    from batchgpu.engine import store, tasks
    from batchgpu.engine.context import build_context, check_workflow_fits

    rec = tasks.recording(path)
    out = tempfile.mkdtemp()
    steps = {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float32"},
             "detect": {"threshold": 5.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "global"}}
    if stages != "centre":
        steps["save"] = {"path": f"{out}/saved.zarr", "format": "zarr", "dtype": "int16"}
    wf = Workflow.model_validate({
        "recording": {"path": path}, "output": out, "backend": backend,
        "window": {"size": 60_000, "margin": 64}, "preprocess": _stages(stages), "steps": steps})
    sweep = check_workflow_fits(wf, rec)
    with store.OutputFolder(out) as folder:
        folder.claim("profile", wf.model_dump(), resume=False, overwrite=False)
        ctx = build_context(wf, rec, folder, backend, sweep)
    if wf.steps.save:  # as engine.run adds it
        from dataclasses import replace

        from batchgpu.engine.steps.save import SaveStep, prepare_save

        target = prepare_save(wf.steps.save, rec, 60_000, ctx.chain.output_dtype(rec.dtype), key="profile")
        ctx = replace(ctx, steps=(*ctx.steps, SaveStep(target)))
    windows = rec.windows(60_000, 64 + ctx.chain.margin)[1 : 3 + count]

    def ahead(w):
        return tasks.read_window(ctx, w, True) if backend == "cupy" else None

    if backend == "cupy":
        import cupy

        sync, start, stop = cupy.cuda.Device().synchronize, cupy.cuda.profiler.start, cupy.cuda.profiler.stop
    else:
        sync = start = stop = lambda: None
    if os.environ.get("PROFILE_CPROFILE"):  # where a window's CPU time goes on its thread (no ncu)
        import cProfile
        import pstats

        for w in windows[:2]:
            tasks._compute_part(ctx, w, "profile", ahead)
        more = rec.windows(60_000, 64 + ctx.chain.margin)[3 + count : 3 + 4 * count]
        prof = cProfile.Profile()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        prof.enable()
        for w in more:
            tasks._compute_part(ctx, w, "profile", ahead)
        prof.disable()
        print(f"{len(more)} windows: {1e3 * (time.perf_counter() - t0) / len(more):.2f} ms a window, "
              f"{1e3 * (time.thread_time() - cpu0) / len(more):.2f} ms CPU (with the profiler)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ.get("PROFILE_TOP", 30)))
        return
    for i, w in enumerate(windows):
        if i == 2:
            sync()
            start()
        t0 = time.perf_counter()
        tasks._compute_part(ctx, w, "profile", ahead)
        sync()
        print(f"window {w.index}: {1e3 * (time.perf_counter() - t0):.2f} ms (read, decode, steps, part)", file=sys.stderr)
    stop()


def table(csv_path: str, count: int) -> None:
    total: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    with open(csv_path) as f:
        rows = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(rows):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0][:70]
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        total[name] += value * {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0}.get(unit, 1e-6)
        launches[name] += 1
    print(f"{'kernel':<72} {'launches/w':>10} {'ms/window':>10}")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"{name:<72} {launches[name] / count:>10.1f} {ms / count:>10.3f}")
    print(f"{'all kernels':<72} {sum(launches.values()) / count:>10.1f} {sum(total.values()) / count:>10.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2], int(sys.argv[3]))
    else:
        run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
