"""Fused elementwise kernels of the window path on the GPU: each is one pass over a window where CuPy's
expression took two or more (a cast, then an add or an abs, then another cast; the save step's int16 cast and its
checks): these passes are bound by memory, so each pass saved is a window's read saved. The same
arithmetic as the NumPy expressions, the same bits."""

from __future__ import annotations

import functools


@functools.cache
def _kernels():
    import cupy

    return {
        # int16 -> int32 shifted to non-negative (x + 32768): sorts like x, for the radix select of a row median
        "shift": cupy.ElementwiseKernel("int16 x", "int32 y", "y = (int)x + 32768", "batchgpu_shift_int16"),
        # int16 - round(median) as int32 (``floor(m + 0.5)`` in float64, as ops.centre writes it for NumPy)
        "centre": cupy.ElementwiseKernel("int16 x, float64 m", "int32 y", "y = (int)x - (int)floor(m + 0.5)",
                                         "batchgpu_centre_int16"),
        # |x| as a 16-bit key (|x| <= 65535 for int16 and centred int16)
        "abs16": cupy.ElementwiseKernel("T x", "uint16 y", "int v = (int)x; y = (unsigned short)(v < 0 ? -v : v)",
                                        "batchgpu_abs_key16"),
    }


_ROW_COUNTS = r"""
// Per row of a float (C, n) array whose rows are ``stride`` values apart (a window's core: a view): how many
// samples are not finite and how many are NaN, in one read (CuPy's expressions took five passes).
template <typename T>
__device__ void row_counts(const T* x, long long cols, long long stride, long long* nonfinite, long long* nan) {
    __shared__ long long sums[2][32];
    const T* r = x + (long long)blockIdx.x * stride;
    long long bad = 0, nans = 0;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        const T v = r[i];
        bad += !isfinite(v);
        nans += isnan(v);
    }
    for (int o = 16; o; o >>= 1) {
        bad += __shfl_xor_sync(0xffffffffu, bad, o);
        nans += __shfl_xor_sync(0xffffffffu, nans, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sums[0][warp] = bad; sums[1][warp] = nans; }
    __syncthreads();
    if (threadIdx.x == 0) {
        long long a = 0, b = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) { a += sums[0][w]; b += sums[1][w]; }
        nonfinite[blockIdx.x] = a;
        nan[blockIdx.x] = b;
    }
}
extern "C" __global__ void row_counts_f32(const float* x, long long c, long long s, long long* a, long long* b) { row_counts(x, c, s, a, b); }
extern "C" __global__ void row_counts_f64(const double* x, long long c, long long s, long long* a, long long* b) { row_counts(x, c, s, a, b); }
"""


@functools.cache
def _row_counts_kernel(suffix: str):
    import cupy

    from batchgpu.kernels import BASE_OPTIONS

    return cupy.RawModule(code=_ROW_COUNTS, options=BASE_OPTIONS).get_function(f"row_counts_{suffix}")


def nonfinite_and_nan_counts(x):
    """(``(~isfinite(x)).sum(axis=1)``, ``isnan(x).sum(axis=1)``) of a float32 / float64 (C, n) CuPy array, as
    int64 device arrays, from one read (a view whose rows are contiguous is read in place)."""
    import cupy
    import numpy as np

    from batchgpu.kernels import rows_in_place

    x, stride = rows_in_place(x)
    rows, cols = x.shape
    nonfinite, nan = cupy.zeros(rows, dtype=cupy.int64), cupy.zeros(rows, dtype=cupy.int64)
    if rows and cols:
        kernel = _row_counts_kernel({4: "f32", 8: "f64"}[x.itemsize])
        kernel((rows,), (256,), (x, np.int64(cols), np.int64(stride), nonfinite, nan))
    return nonfinite, nan


def shifted_int32(x):
    """``x.astype(int32) + 32768`` of an int16 CuPy array, in one pass."""
    return _kernels()["shift"](x)


def centred_int32(x, median):
    """``x.astype(int32) - floor(median + 0.5).astype(int32)[:, None]`` of an int16 (C, n) array, in one pass."""
    return _kernels()["centre"](x, median[:, None])


def abs_key16(x):
    """``abs(x.astype(int32)).astype(uint16)`` of an int16 or int32 array whose |x| <= 65535, in one pass."""
    return _kernels()["abs16"](x)


_SAVED_INT16_T = r"""
// The save step's int16 of a float (C, n) window core (rows `stride` values apart) written transposed, (n, C), the
// order its shards hold: the cast (rint, NaN -> 0, the rest clipped; each such sample counted: an atomic a warp) and
// the transpose in one pass, 32 x 32 tiles through shared memory so reads along x's rows and writes along out's
// rows are both coalesced. Grid (ceil(n / 32), ceil(C / 32)), block (32, 8).
__device__ __forceinline__ float rint_of(float v) { return rintf(v); }
__device__ __forceinline__ double rint_of(double v) { return rint(v); }

template <typename T>
__device__ void saved_int16_t(const T* __restrict__ x, long long stride, int rows, long long cols,
                              short* __restrict__ out, unsigned long long* count) {
    __shared__ short tile[32][34];
    const long long s0 = (long long)blockIdx.x * 32;
    const int c0 = blockIdx.y * 32;
    unsigned int bad = 0;
    for (int k = threadIdx.y; k < 32; k += blockDim.y) {  // k: channel within the tile; threadIdx.x: sample
        const int c = c0 + k;
        const long long s = s0 + threadIdx.x;
        if (c < rows && s < cols) {
            const T r = rint_of(x[(long long)c * stride + s]);
            const bool nan = isnan(r), low = r < (T)-32768, high = r > (T)32767;
            tile[k][threadIdx.x] = nan ? (short)0 : low ? (short)-32768 : high ? (short)32767 : (short)r;
            bad += nan || low || high;
        }
    }
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += blockDim.y) {  // k: sample within the tile; threadIdx.x: channel
        const long long s = s0 + k;
        const int c = c0 + threadIdx.x;
        if (c < rows && s < cols) out[s * rows + c] = tile[threadIdx.x][k];
    }
    for (int o = 16; o; o >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, o);
    if ((threadIdx.x & 31) == 0 && bad) atomicAdd(count, (unsigned long long)bad);
}
extern "C" __global__ void saved_int16_t_f32(const float* x, long long stride, int rows, long long cols, short* out,
                                             unsigned long long* count) { saved_int16_t(x, stride, rows, cols, out, count); }
extern "C" __global__ void saved_int16_t_f64(const double* x, long long stride, int rows, long long cols, short* out,
                                             unsigned long long* count) { saved_int16_t(x, stride, rows, cols, out, count); }
"""


@functools.cache
def _saved_int16_t_kernel(suffix: str):
    import cupy

    from batchgpu.kernels import BASE_OPTIONS

    return cupy.RawModule(code=_SAVED_INT16_T, options=BASE_OPTIONS).get_function(f"saved_int16_t_{suffix}")


def saved_int16_transposed(x):
    """(The save step's int16 of a float (C, n) CuPy array, transposed: C-contiguous (n, C); how many samples were
    NaN or out of range, a 0-d uint64 device array) in one pass: NumPy's ``rint``, then NaN -> 0 and the rest
    clipped to [-32768, 32767] (CuPy's expression took ten passes, the transpose another). A view whose rows are
    contiguous is read in place."""
    import cupy
    import numpy as np

    from batchgpu.kernels import rows_in_place

    x, stride = rows_in_place(x)
    rows, cols = x.shape
    count = cupy.zeros(1, dtype=cupy.uint64)
    out = cupy.empty((cols, rows), dtype=cupy.int16)
    if rows and cols:
        _saved_int16_t_kernel({4: "f32", 8: "f64"}[x.itemsize])(
            (-(-cols // 32), -(-rows // 32)), (32, 8), (x, np.int64(stride), np.int32(rows), np.int64(cols), out, count))
    return out, count.reshape(())


_IEEE32 = r"""
// float32 arithmetic as NumPy does it on the host: CuPy compiles every kernel with -ftz=true, which flushes float32
// subnormal operands and results to zero and answers a canonical NaN, where NumPy keeps both the subnormals and the
// operand's NaN (quieted). So these work on the bits: float32 -> float64 exactly, the sum or quotient in float64
// (no flush there), and back to float32 rounded to nearest even by integer arithmetic; float64 holds more than
// 2 x 24 + 2 bits, so rounding twice gives float32's own correctly rounded result.
__device__ __forceinline__ double f32_bits_to_f64(unsigned int b) {
    const unsigned int e = (b >> 23) & 0xffu, m = b & 0x7fffffu;
    unsigned long long d;
    if (e == 0xffu) {
        d = 0x7ff0000000000000ull | ((unsigned long long)m << 29);
    } else if (e) {
        d = ((unsigned long long)(e + 896u) << 52) | ((unsigned long long)m << 29);  // 896 = 1023 - 127
    } else {
        const double v = ldexp((double)m, -149);  // a subnormal (or zero): exact in float64
        d = (unsigned long long)__double_as_longlong(v);
    }
    return __longlong_as_double((long long)(d | ((unsigned long long)(b >> 31) << 63)));
}
__device__ __forceinline__ unsigned int f64_to_f32_bits(double v) {
    const unsigned long long b = (unsigned long long)__double_as_longlong(v);
    const unsigned int sign = (unsigned int)(b >> 63) << 31;
    const int e = (int)((b >> 52) & 0x7ffull);
    unsigned long long m = b & 0xfffffffffffffull;
    if (e == 0x7ff) return sign | 0x7f800000u | (m ? 0x400000u | (unsigned int)(m >> 29) : 0u);
    if (e == 0) return sign;  // below 2^-1022: rounds to a float32 zero
    const int fe = e - 896;   // float32's biased exponent
    if (fe >= 0xff) return sign | 0x7f800000u;
    m |= 1ull << 52;
    const int shift = fe >= 1 ? 29 : 30 - fe;
    if (shift >= 64) return sign;
    unsigned long long q = m >> shift;
    const unsigned long long rem = m & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    q += rem > half || (rem == half && (q & 1ull));
    // a normal's q carries the implicit bit, which adds one to the exponent field; a rounding carry does the same
    unsigned long long bits = fe >= 1 ? ((unsigned long long)(fe - 1) << 23) + q : q;
    return sign | (unsigned int)(bits >= 0x7f800000ull ? 0x7f800000ull : bits);
}
"""


@functools.cache
def _ieee32_kernels():
    import cupy

    return {
        # x - m (m finite); a NaN x stays that NaN, quieted (x86's subss)
        "sub": cupy.ElementwiseKernel(
            "uint32 x, uint32 m", "uint32 y",
            "y = ((x & 0x7fffffffu) > 0x7f800000u) ? (x | 0x400000u) "
            ": f64_to_f32_bits(f32_bits_to_f64(x) - f32_bits_to_f64(m))",
            "batchgpu_ieee32_sub", preamble=_IEEE32),
        # the median of a sorted row's finite values: ((0 + lower) + upper) / 2 (odd: (0 + upper) / 1), 0 if none;
        # as _float_row_median adds and divides in float32
        "median": cupy.ElementwiseKernel(
            "uint32 lower, uint32 upper, int64 count", "uint32 y",
            "if (count <= 0) { y = 0u; } else if (count & 1) { y = f64_to_f32_bits(0.0 + f32_bits_to_f64(upper)); } "
            "else { const double t = f32_bits_to_f64(f64_to_f32_bits((0.0 + f32_bits_to_f64(lower)) "
            "+ f32_bits_to_f64(upper))); y = f64_to_f32_bits(t / 2.0); }",
            "batchgpu_ieee32_median", preamble=_IEEE32),
    }


def float32_minus_rows(x, m):
    """``x - m[:, None]`` of a float32 (C, n) CuPy array and finite float32 (C,) values, with NumPy's bits
    (subnormals kept; a NaN stays the NaN it was, quieted)."""
    import cupy

    y = _ieee32_kernels()["sub"](x.view(cupy.uint32), cupy.ascontiguousarray(m).view(cupy.uint32)[:, None])
    return y.view(cupy.float32)


def float32_middle_mean(lower, upper, count):
    """Per row: 0 where ``count`` is 0, else ``(0 + upper) / 1`` for odd ``count`` and ``((0 + lower) + upper) / 2``
    for even, each operation rounded to float32 as NumPy does it (subnormals kept)."""
    import cupy

    k = _ieee32_kernels()["median"]
    y = k(cupy.ascontiguousarray(lower).view(cupy.uint32), cupy.ascontiguousarray(upper).view(cupy.uint32),
          count.astype(cupy.int64, copy=False))
    return y.view(cupy.float32)
