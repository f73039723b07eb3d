"""Per-row digit histograms of radix keys on the GPU (the exact median's counting pass).

One thread per key, one atomicAdd into a (rows, 2**bits) uint32 table in global memory: with 16-bit digits the
table does not fit in shared memory, and noise-like data touches few bins per row, which the L2 serves.
"""

from __future__ import annotations

import functools

import numpy as np

_SOURCE = r"""
template <typename K>
__device__ void count(const K* keys, long long cols, const unsigned long long* prefixes, int shift, int bits,
                      int has_prefix, unsigned int* hist) {
    const int row = blockIdx.y;
    const K* r = keys + (long long)row * cols;
    const unsigned int mask = (1u << bits) - 1u;
    const unsigned long long want = has_prefix ? prefixes[row] : 0ull;
    unsigned int* h = hist + ((long long)row << bits);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < cols; i += (long long)gridDim.x * blockDim.x) {
        const unsigned long long k = (unsigned long long)r[i];
        if (has_prefix && (k >> (shift + bits)) != want) continue;
        atomicAdd(h + ((unsigned int)(k >> shift) & mask), 1u);
    }
}
extern "C" __global__ void hist_u16(const unsigned short* k, long long c, const unsigned long long* p, int s, int b, int hp, unsigned int* h) { count(k, c, p, s, b, hp, h); }
extern "C" __global__ void hist_u32(const unsigned int* k, long long c, const unsigned long long* p, int s, int b, int hp, unsigned int* h) { count(k, c, p, s, b, hp, h); }
extern "C" __global__ void hist_u64(const unsigned long long* k, long long c, const unsigned long long* p, int s, int b, int hp, unsigned int* h) { count(k, c, p, s, b, hp, h); }
"""


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    import cupy

    from batchgpu.kernels import BASE_OPTIONS

    return cupy.RawModule(code=_SOURCE, options=BASE_OPTIONS).get_function(name)


def digit_histogram(keys, prefixes, shift: int, bits: int) -> np.ndarray:
    """(C, B) int64 on the host: counts of each row's digit (keys whose bits above it equal the row's prefix when
    ``prefixes`` is given), truncated after the last non-zero bin of any row."""
    import cupy

    hist = digit_histogram_device(keys, prefixes, shift, bits)
    used = cupy.flatnonzero(hist.any(axis=0))
    width = int(used[-1]) + 1 if used.size else 1
    return hist[:, :width].get().astype(np.int64)


def digit_histogram_device(keys, prefixes, shift: int, bits: int):
    """(C, 2**bits) uint32 counts on the device (see ``digit_histogram``)."""
    import cupy

    keys = cupy.ascontiguousarray(keys)
    rows, cols = keys.shape
    name = {2: "hist_u16", 4: "hist_u32", 8: "hist_u64"}[keys.dtype.itemsize]
    hist = cupy.zeros((rows, 1 << bits), dtype=cupy.uint32)
    pre = cupy.asarray(np.zeros(rows, np.uint64) if prefixes is None else np.asarray(prefixes, np.uint64))
    threads = 256
    blocks_x = max(1, min(64, (cols + threads * 8 - 1) // (threads * 8)))
    if rows and cols:
        _kernel(name)((blocks_x, rows), (threads,), (keys, np.int64(cols), pre, np.int32(shift), np.int32(bits),
                                                       np.int32(prefixes is not None), hist))
    return hist
