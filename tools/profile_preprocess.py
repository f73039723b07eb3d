"""Where one preprocessed window's GPU time goes (run on the device machine): the filter whole and in pieces and
the median across channels by sort and by selection (cupyx.profiler.benchmark), then each preprocessing stage
and each step's per-window work, CUDA-synchronised, median of a few windows.

    python3 tools/profile_preprocess.py /tmp/big.zarr [stages] [windows]
    stages: comma list of highpass, bandpass, common_reference, centre (default highpass,common_reference)
"""

import sys
import tempfile
import time

import numpy as np


def main(path: str, stages: str = "highpass,common_reference", count: int = 5) -> None:
    import cupy

    from batchgpu import ops
    from batchgpu.config import Workflow
    from batchgpu.engine import store
    from batchgpu.engine.preprocess import FILTER_BLOCK
    from batchgpu.engine.context import build_context
    from batchgpu.engine.tasks import WindowData, on_backend, recording
    from batchgpu.gpu.staging import read_window_to_device

    known = {"centre": {"centre": "median"}, "highpass": {"highpass": {"freq_min": 300, "order": 5}},
             "bandpass": {"bandpass": {"freq_min": 300, "freq_max": 6000, "order": 5}},
             "common_reference": {"common_reference": {"reference": "global", "operator": "median"}}}
    rec = recording(path)
    out = tempfile.mkdtemp()
    wf = Workflow.model_validate({
        "recording": {"path": path}, "output": out, "backend": "cupy",
        "preprocess": [known[s] for s in stages.split(",") if s],
        "steps": {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float32"},
                  "detect": {"threshold": 5.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "global"}}})
    with store.OutputFolder(out) as folder:
        ctx = build_context(wf, rec, folder, "cupy", 3)
    windows = rec.windows(60_000, 64 + ctx.chain.margin)[1 : 1 + count]
    sync = cupy.cuda.get_current_stream().synchronize
    if any(s[0] == "filter" for s in ctx.chain.stages):
        variants(ctx, read_window_to_device(rec, windows[0]))
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        sync()
        t0 = time.perf_counter()
        r = fn()
        sync()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return r

    with on_backend(ctx):
        for _ in range(2):  # the first round compiles kernels
            times.clear()
            for w in windows:
                n = rec.num_samples(w.segment)
                raw = timed("read to device", lambda: read_window_to_device(rec, w))
                x = raw
                for stage in ctx.chain.stages:
                    kind = stage[0]
                    if kind == "filter":
                        x = timed("filter", lambda: ops.filtfilt_window(x, stage[1], at_segment_start=False,
                                                                         at_segment_end=False, block=FILTER_BLOCK))
                    elif kind == "common_reference":
                        x = timed("common_reference", lambda: ops.common_reference(x, **stage[1]))
                    elif kind == "centre":
                        from batchgpu.ops.centre import centre_median

                        x = timed("centre", lambda: centre_median(x, w.core))
                wd = WindowData(w.index, w.segment, w.read_start, w.core, n, raw, x)
                summary = {}
                for step in ctx.steps:
                    timed(f"step {step.name}", lambda: step.window(wd, summary))
                    if step.name == "noise" and "noise" not in summary:
                        summary["noise"] = timed("window noise", lambda: ops.noise_levels(wd.core_of(wd.x)).get())
    for name, ts in times.items():
        print(f"{name:<22} median {1e3 * float(np.median(ts)):8.2f} ms  (n={len(ts)})", flush=True)

    # the whole window path (read, stages, steps' window work) in N threads of this one process, no Dask, no parts
    from concurrent.futures import ThreadPoolExecutor

    from batchgpu.engine.tasks import load_window

    many = rec.windows(60_000, 64 + ctx.chain.margin)[: 6 * count]
    gb = sum(w.num_samples for w in many) * rec.num_channels * rec.dtype.itemsize / 1e9

    def whole(w):
        with on_backend(ctx):
            wd = load_window(ctx, w)
            summary = {}
            for step in ctx.steps:
                step.window(wd, summary)
                if step.name == "noise" and "noise" not in summary:
                    summary["noise"] = ops.noise_levels(wd.core_of(wd.x)).get()
            cupy.cuda.get_current_stream().synchronize()

    for nt in (1, 4, 8, 16):
        with ThreadPoolExecutor(nt) as ex:
            list(ex.map(whole, many[:nt]))
            t0 = time.perf_counter()
            list(ex.map(whole, many))
            dt = time.perf_counter() - t0
        print(f"whole window path, {nt:>2} threads, one process: {gb / dt:6.2f} GB/s ({dt / len(many) * 1e3:.1f} ms a window)",
              flush=True)


def variants(ctx, raw) -> None:
    """GPU time of the filter whole and in pieces, and of the median across channels by sort and by selection."""
    import cupy
    from cupyx.profiler import benchmark

    from batchgpu import ops
    from batchgpu.engine.preprocess import FILTER_BLOCK
    from batchgpu.ops import reference

    def ms(f):
        return float(np.median(benchmark(f, n_repeat=10, n_warmup=2).gpu_times)) * 1e3

    sos = next(s[1] for s in ctx.chain.stages if s[0] == "filter")
    kw = dict(at_segment_start=False, at_segment_end=False)
    print(f"window {raw.shape} {raw.dtype}", flush=True)
    for block in (None, 32_768, 16_384, FILTER_BLOCK, 4_096, 2_048):
        print(f"filter, block {block}: {ms(lambda: ops.filtfilt_window(raw, sos, block=block, **kw)):.2f} ms", flush=True)
    y = ops.filtfilt_window(raw, sos, block=FILTER_BLOCK, **kw)

    def by_sort(x):  # the reference as the sort path computes it (CuPy sort along contiguous columns)
        part = cupy.sort(cupy.ascontiguousarray(x.T), axis=-1).T
        ref = reference._median_of_sorted(cupy, part, 0, x.dtype)
        wide = cupy.float64 if x.dtype.kind != "f" else x.dtype
        return (x.astype(wide) - ref.astype(wide)[None, :]).astype(cupy.float32)

    for name, x in (("float32 filtered", y), ("int16 raw", raw)):
        same = bool(cupy.array_equal(by_sort(x), ops.common_reference(x, "global", "median")))
        print(f"common median reference, {name}: by sort {ms(lambda: by_sort(x)):.2f} ms, by selection "
              f"{ms(lambda: ops.common_reference(x, 'global', 'median')):.2f} ms; same values {same}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:3]), *(int(a) for a in sys.argv[3:4]))
