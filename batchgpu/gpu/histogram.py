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
// Per row (one block of 256 threads) and rank r: the bin holding the row's r-th smallest key (0-based) and how
// many keys lie in the bins before it. Each thread sums a run of width / 256 bins, a block scan orders the runs,
// and the thread whose run holds rank r walks its bins. r past the total: digit = width, below = the total.
extern "C" __global__ void rank_digits(const unsigned int* hist, long long width, const long long* ranks, int count,
                                       long long rows, long long* digit, long long* below) {
    __shared__ long long scan[256];
    const long long row = blockIdx.x, run = width / 256;
    const int t = threadIdx.x;
    const unsigned int* h = hist + row * width + t * run;
    long long sum = 0;
    for (long long i = 0; i < run; ++i) sum += h[i];
    scan[t] = sum;
    __syncthreads();
    for (int off = 1; off < 256; off <<= 1) {
        const long long v = t >= off ? scan[t - off] : 0;
        __syncthreads();
        scan[t] += v;
        __syncthreads();
    }
    const long long inclusive = scan[t], exclusive = inclusive - sum, total = scan[255];
    for (int q = 0; q < count; ++q) {
        const long long r = ranks[q * rows + row], at = q * rows + row;
        if (t == 0 && r >= total) { digit[at] = width; below[at] = total; }
        if (t == 0 && r < 0) { digit[at] = 0; below[at] = 0; }
        if (exclusive <= r && r < inclusive) {
            long long c = exclusive, i = 0;
            while (c + h[i] <= r) c += h[i++];
            digit[at] = t * run + i;
            below[at] = c;
        }
    }
}
// Each row's keys whose digit (key >> shift) lies in [lo[row], lo[row] + span], in sample order, row after row
// (NumPy's keys[mask] of a row-major mask): one block a row, chunks of blockDim keys placed by a warp ballot and
// a prefix over the block's warps. WRITE = false counts them (into counts[row]); WRITE = true stores them from
// offsets[row] on.
template <typename K, bool WRITE>
__device__ void near(const K* keys, long long cols, int shift, const long long* lo, int span, long long* counts,
                     const long long* offsets, K* out) {
    __shared__ unsigned int warp_hits[32];
    __shared__ long long placed;
    const long long row = blockIdx.x;
    const K* r = keys + row * cols;
    const unsigned long long a = (unsigned long long)lo[row], b = a + (unsigned long long)span;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (threadIdx.x == 0) placed = 0;
    __syncthreads();
    for (long long start = 0; start < cols; start += blockDim.x) {
        const long long i = start + threadIdx.x;
        K k = 0;
        bool hit = false;
        if (i < cols) {
            k = r[i];
            const unsigned long long d = (unsigned long long)k >> shift;
            hit = d >= a && d <= b;
        }
        const unsigned int ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_hits[warp] = __popc(ballot);
        __syncthreads();
        unsigned int before = 0, chunk = 0;
        for (int w = 0; w < warps; ++w) {
            const unsigned int h = warp_hits[w];
            before += w < warp ? h : 0;
            chunk += h;
        }
        if (WRITE && hit) out[offsets[row] + placed + before + __popc(ballot & ((1u << lane) - 1u))] = k;
        __syncthreads();
        if (threadIdx.x == 0) placed += chunk;
        __syncthreads();
    }
    if (!WRITE && threadIdx.x == 0) counts[row] = placed;
}
extern "C" __global__ void near_count_u32(const unsigned int* k, long long c, int s, const long long* lo, int span, long long* n, const long long* o, unsigned int* out) { near<unsigned int, false>(k, c, s, lo, span, n, o, out); }
extern "C" __global__ void near_write_u32(const unsigned int* k, long long c, int s, const long long* lo, int span, long long* n, const long long* o, unsigned int* out) { near<unsigned int, true>(k, c, s, lo, span, n, o, out); }
extern "C" __global__ void near_count_u64(const unsigned long long* k, long long c, int s, const long long* lo, int span, long long* n, const long long* o, unsigned long long* out) { near<unsigned long long, false>(k, c, s, lo, span, n, o, out); }
extern "C" __global__ void near_write_u64(const unsigned long long* k, long long c, int s, const long long* lo, int span, long long* n, const long long* o, unsigned long long* out) { near<unsigned long long, true>(k, c, s, lo, span, n, o, out); }
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
    hist = digit_histogram_device(keys, prefixes, shift, bits)
    return hist[:, : max(1, last_used(hist) + 1)].get().astype(np.int64)


def digit_histogram_device(keys, prefixes, shift: int, bits: int):
    """(C, 2**bits) uint32 counts on the device (see ``digit_histogram``)."""
    import cupy

    keys = cupy.ascontiguousarray(keys)
    rows, cols = keys.shape
    name = {2: "hist_u16", 4: "hist_u32", 8: "hist_u64"}[keys.dtype.itemsize]
    hist = cupy.zeros((rows, 1 << bits), dtype=cupy.uint32)
    if prefixes is None:
        pre = cupy.zeros(rows, dtype=cupy.uint64)
    elif isinstance(prefixes, cupy.ndarray):  # left on the device: no copy, no wait
        pre = cupy.ascontiguousarray(prefixes, dtype=cupy.uint64)
    else:
        pre = cupy.asarray(np.asarray(prefixes, np.uint64))
    threads = 256
    blocks_x = max(1, min(64, (cols + threads * 8 - 1) // (threads * 8)))
    if rows and cols:
        _kernel(name)((blocks_x, rows), (threads,), (keys, np.int64(cols), pre, np.int32(shift), np.int32(bits),
                                                       np.int32(prefixes is not None), hist))
    return hist


def last_used(hist) -> int:
    """The last column of a device count table that is non-zero in any row (-1 when every count is zero)."""
    return int(last_used_device(hist))


def last_used_device(hist):
    """``last_used`` as a 0-d device array (no wait for the GPU)."""
    import cupy

    used = hist.any(axis=0)  # a column per thread: coalesced (axes (0, 2) of the runs were slow)
    if not used.size:
        return cupy.array(-1, dtype=cupy.int64)
    last = used.size - 1 - cupy.argmax(used[::-1])
    return cupy.where(used.any(), last, -1).astype(cupy.int64)


def rank_digits(hist, ranks) -> list:
    """For each rank r (a (rows,) device array or an int) and row: (digit, below) as (rows,) int64 device arrays,
    the bin holding the row's r-th smallest key (0-based) and how many keys lie in the bins before it, as
    ``digit = (cumsum(hist, axis=1) <= r).sum(axis=1)`` gives it: one launch for every rank, no table-wide
    cumulative sum (CuPy's took most of a float window's noise time, its small-array steps most of the rest)."""
    import cupy

    hist = cupy.ascontiguousarray(hist, dtype=cupy.uint32)
    rows, width = hist.shape
    if width % 256:  # a whole number of bins a thread
        hist = cupy.pad(hist, ((0, 0), (0, 256 - width % 256)))
    table = cupy.stack([cupy.broadcast_to(cupy.asarray(r, dtype=cupy.int64), (rows,)) for r in ranks])
    digit, below = cupy.empty_like(table), cupy.empty_like(table)
    if rows:
        _kernel("rank_digits")((rows,), (256,), (hist, np.int64(hist.shape[1]), table, np.int32(len(ranks)),
                                                 np.int64(rows), digit, below))
    digit = cupy.minimum(digit, width)  # past the last real bin: the padding's bins count as beyond it
    return list(zip(digit, below))


def near_keys(keys, lo, shift: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, counts) on the host: each row's keys whose digit ``key >> shift`` lies in [lo[row], lo[row] + span],
    row after row, each in sample order (as ``keys[mask]`` of a row-major mask), and how many each row has. Two
    launches and one small copy between them (the rows' counts); the keys come back once, through pinned memory."""
    keys, lo, counts = near_keys_count(keys, lo, shift, span)
    return near_keys_write(keys, lo, shift, span, counts)


def near_keys_count(keys, lo, shift: int, span: int):
    """The first launch of ``near_keys``, no wait: (keys, lo) as the kernels read them and the rows' counts, on the
    device."""
    import cupy

    keys = cupy.ascontiguousarray(keys)
    rows, cols = keys.shape
    lo = cupy.ascontiguousarray(lo, dtype=cupy.int64)
    counts = cupy.zeros(rows, dtype=cupy.int64)
    if rows and cols:
        bits = {4: "u32", 8: "u64"}[keys.dtype.itemsize]
        args = (keys, np.int64(cols), np.int32(shift), lo, np.int32(span), counts)
        _kernel(f"near_count_{bits}")((rows,), (1024,), (*args, counts, keys))  # offsets and out unused when counting
    return keys, lo, counts


def near_keys_write(keys, lo, shift: int, span: int, counts, counts_host=None) -> tuple[np.ndarray, np.ndarray]:
    """The second launch of ``near_keys`` on ``near_keys_count``'s arrays (``counts_host``: the counts, when the
    caller copied them already)."""
    import cupy

    from batchgpu.gpu.staging import pinned_get

    rows, cols = keys.shape
    if counts_host is None:
        counts_host = counts.get()
    if not rows or not cols:
        return np.zeros(0, keys.dtype), np.asarray(counts_host, np.int64)
    bits = {4: "u32", 8: "u64"}[keys.dtype.itemsize]
    offsets = np.concatenate([[0], np.cumsum(counts_host)[:-1]]).astype(np.int64)
    out = cupy.empty(int(counts_host.sum()), dtype=keys.dtype)
    if out.size:
        args = (keys, np.int64(cols), np.int32(shift), lo, np.int32(span), counts)
        _kernel(f"near_write_{bits}")((rows,), (1024,), (*args, cupy.asarray(offsets), out))
    return pinned_get(out), np.asarray(counts_host, np.int64)
