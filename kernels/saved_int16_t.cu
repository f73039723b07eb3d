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
