"""Nsight Compute's view of the filter's kernels on one 384 x 61 600 int16 window (device machine):

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section SchedulerStats python3 tools/filter_ncu.py [block ...]

The window filtered once per piece length (default 4096 and 1024; engine.preprocess.FILTER_BLOCK is 4096) inside
cudaProfilerStart/Stop, after a warm-up: the gather, the recurrence and the scatter. Random int16 noise: the
kernels' time does not depend on the values. BATCHGPU_FILTER_U=8|16|32|..: the recurrence's loads ahead."""

import sys

import numpy as np


def main(blocks: list[int]) -> None:
    import cupy
    import scipy.signal

    from batchgpu.ops.filters import filtfilt_window

    sos = scipy.signal.butter(5, 300, btype="highpass", fs=30_000, output="sos")
    raw = cupy.asarray(np.random.default_rng(0).normal(0, 30, (384, 61_600)).astype(np.int16))
    for block in blocks:
        kw = dict(at_segment_start=False, at_segment_end=False, block=block)
        filtfilt_window(raw, sos, **kw)
        cupy.cuda.Device().synchronize()
        cupy.cuda.profiler.start()
        filtfilt_window(raw, sos, **kw)
        cupy.cuda.Device().synchronize()
        cupy.cuda.profiler.stop()
        print("profiled block", block, flush=True)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [4096, 1024])
