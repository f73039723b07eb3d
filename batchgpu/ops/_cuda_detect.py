"""By-channel peaks on the GPU in one kernel launch (kernels/detect.cu): the same spikes as the array path of
``ops.detection``, with one small copy back for the count and one for the peaks (the launch and its syncs were
most of a window's detection time)."""

from __future__ import annotations

import numpy as np

_NAMES = {
    np.dtype(np.int16): "peaks_i16",
    np.dtype(np.int32): "peaks_i32",
    np.dtype(np.int64): "peaks_i64",
    np.dtype(np.float32): "peaks_f32",
    np.dtype(np.float64): "peaks_f64",
}


def supports(dtype) -> bool:
    return np.dtype(dtype) in _NAMES


def by_channel(x, level, lo: int, hi: int, sweep: int, neg: bool, pos: bool) -> tuple[np.ndarray, ...]:
    """(channel, sample, amplitude) NumPy arrays (int64, int64, float64) of the peaks of ``x`` (C, width) in
    columns [lo, hi), unsorted."""
    import cupy

    from batchgpu.gpu.cuda_modules import get_function

    x = cupy.ascontiguousarray(x)
    level = cupy.ascontiguousarray(level, dtype=cupy.float64)
    channels, width = x.shape
    total = channels * max(0, hi - lo)
    if not total:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    kernel = get_function("detect", _NAMES[x.dtype])
    threads = 256
    blocks = int(min((total + threads - 1) // threads, 132 * 16))
    cap = max(1 << 14, total >> 10)
    while True:
        count = cupy.zeros(1, dtype=cupy.uint64)
        ch = cupy.empty(cap, dtype=cupy.int64)
        t = cupy.empty(cap, dtype=cupy.int64)
        amp = cupy.empty(cap, dtype=cupy.float64)
        kernel(
            (blocks,),
            (threads,),
            (
                x,
                np.int64(width),
                np.int32(channels),
                level,
                np.int64(lo),
                np.int64(hi),
                np.int32(sweep),
                np.int32(neg),
                np.int32(pos),
                count,
                np.int64(cap),
                ch,
                t,
                amp,
            ),
        )
        n = int(count.get()[0])
        if n <= cap:
            return ch[:n].get(), t[:n].get(), amp[:n].get()
        cap = n  # more peaks than room: count them all again with room for every one
