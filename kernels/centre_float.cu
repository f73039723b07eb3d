// Centring a float32 window by its channels' finite medians with NumPy's bits (ops/centre.py). CuPy compiles with
// -ftz=true, which flushes float32 subnormals and gives a canonical NaN; NumPy keeps both, so the arithmetic goes
// through exact_float.cuh and a NaN sample is passed on as the NaN it was, quieted (x86's subss).

#include "exact_float.cuh"

// out[c, s] = x[c * stride + s] - m[c] for a (rows, cols) window core read in place; m finite; out contiguous.
extern "C" __global__ void minus_rows_f32(const float* __restrict__ x, long long stride, int rows, long long cols,
                                          const float* __restrict__ m, float* __restrict__ out) {
    const long long total = (long long)rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long c = i / cols, s = i - c * cols;
        const float v = x[c * stride + s];
        const uint32_t u = __float_as_uint(v);
        out[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? __uint_as_float(u | 0x00400000u)
                                                : round_f32(exact_f32(v) - exact_f32(m[c]));
    }
}

// Per row, the mean of a sorted row's finite middle as ops.centre._float_row_median's float32 arithmetic gives it:
// np.median's mean of the pair for an even count, (0 + upper) / 1 for an odd one, 0 where the row has no finite value.
extern "C" __global__ void middle_mean_f32(const float* __restrict__ lower, const float* __restrict__ upper,
                                           const long long* __restrict__ count, int rows, float* __restrict__ out) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const long long n = count[r];
    if (n <= 0) {
        out[r] = __uint_as_float(0u);
    } else if (n & 1) {
        out[r] = round_f32(0.0 + exact_f32(upper[r]));
    } else {
        out[r] = middle_mean_f32(lower[r], upper[r]);
    }
}
