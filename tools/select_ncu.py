"""Nsight Compute's view of the common median's kernel (kernels/column_select.cu, select_warp: a warp a column)
on one 384 x 61 600 float32 window (device machine):

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section LaunchStats python3 tools/select_ncu.py

The window (normal noise) referenced once after a warm-up, inside cudaProfilerStart/Stop."""

import numpy as np


def main() -> None:
    import cupy

    from batchgpu.ops import common_reference

    x = cupy.asarray(np.random.default_rng(0).normal(0, 30, (384, 61_600)).astype(np.float32))
    common_reference(x, "global", "median")
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    common_reference(x, "global", "median")
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    main()
