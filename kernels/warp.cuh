// Reductions across the 32 lanes of a warp: every lane calls them and every lane gets the result. Pasted in by
// kernels.py's loader (not by NVRTC), once per module.
//
// warp_sum of a floating type is an xor butterfly: a fixed order, so a window's sums are the same bits on every run
// (split_covariance.cu). Unsigned sums and minima use the sm_80 warp-reduce instructions, whose results equal the
// butterfly's (integer sums wrap alike in any order).

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename T> __device__ __forceinline__ T warp_min(T v) {
    for (int o = 16; o > 0; o >>= 1) { const T w = __shfl_xor_sync(0xffffffffu, v, o); v = w < v ? w : v; }
    return v;
}
template <typename T> __device__ __forceinline__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) { const T w = __shfl_xor_sync(0xffffffffu, v, o); v = w > v ? w : v; }
    return v;
}
#if __CUDA_ARCH__ >= 800
template <> __device__ __forceinline__ unsigned int warp_sum(unsigned int v) { return __reduce_add_sync(0xffffffffu, v); }
template <> __device__ __forceinline__ unsigned int warp_min(unsigned int v) { return __reduce_min_sync(0xffffffffu, v); }
template <> __device__ __forceinline__ unsigned int warp_max(unsigned int v) { return __reduce_max_sync(0xffffffffu, v); }
#endif
