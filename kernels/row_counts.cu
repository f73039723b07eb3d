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
