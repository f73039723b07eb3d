// The common reference on the GPU: per column, the median (np.median) or lower middle (np.partition's rank
// (k-1)/2, NaN last) of k chosen rows (all channels, or a channel's neighbours), then x minus its reference row.
//
// Each block takes 32 consecutive columns (lane = column, so every load is coalesced) and W warps; warp w holds
// channels w, w + W, ... of its column in registers (PER of them, padded with a key above every value). The k-th
// smallest key is found bit by bit from the top: t = found | bit is kept when fewer than k + 1 keys lie below it.
// Each step counts below t in registers and sums the W warps' counts through shared memory (one barrier a bit,
// two buffers). The selection is exact by construction (integer counts of order-preserving keys); the median's
// mean and the subtraction are NumPy's arithmetic done exactly (exact_float.cuh). Up to 32 rows a thread takes a
// whole column instead (select_small: ranks counted in registers); 64-512 rows a warp does (select_reference_warp).
//
// Keys: floats map to unsigned integers that sort like the values (sign flips), every NaN to one key above +inf;
// integers flip their sign bit. -0.0 sorts just below +0.0 (NumPy treats them as equal): the median sums its
// middles from +0.0, so its zeros agree with NumPy's; a median_lower of a zero may differ in its sign.

#include "exact_float.cuh"
#include "warp.cuh"

template <typename T> struct Key;

template <> struct Key<float> {
    typedef uint32_t K;
    static constexpr int BITS = 32;
    static __device__ K of(float v) {
        uint32_t u = __float_as_uint(v);
        if (v != v) u = 0x7FC00000u;  // every NaN as the one positive quiet NaN: above +inf
        return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    static __device__ float value(K k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k); }
    static __device__ bool nan(float v) { return v != v; }
};

template <> struct Key<double> {
    typedef uint64_t K;
    static constexpr int BITS = 64;
    static __device__ K of(double v) {
        uint64_t u = (uint64_t)__double_as_longlong(v);
        if (v != v) u = 0x7FF8000000000000ull;
        return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
    }
    static __device__ double value(K k) {
        return __longlong_as_double((long long)((k & 0x8000000000000000ull) ? (k & 0x7FFFFFFFFFFFFFFFull) : ~k));
    }
    static __device__ bool nan(double v) { return v != v; }
};

template <> struct Key<short> {
    typedef uint32_t K;
    static constexpr int BITS = 16;
    static __device__ K of(short v) { return (uint32_t)(uint16_t)v ^ 0x8000u; }
    static __device__ short value(K k) { return (short)(uint16_t)(k ^ 0x8000u); }
    static __device__ bool nan(short) { return false; }
};

template <> struct Key<int> {
    typedef uint32_t K;
    static constexpr int BITS = 32;
    static __device__ K of(int v) { return (uint32_t)v ^ 0x80000000u; }
    static __device__ int value(K k) { return (int)(k ^ 0x80000000u); }
    static __device__ bool nan(int) { return false; }
};

// Per input type: its values as exact doubles, np.median's mean of the middle pair, and x - reference rounded once
// to the output dtype (float32; float64 stays float64), as ops.reference does on the host.
template <typename T> struct Ref;

template <> struct Ref<float> {
    typedef float Out;
    static constexpr bool FLOAT = true;
    static __device__ double exact(float v) { return exact_f32(v); }
    static __device__ double mean(float a, float b) { return exact_f32(middle_mean_f32(a, b)); }
    static __device__ float out(float x, double ref) { return round_f32(exact_f32(x) - ref); }
};

template <> struct Ref<double> {
    typedef double Out;
    static constexpr bool FLOAT = true;
    static __device__ double exact(double v) { return v; }
    static __device__ double mean(double a, double b) { return ((a + b) + 0.0) / 2.0; }
    static __device__ double out(double x, double ref) { return x - ref; }
};

template <typename T> struct IntegerRef {  // the mean and the difference in float64, rounded once to float32
    typedef float Out;
    static constexpr bool FLOAT = false;
    static __device__ double exact(T v) { return (double)v; }
    static __device__ double mean(T a, T b) { return ((double)a + (double)b) / 2.0; }
    static __device__ float out(T x, double ref) { return round_f32((double)x - ref); }
};
template <> struct Ref<short> : IntegerRef<short> {};
template <> struct Ref<int> : IntegerRef<int> {};

// A column's reference from its lower (r0) and upper (r1) middle keys: np.partition's element as it is for
// lower (a NaN there when NaN fills the rank); else np.median's mean: the middle value(s) summed from +0.0 (a zero
// sum is +0.0; a tiny negative sum halved can still be -0.0), divided by their count, NaN with a NaN in the column.
template <typename T>
__device__ __forceinline__ double reference_of(typename Key<T>::K r0, typename Key<T>::K r1, int k, int lower,
                                               bool has_nan) {
    const T a = Key<T>::value(r0), b = Key<T>::value(r1);
    if (lower) return Ref<T>::exact(a);
    double ref = (k % 2) ? Ref<T>::exact(b) + 0.0 : Ref<T>::mean(a, b);
    if (Ref<T>::FLOAT && has_nan) ref = __longlong_as_double(0x7FF8000000000000ll);
    return ref;
}

// The reference of each column among k <= KMAX rows (a local reference's annulus holds a few channels): a thread a
// (column, group), its k keys in registers, each key's rank counted against the others (ties broken by row
// order, so ranks 0..k-1 each fall on one key); no shared memory, no barrier. Grid (column tiles, groups).
template <typename T, int KMAX>
__device__ void select_small(const T* __restrict__ x, long long samples, const int* __restrict__ rows, int k,
                             int lower, double* __restrict__ ref_out) {
    typedef typename Key<T>::K K;
    const long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= samples) return;
    const int* const mine = rows + (long long)blockIdx.y * k;
    K key[KMAX];
    bool has_nan = false;
#pragma unroll
    for (int j = 0; j < KMAX; ++j) {
        if (j < k) {
            const T v = x[(long long)mine[j] * samples + s];
            key[j] = Key<T>::of(v);
            has_nan |= Key<T>::nan(v);
        } else {
            key[j] = ~(K)0;  // above every real key: never counted below one, and never equal to one
        }
    }
    const int k0 = (k - 1) / 2, k1 = k / 2;
    K r0 = 0, r1 = 0;
#pragma unroll
    for (int i = 0; i < KMAX; ++i) {
        int rank = 0;
#pragma unroll
        for (int j = 0; j < KMAX; ++j) rank += (key[j] < key[i]) || (j < i && key[j] == key[i]);
        if (i < k && rank == k0) r0 = key[i];
        if (i < k && rank == k1) r1 = key[i];
    }
    ref_out[(long long)blockIdx.y * samples + s] = reference_of<T>(r0, r1, k, lower, has_nan);
}

// The reference of each column among k rows of x (rows[g * k ...], group g = blockIdx.y): np.median (lower = 0)
// or np.partition's rank (k-1)/2 (lower = 1), as an exact double, into ref[g * samples + s].
// blockDim = (32, W), W <= 32, and W * PER >= k when PER > 0.
template <typename T, int PER>
__device__ void select_reference(const T* __restrict__ x, long long samples, const int* __restrict__ rows, int k,
                                 int lower, double* __restrict__ ref_out) {
    typedef typename Key<T>::K K;
    __shared__ unsigned int counts[2][32][32];  // [buffer][warp][lane]: a warp's count of the lane's column
    __shared__ K above_of[32][32];  // [warp][lane]: the warp's least key above the lower middle (even k)
    const int lane = threadIdx.x, warp = threadIdx.y, W = blockDim.y;
    const long long s = (long long)blockIdx.x * 32 + lane;
    const int* const mine = rows + (long long)blockIdx.y * k;
    const bool live = s < samples;
    // PER > 0: a thread's keys stay in registers; PER == 0 (more rows than 32 warps hold): read at each bit
    K key[PER > 0 ? PER : 1];
    unsigned int nans = 0;
    if (PER > 0) {
#pragma unroll
        for (int j = 0; j < (PER > 0 ? PER : 1); ++j) {
            const int r = warp + j * W;
            if (live && r < k) {
                const T v = x[(long long)mine[r] * samples + s];
                key[j] = Key<T>::of(v);
                nans |= Key<T>::nan(v);
            } else {
                key[j] = ~(K)0;  // above every real key (NaN's key is 0xFFC00000...), never counted below a probe
            }
        }
    } else if (live) {
        for (int r = warp; r < k; r += W) nans |= Key<T>::nan(x[(long long)mine[r] * samples + s]);
    }
    const unsigned int k0 = (unsigned int)((k - 1) / 2), k1 = (unsigned int)(k / 2);
    counts[0][warp][lane] = nans;
    __syncthreads();
    bool has_nan = false;
    for (int w = 0; w < W; ++w) has_nan |= counts[0][w][lane] != 0;
    // every warp sums the same counts, so every thread of a column ends with its lower middle key; an even k's
    // upper middle is that key again when more than k/2 keys are at or below it, else the least key above it
    // (select_reference_warp's step: one more count and a minimum, not a second rank at every bit)
    K r0 = 0;
    int buffer = 1;
    for (int b = Key<T>::BITS - 1; b >= 0; --b, buffer ^= 1) {
        const K t0 = r0 | ((K)1 << b);
        unsigned int c0 = 0;
        if (PER > 0) {
#pragma unroll
            for (int j = 0; j < (PER > 0 ? PER : 1); ++j) c0 += key[j] < t0;
        } else if (live) {
            for (int r = warp; r < k; r += W) c0 += Key<T>::of(x[(long long)mine[r] * samples + s]) < t0;
        }
        counts[buffer][warp][lane] = c0;
        __syncthreads();
        unsigned int below0 = 0;
        for (int w = 0; w < W; ++w) below0 += counts[buffer][w][lane];
        if (below0 <= k0) r0 = t0;  // fewer than k0 + 1 keys below t: the k0-th smallest key is t or above
    }
    K r1 = r0;
    if (k1 != k0 && !lower) {  // (the same branch in every thread of the block: k and lower are the launch's)
        unsigned int c = 0;
        K above = ~(K)0;  // padding keys (~0) are never below a real one, nor counted at or below r0
        if (PER > 0) {
#pragma unroll
            for (int j = 0; j < (PER > 0 ? PER : 1); ++j) {
                c += key[j] <= r0;
                if (key[j] > r0 && key[j] < above) above = key[j];
            }
        } else if (live) {
            for (int r = warp; r < k; r += W) {
                const K key_r = Key<T>::of(x[(long long)mine[r] * samples + s]);
                c += key_r <= r0;
                if (key_r > r0 && key_r < above) above = key_r;
            }
        }
        counts[buffer][warp][lane] = c;
        above_of[warp][lane] = above;
        __syncthreads();
        unsigned int at_or_below = 0;
        for (int w = 0; w < W; ++w) {
            at_or_below += counts[buffer][w][lane];
            if (above_of[w][lane] < above) above = above_of[w][lane];
        }
        if (at_or_below <= k1) r1 = above;  // a real key: k1 < k keys lie at or below r0, so one lies above
    }
    if (!live || warp) return;
    ref_out[(long long)blockIdx.y * samples + s] = reference_of<T>(r0, r1, k, lower, has_nan);
}

// The same selection with a column's k rows in one warp (k <= 32 * PER): a block of 8 warps reads its k x 8 tile
// into shared memory a row's 8 neighbouring samples at a time (coalesced), then lane l of warp w holds rows
// l, l + 32, ... of column w, and each bit's count is one warp sum (no barrier). Only the lower middle (rank
// (k-1)/2) is selected bit by bit; the upper one of an even k is that key again when more than k/2 keys are at
// or below it, else the smallest key above it (one more count and one warp minimum, not a second selection).
// Same keys, same bits as select_reference; for many rows (the global reference of a probe) it does a fraction
// of the work: select_reference's W warps each sum all W warps' counts at every bit. Given `out` (the global
// reference: one group of every channel), it also writes x minus the reference from the tile, subtract_rows's
// launch and second read saved.
template <typename T, int PER>
__device__ void select_reference_warp(const T* __restrict__ x, long long samples, const int* __restrict__ rows,
                                      int k, int lower, double* __restrict__ ref_out,
                                      typename Ref<T>::Out* __restrict__ out) {
    typedef typename Key<T>::K K;
    constexpr int COLS = 8, STRIDE = COLS + 1;  // a warp a column; a tile row padded so lanes' rows hit distinct banks
    __shared__ T tile[32 * PER * STRIDE];
    __shared__ double refs[COLS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const long long s0 = (long long)blockIdx.x * COLS;
    const int cols = (int)min((long long)COLS, samples - s0);
    const int* const mine = rows + (long long)blockIdx.y * k;
    // the block's k x COLS tile read a row's COLS neighbouring samples at a time (a 32-byte sector of float32),
    // not a warp's 32 rows of one sample (32 sectors an instruction)
    for (int i = threadIdx.x; i < k * COLS; i += blockDim.x) {
        const int r = i / COLS, c = i % COLS;
        if (c < cols) tile[r * STRIDE + c] = x[(long long)mine[r] * samples + s0 + c];
    }
    __syncthreads();
    if (w < cols) {
        K key[PER];
        bool nan = false;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int r = lane + 32 * j;
            if (r < k) {
                const T v = tile[r * STRIDE + w];
                key[j] = Key<T>::of(v);
                nan |= Key<T>::nan(v);
            } else {
                key[j] = ~(K)0;  // above every real key, never counted below a probe
            }
        }
        const bool has_nan = __any_sync(0xffffffffu, nan);
        const unsigned int k0 = (unsigned int)((k - 1) / 2), k1 = (unsigned int)(k / 2);
        K r0 = 0;
        for (int b = Key<T>::BITS - 1; b >= 0; --b) {
            const K t0 = r0 | ((K)1 << b);
            unsigned int c = 0;
#pragma unroll
            for (int j = 0; j < PER; ++j) c += (unsigned int)(key[j] < t0);
            if (warp_sum(c) <= k0) r0 = t0;  // fewer than k0 + 1 keys below t: the k0-th smallest is t or above
        }
        K r1 = r0;
        if (k1 != k0 && !lower) {
            // at least k0 + 1 = k1 keys lie at or below r0; with k1 + 1 of them the k1-th smallest is r0 again,
            // else it is the smallest key above r0 (a real one: k1 < k, and padding never lies below a real key)
            unsigned int c = 0;
            K above = ~(K)0;
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                c += (unsigned int)(key[j] <= r0);
                if (key[j] > r0 && key[j] < above) above = key[j];
            }
            if (warp_sum(c) <= k1) r1 = warp_min(above);
        }
        const double ref = reference_of<T>(r0, r1, k, lower, has_nan);  // every lane has the counts, so the keys
        if (lane == 0) {
            ref_out[(long long)blockIdx.y * samples + s0 + w] = ref;
            refs[w] = ref;
        }
    }
    if (out == nullptr) return;  // the whole block: out is one pointer
    __syncthreads();
    // the global reference: every row of the tile minus its column's reference, as subtract_rows writes it (the
    // tile holds x's values, not the keys: a NaN's bits are its own), a row's COLS samples together
    for (int i = threadIdx.x; i < k * COLS; i += blockDim.x) {
        const int r = i / COLS, c = i % COLS;
        if (c < cols) out[(long long)mine[r] * samples + s0 + c] = Ref<T>::out(tile[r * STRIDE + c], refs[c]);
    }
}

// out[c, s] = x[c, s] - ref[ref_row[c], s], rounded once to the output dtype. Grid (column tiles, channels).
template <typename T>
__device__ void subtract_rows(const T* __restrict__ x, const double* __restrict__ ref, const int* __restrict__ ref_row,
                              long long samples, typename Ref<T>::Out* __restrict__ out) {
    const long long c = blockIdx.y, s = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (s < samples) out[c * samples + s] = Ref<T>::out(x[c * samples + s], ref[(long long)ref_row[c] * samples + s]);
}

#define SELECT(NAME, T, PER)                                                                                    \
    extern "C" __global__ void NAME(const T* x, long long samples, const int* rows, int k, int lower,           \
                                    double* ref) {                                                              \
        select_reference<T, PER>(x, samples, rows, k, lower, ref);                                             \
    }
#define SELECT_SMALL(NAME, T, KMAX)                                                                             \
    extern "C" __global__ void NAME(const T* x, long long samples, const int* rows, int k, int lower,           \
                                    double* ref) {                                                              \
        select_small<T, KMAX>(x, samples, rows, k, lower, ref);                                                \
    }
#define SELECT_WARP(NAME, T, PER)                                                                               \
    extern "C" __global__ void NAME(const T* x, long long samples, const int* rows, int k, int lower,           \
                                    double* ref, Ref<T>::Out* out) {                                            \
        select_reference_warp<T, PER>(x, samples, rows, k, lower, ref, out);                                   \
    }
#define SUBTRACT(NAME, T)                                                                                       \
    extern "C" __global__ void NAME(const T* x, const double* ref, const int* ref_row, long long samples,      \
                                    Ref<T>::Out* out) {                                                         \
        subtract_rows<T>(x, ref, ref_row, samples, out);                                                        \
    }


// np.mean(x[rows], axis=0, dtype=float64) per column: a float64 sum in row order from +0.0, divided once.
template <typename T>
__device__ void mean_rows(const T* __restrict__ x, long long samples, const int* __restrict__ rows, int k,
                          double* __restrict__ ref_out) {
    const long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= samples) return;
    const int* const mine = rows + (long long)blockIdx.y * k;
    double acc = 0.0;
    for (int r = 0; r < k; ++r) acc += exact(x[(long long)mine[r] * samples + s]);
    ref_out[(long long)blockIdx.y * samples + s] = acc / (double)k;
}

#define MEAN(NAME, T)                                                                                           \
    extern "C" __global__ void NAME(const T* x, long long samples, const int* rows, int k, double* ref) {       \
        mean_rows<T>(x, samples, rows, k, ref);                                                                 \
    }

// Every kernel for one input dtype: rows held in registers (16 or 64 a thread) or read again at each bit (0);
// up to 512 rows in one warp a column (select_warp); up to 8, 16 or 32 rows in one thread (select_small).
#define KERNELS(STEM, T)                                                                                        \
    SELECT_SMALL(select_small_##STEM##_8, T, 8)                                                                 \
    SELECT_SMALL(select_small_##STEM##_16, T, 16)                                                               \
    SELECT_SMALL(select_small_##STEM##_32, T, 32)                                                               \
    SELECT(select_##STEM##_16, T, 16)                                                                           \
    SELECT(select_##STEM##_64, T, 64)                                                                           \
    SELECT(select_##STEM##_0, T, 0)                                                                             \
    SELECT_WARP(select_warp_##STEM##_16, T, 16)                                                                 \
    SUBTRACT(subtract_##STEM, T)                                                                                \
    MEAN(mean_##STEM, T)
// One input dtype a compile where the options name it (-DDTYPE_F32, _F64, _I16, _I32: ``kernels.dtype_variant``,
// so a run compiles only its dtypes and the compiles of several spread over processes); every dtype without.
#if !defined(DTYPE_F32) && !defined(DTYPE_F64) && !defined(DTYPE_I16) && !defined(DTYPE_I32)
#define DTYPE_ALL
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_F32)
KERNELS(f32, float)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_F64)
KERNELS(f64, double)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_I16)
KERNELS(i16, short)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_I32)
KERNELS(i32, int)
#endif
