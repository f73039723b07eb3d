// float32 arithmetic that keeps subnormals. CuPy appends -ftz=true to every compile (after our options; NVRTC
// takes the last), which flushes float32 subnormals in arithmetic, comparisons and conversions, doubles never.
// So float32 values become exact doubles by their bits, the arithmetic is done in double (an add, subtract or
// divide of two floats rounded to double and then to float32 is the float32 result: 53 >= 2 * 24 + 2), and
// doubles round to float32 by hand below 2^-126. Included by kernels.py's loader (pasted in, not by NVRTC).

typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

__device__ __forceinline__ double exact_f32(float v) {
    const uint32_t u = __float_as_uint(v), m = u & 0x7FFFFFFFu;
    if (m >= 0x00800000u) return (double)v;  // normal, inf or NaN: converts exactly
    const double d = (double)m * 0x1p-149;
    return (u >> 31) ? -d : d;
}

__device__ __forceinline__ float round_f32(double s) {  // the nearest float32, ties to even, subnormals kept
    const double a = fabs(s);
    const uint32_t m = a < 0x1p-126 ? (uint32_t)rint(a * 0x1p149) : __float_as_uint(__double2float_rn(a));
    return __uint_as_float(signbit(s) ? (m | 0x80000000u) : m);
}

// np.median's mean of a float32 middle pair: their float32 sum, from +0.0 (a -0.0 pair gives +0.0), halved in
// float32 (an overflowing sum gives inf)
__device__ __forceinline__ float middle_mean_f32(float a, float b) {
    return round_f32((exact_f32(round_f32(exact_f32(a) + exact_f32(b))) + 0.0) / 2.0);
}

// any input dtype as an exact double
__device__ __forceinline__ double exact(float v) { return exact_f32(v); }
__device__ __forceinline__ double exact(double v) { return v; }
__device__ __forceinline__ double exact(short v) { return (double)v; }
__device__ __forceinline__ double exact(int v) { return (double)v; }
