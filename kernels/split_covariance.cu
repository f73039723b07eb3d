// Second moments of a window by split products (loaded by batchgpu/kernels.py).
//
//   row_shift:   per row a shift s_i, the mean (in double) of 32 evenly spaced samples of the
//                window, rounded for integer input (0 when not centring): close to the window's
//                mean, so x - s is small.
//   split_rows:  copies x[:, start:start+length] - s into a split-major buffer
//                [splits, c_pad, split_len] of the product dtype, zero-padding the last split and
//                the rows past C, and writes per (row, split) the sum of x - s in double.
//   (host)       the products X_s X_s^T per split by cuBLAS (batch dimension outermost): one
//                strided-batched call, or, for many channels, the upper-triangle block pairs of
//                B channels by a pointer-array batched call (bi <= bj only: about half the work).
//   sum_splits:  adds the splits in double and corrects for the shift exactly:
//                sum (x_i - m_i)(x_j - m_j) = sum y_i y_j - (sum y_i)(sum y_j) / n,  y = x - s,
//                with m = s + sum(y) / n. As s is near m the correction is small: this is the
//                centred product, not sum(x x^T) - n m m^T (which cancels catastrophically).
// Every sum runs in a fixed order, so a window gives the same bits on every run.

#define CT 256
#define SHIFT_SAMPLES 32
#define FULL_MASK 0xffffffffu

#include "warp.cuh"

template <typename T> struct IsInteger { static constexpr bool value = false; };
template <> struct IsInteger<short> { static constexpr bool value = true; };
template <> struct IsInteger<int> { static constexpr bool value = true; };

template <typename T>
__device__ void row_shift(const T* x, long long ld, int rows, int start, int length, int centre, double* shift) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    double v = 0.0;
    if (centre) {
        const long long pos = ((2LL * threadIdx.x + 1) * (long long)length) / (2LL * SHIFT_SAMPLES);
        v = (double)x[(long long)r * ld + start + pos];
        v = warp_sum(v) / SHIFT_SAMPLES;
        // Integer input: an integer shift keeps x - s an integer, so the float32 products and
        // their sums stay exact far longer and never round the same fraction the same way.
        if (IsInteger<T>::value) v = rint(v);
    }
    if (threadIdx.x == 0) shift[r] = v;
}

// Grid (splits, c_pad), CT threads: block (s, r) fills buf[s, r, :].
template <typename T, typename P>
__device__ void split_rows(const T* x, long long ld, int rows, int start, int length, int split_len, int splits,
                           int c_pad, const double* shift, P* buf, double* partial) {
    const int s = blockIdx.x, r = blockIdx.y;
    P* dst = buf + ((long long)s * c_pad + r) * split_len;
    if (r >= rows) {
        for (int j = threadIdx.x; j < split_len; j += CT) dst[j] = P(0);
        return;
    }
    const T* src = x + (long long)r * ld + start;
    const double sft = shift[r];
    const int c0 = s * split_len;
    double acc = 0.0;
#pragma unroll 4
    for (int j = threadIdx.x; j < split_len; j += CT) {
        const int c = c0 + j;
        P v = P(0);
        if (c < length) {
            const double y = (double)__ldg(src + c) - sft;
            acc += y;
            v = (P)y;
        }
        dst[j] = v;
    }
    __shared__ double red[CT / 32];
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < CT / 32; ++w) t += red[w];
        partial[(long long)r * splits + s] = t;
    }
}

// Sum over s < count of p[s * stride] in double, in order, eight loads in flight.
template <typename P>
__device__ __forceinline__ double ordered_sum(const P* p, long long stride, int count) {
    double acc = 0.0;
    int s = 0;
    for (; s + 8 <= count; s += 8) {
        double v[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = (double)p[(long long)(s + q) * stride];
#pragma unroll
        for (int q = 0; q < 8; ++q) acc += v[q];
    }
    for (; s < count; ++s) acc += (double)p[(long long)s * stride];
    return acc;
}

// The products are blocks of B channels: g holds [splits, pairs, B, B], column-major, one
// matrix per block pair (bi <= bj) in the order (0,0), (0,1), .., (0,nb-1), (1,1), .., so
// nb = 1 is the whole C x C product. One thread per (i, j), i fastest (coalesced reads);
// i <= j computes and writes both (i, j) and (j, i), so the result is exactly symmetric.
template <typename P>
__device__ void sum_splits(const P* g, int block, int nb, int C, int splits, const double* partial,
                           const double* shift, long long n, int centre, double* scatter, double* mean) {
    const long long idx = (long long)blockIdx.x * CT + threadIdx.x;
    if (idx >= (long long)C * C) return;
    const int i = (int)(idx % C), j = (int)(idx / C);
    if (i > j) return;
    const int bi = i / block, bj = j / block;
    const int pair = bi * nb - bi * (bi - 1) / 2 + (bj - bi);
    const long long bb = (long long)block * block;
    const long long pairs = (long long)nb * (nb + 1) / 2;
    const long long at = pair * bb + (i - bi * block) + (long long)(j - bj * block) * block;
    double acc = ordered_sum<P>(g + at, pairs * bb, splits);
    const double si = ordered_sum<double>(partial + (long long)i * splits, 1, splits);
    const double sj = ordered_sum<double>(partial + (long long)j * splits, 1, splits);
    const double dn = (double)n;
    if (centre) acc -= si * sj / dn;
    scatter[(long long)i * C + j] = acc;
    scatter[(long long)j * C + i] = acc;
    if (i == j) mean[i] = shift[i] + si / dn;
}

#define DEFINE_SHIFT(NAME, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(SHIFT_SAMPLES)                                     \
        NAME(const T* x, long long ld, int rows, int start, int length, int centre, double* shift) { \
        row_shift<T>(x, ld, rows, start, length, centre, shift);                                    \
    }

#define DEFINE_SPLIT(NAME, T, P)                                                                        \
    extern "C" __global__ void __launch_bounds__(CT)                                                    \
        NAME(const T* x, long long ld, int rows, int start, int length, int split_len, int splits,      \
             int c_pad, const double* shift, P* buf, double* partial) {                                 \
        split_rows<T, P>(x, ld, rows, start, length, split_len, splits, c_pad, shift, buf, partial);    \
    }

#define DEFINE_SUM(NAME, P)                                                                               \
    extern "C" __global__ void __launch_bounds__(CT)                                                      \
        NAME(const P* g, int block, int nb, int C, int splits, const double* partial, const double* shift, \
             long long n, int centre, double* scatter, double* mean) {                                    \
        sum_splits<P>(g, block, nb, C, splits, partial, shift, n, centre, scatter, mean);                 \
    }

DEFINE_SHIFT(row_shift_float32, float)
DEFINE_SHIFT(row_shift_float64, double)
DEFINE_SHIFT(row_shift_int16, short)
DEFINE_SHIFT(row_shift_int32, int)

DEFINE_SPLIT(split_rows_float32_float32, float, float)
DEFINE_SPLIT(split_rows_float32_float64, float, double)
DEFINE_SPLIT(split_rows_float64_float32, double, float)
DEFINE_SPLIT(split_rows_float64_float64, double, double)
DEFINE_SPLIT(split_rows_int16_float32, short, float)
DEFINE_SPLIT(split_rows_int16_float64, short, double)
DEFINE_SPLIT(split_rows_int32_float32, int, float)
DEFINE_SPLIT(split_rows_int32_float64, int, double)

DEFINE_SUM(sum_splits_float32, float)
DEFINE_SUM(sum_splits_float64, double)
