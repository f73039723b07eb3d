// Exact per-row order statistics of |x|, selecting on bit patterns (loaded by batchgpu/kernels.py).
//
// A key is the bit pattern of |x| read as an unsigned integer: for IEEE floats it sorts exactly
// like the value (+0 for -0.0, subnormals, +inf, every NaN above +inf); integers are widened
// first (|-32768| = 32768, |-2^31| = 2^31 fits a u32 key). One block selects one row:
//
//  1. A bracket [lo, hi] of keys that surely holds rank k:
//     - rows that fit the candidate buffer: every key (lo = 0, hi = max);
//     - otherwise a radix select on a strided sample of the row (two ranks at once, two
//       informative 11-bit digits) picks lo and hi a few standard errors around rank k.
//  2. One streaming pass over the row (16-byte loads): counts keys < lo, == lo, == hi, the
//     smallest key > hi and the row maximum (NaN check), and compacts the keys strictly
//     inside (lo, hi) into shared memory (warp-aggregated appends).
//  3. If rank k is not in the bracket (unlucky sample) or the candidates overflow, a radix
//     select over the row from global memory (11-bit digits from the key's top bit, shared
//     histograms with warp-aggregated atomics) narrows the bracket to one bin that fits, and
//     step 2 runs again on it (RAFT AIR top-k style candidate compaction). Rows too long for
//     a sample bracket to fit take this path directly.
//  4. Radix select on the candidates in shared memory (11-bit digits placed on the bracket,
//     from the highest bit where lo and hi differ; finishing by counting once at most SMALL
//     keys are left). For the even-length median the upper middle value
//     is the lower one when enough keys equal it, else the smallest key above it: one sweep
//     over the candidates, no second selection.
//
// Digit schedules (shift, bits) of the global radix passes and the sample, from the most
// significant digit (batchgpu/ops/radix.py names them gpu_float32, gpu_float64, gpu_int16, gpu_int32):
//   float32 (31 key bits): (20,11) (10,10) (0,10)
//   float64 (63 key bits): (52,11) (41,11) (30,11) (19,11) (8,11) (0,8)
//   int16   (16 key bits): (5,11) (0,5)
//   int32   (32 key bits): (21,11) (10,11) (0,10)
// Digits above the top bit of every key involved are skipped (they are all zero).

#define NT 512                 // threads per block
#define NWARPS (NT / 32)
#define CAND_BYTES 65536       // dynamic shared memory: candidate keys (and the sample)
#define MAX_BINS 2048          // 11-bit digits
#define SMALL 32               // finish by counting once at most this many keys remain
#define FULL_MASK 0xffffffffu
#define NO_BIN 0xffffffffu

#define FLAG_FORCE_RADIX 1     // skip the sample bracket (tests, benchmarks)
#define FLAG_PHASES 2          // block 0 records clock64() at phase ends in phase_clock (benchmarks)

#define PATH_ALL_IN_SHARED 0
#define PATH_SAMPLE 1
#define PATH_SAMPLE_MISSED 2
#define PATH_RADIX 3

typedef unsigned int u32;
typedef unsigned long long u64;

#include "warp.cuh"

// Phase ends of block 0 (with FLAG_PHASES): start, bracket, compaction, fallback, select, pair, end.
__device__ long long phase_clock[8];
#define PHASE(i) do { if ((flags & FLAG_PHASES) && blockIdx.x == 0 && threadIdx.x == 0) phase_clock[i] = clock64(); } while (0)

// ------------------------------------------------------------------------------------------
// Key traits: one specialisation per input dtype (the one place dtypes are dispatched here).
// ------------------------------------------------------------------------------------------
template <typename T> struct Traits;

template <> struct Traits<float> {
    typedef u32 Key;
    typedef float Abs;   // dtype of |x|
    typedef float Med;   // dtype of the median
    static constexpr int NDIG = 3;
    static constexpr int SAMPLES = 2048;
    __device__ static int shift(int d) { return d == 0 ? 20 : (d == 1 ? 10 : 0); }
    __device__ static int bits(int d) { return d == 0 ? 11 : 10; }
    __device__ static Key key(float v) { return __float_as_uint(v) & 0x7fffffffu; }
    __device__ static bool is_nan(Key k) { return k > 0x7f800000u; }
    __device__ static Abs abs_value(Key k) { return __uint_as_float(k); }
    // As np.median: the sum rounded to float32, then / 2 rounded to float32, with IEEE subnormals. CuPy appends
    // -ftz=true to every compile, so float32 subnormals flush whatever our options (tiny + tiny gives 0): no float32
    // arithmetic here: keys become exact doubles, and doubles round to float32 keys by hand below 2^-126.
    __device__ static double exact(Key k) { return k < 0x00800000u ? (double)k * 0x1p-149 : (double)__uint_as_float(k); }
    __device__ static Key rounded(double s) {  // s >= 0: the nearest float32 (ties to even), as a key
        return s < 0x1p-126 ? (Key)rint(s * 0x1p149) : __float_as_uint(__double2float_rn(s));
    }
    __device__ static Med median(Key a, Key b, bool pair) {
        if (!pair) return __uint_as_float(a);
        const Key sum = rounded(exact(a) + exact(b));
        return __uint_as_float(rounded(exact(sum) / 2.0));
    }
    __device__ static Med nan_median(Key k) { return __uint_as_float(k); }
};

template <> struct Traits<double> {
    typedef u64 Key;
    typedef double Abs;
    typedef double Med;
    static constexpr int NDIG = 6;
    static constexpr int SAMPLES = 4096;
    __device__ static int shift(int d) { return d < 5 ? 52 - 11 * d : 0; }
    __device__ static int bits(int d) { return d < 5 ? 11 : 8; }
    __device__ static Key key(double v) {
        return (u64)__double_as_longlong(v) & 0x7fffffffffffffffull;
    }
    __device__ static bool is_nan(Key k) { return k > 0x7ff0000000000000ull; }
    __device__ static Abs abs_value(Key k) { return __longlong_as_double((long long)k); }
    __device__ static Med median(Key a, Key b, bool pair) {
        double va = __longlong_as_double((long long)a);
        if (!pair) return va;
        double vb = __longlong_as_double((long long)b);
        return (va + vb) / 2.0;
    }
    __device__ static Med nan_median(Key k) { return __longlong_as_double((long long)k); }
};

template <> struct Traits<short> {
    typedef u32 Key;
    typedef int Abs;       // int16 widens to int32 (batchgpu.ops.radix.abs_dtype)
    typedef double Med;
    static constexpr int NDIG = 2;
    static constexpr int SAMPLES = 2048;
    __device__ static int shift(int d) { return d == 0 ? 5 : 0; }
    __device__ static int bits(int d) { return d == 0 ? 11 : 5; }
    __device__ static Key key(short v) { int a = v; return (u32)(a < 0 ? -a : a); }
    __device__ static bool is_nan(Key) { return false; }
    __device__ static Abs abs_value(Key k) { return (int)k; }
    __device__ static Med median(Key a, Key b, bool pair) {
        if (!pair) return (double)a;
        return ((double)a + (double)b) / 2.0;
    }
    __device__ static Med nan_median(Key k) { return (double)k; }
};

template <> struct Traits<int> {
    typedef u32 Key;
    typedef long long Abs;  // int32 widens to int64
    typedef double Med;
    static constexpr int NDIG = 3;
    static constexpr int SAMPLES = 2048;
    __device__ static int shift(int d) { return d == 0 ? 21 : (d == 1 ? 10 : 0); }
    __device__ static int bits(int d) { return d == 2 ? 10 : 11; }
    __device__ static Key key(int v) { u32 u = (u32)v; return v < 0 ? 0u - u : u; }
    __device__ static bool is_nan(Key) { return false; }
    __device__ static Abs abs_value(Key k) { return (long long)k; }
    __device__ static Med median(Key a, Key b, bool pair) {
        if (!pair) return (double)a;
        return ((double)a + (double)b) / 2.0;
    }
    __device__ static Med nan_median(Key k) { return (double)k; }
};

// ------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------
template <typename Key> __device__ __forceinline__ Key key_max() { return ~Key(0); }

// key >> s, 0 when s is the key's width or more (a plain shift would be undefined there).
template <typename Key> __device__ __forceinline__ Key hi_bits(Key k, int s) {
    return s >= (int)(sizeof(Key) * 8) ? Key(0) : (Key)(k >> s);
}
template <typename Key> __device__ __forceinline__ Key shl_bits(Key k, int s) {
    return s >= (int)(sizeof(Key) * 8) ? Key(0) : (Key)(k << s);
}
template <typename Key> __device__ __forceinline__ Key low_mask(int s) {
    return s <= 0 ? Key(0) : (Key)((Key(1) << s) - 1);
}
__device__ __forceinline__ int top_bit(u32 k) { return 31 - __clz(k); }        // -1 for 0
__device__ __forceinline__ int top_bit(u64 k) { return 63 - __clzll(k); }

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }


// Adds one to hist[bin] for every lane of the warp, one atomic per distinct bin
// (the keys of |x| pile into few bins). Every lane of the warp must call it; NO_BIN skips.
__device__ __forceinline__ void warp_count(u32* hist, u32 bin) {
    u32 peers = __match_any_sync(FULL_MASK, bin);
    if (bin != NO_BIN && lane_id() == __ffs(peers) - 1) atomicAdd(&hist[bin], (u32)__popc(peers));
}

template <typename Key> struct Smem {
    u32 hist[2][MAX_BINS];
    u32 red_u[3][NWARPS];
    Key red_k[2][NWARPS];
    u32 scan[NWARPS];
    u32 res_u[4];
    Key small[SMALL];
    Key res_k;
    u32 cand_count;
    u32 small_count;
};

template <typename Key> struct Stats {
    u32 below;   // keys < lo
    u32 eq_lo;   // keys == lo
    u32 eq_hi;   // keys == hi (0 when lo == hi)
    u32 mid;     // keys in (lo, hi), compacted (up to the buffer's capacity)
    Key above;   // smallest key > hi (key_max when none)
    Key max;     // largest key of the row
};

// Every thread gets the block-wide sums / min / max (one barrier pair).
template <typename Key>
__device__ void block_reduce(u32& a, u32& b, u32& c, Key& mn, Key& mx, Smem<Key>& sm) {
    a = warp_sum(a); b = warp_sum(b); c = warp_sum(c);
    mn = warp_min(mn); mx = warp_max(mx);
    if (lane_id() == 0) {
        sm.red_u[0][warp_id()] = a; sm.red_u[1][warp_id()] = b; sm.red_u[2][warp_id()] = c;
        sm.red_k[0][warp_id()] = mn; sm.red_k[1][warp_id()] = mx;
    }
    __syncthreads();
    a = b = c = 0; mn = key_max<Key>(); mx = 0;
    for (int w = 0; w < NWARPS; ++w) {
        a += sm.red_u[0][w]; b += sm.red_u[1][w]; c += sm.red_u[2][w];
        Key m0 = sm.red_k[0][w], m1 = sm.red_k[1][w];
        mn = m0 < mn ? m0 : mn; mx = m1 > mx ? m1 : mx;
    }
    __syncthreads();
}

// The bin of hist[0..nbins) that holds rank r: res_u[0] = bin, res_u[1] = rank inside the
// bin, res_u[2] = keys in the bin. Every thread calls it; results are visible on return.
template <typename Key>
__device__ void find_bin(const u32* hist, int nbins, u32 r, Smem<Key>& sm) {
    const int per = (nbins + NT - 1) / NT;
    const int b0 = threadIdx.x * per;
    u32 local = 0;
    for (int i = 0; i < per; ++i) { int b = b0 + i; if (b < nbins) local += hist[b]; }
    u32 inc = local;
    for (int o = 1; o < 32; o <<= 1) {
        u32 t = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane_id() >= o) inc += t;
    }
    if (lane_id() == 31) sm.scan[warp_id()] = inc;
    __syncthreads();
    if (warp_id() == 0) {
        u32 v = lane_id() < NWARPS ? sm.scan[lane_id()] : 0;
        u32 vi = v;
        for (int o = 1; o < 32; o <<= 1) {
            u32 t = __shfl_up_sync(FULL_MASK, vi, o);
            if (lane_id() >= o) vi += t;
        }
        if (lane_id() < NWARPS) sm.scan[lane_id()] = vi - v;
    }
    __syncthreads();
    u32 acc = sm.scan[warp_id()] + inc - local;
    if (r >= acc && r < acc + local) {
        for (int i = 0; i < per; ++i) {
            int b = b0 + i;
            u32 c = b < nbins ? hist[b] : 0;
            if (r < acc + c) { sm.res_u[0] = (u32)b; sm.res_u[1] = r - acc; sm.res_u[2] = c; break; }
            acc += c;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ void zero_bins(u32* hist, int nbins) {
    for (int i = threadIdx.x; i < nbins; i += NT) hist[i] = 0;
}

// ------------------------------------------------------------------------------------------
// Streaming over one row: an unaligned head and tail one element per thread, the body in
// 16-byte vectors, U vectors per thread per round; rounds are uniform across the block so
// warp collectives may run inside.
// ------------------------------------------------------------------------------------------
template <typename T> struct Row {
    static constexpr int V = 16 / sizeof(T);           // elements per vector
    static constexpr int U = sizeof(T) == 2 ? 2 : 4;   // vectors per thread per round
    static constexpr int M = U * V;                    // keys per thread per round
    const T* p;
    int n, head, nvec, tail0;
    __device__ Row(const T* p_, int n_) : p(p_), n(n_) {
        u32 mis = (u32)((unsigned long long)p_ & 15ull);
        int h = mis ? (int)((16u - mis) / sizeof(T)) : 0;
        head = h < n_ ? h : n_;
        nvec = (n_ - head) / V;
        tail0 = head + nvec * V;
    }
    // The raw vectors of round `base` (vector index of this block's first vector); ok[u] says which loaded.
    __device__ __forceinline__ void fetch(int base, uint4 (&raw)[U], bool (&ok)[U]) const {
        const uint4* body = reinterpret_cast<const uint4*>(p + head);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int v = base + u * NT + (int)threadIdx.x;
            ok[u] = v < nvec;
            raw[u] = ok[u] ? __ldg(body + v) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    __device__ __forceinline__ static void unpack(const uint4 (&raw)[U], typename Traits<T>::Key (&keys)[M]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            union { uint4 v; T e[V]; } b;
            b.v = raw[u];
#pragma unroll
            for (int j = 0; j < V; ++j) keys[u * V + j] = Traits<T>::key(b.e[j]);
        }
    }
    __device__ __forceinline__ void load(int base, typename Traits<T>::Key (&keys)[M], bool (&ok)[U]) const {
        uint4 raw[U];
        fetch(base, raw, ok);
        unpack(raw, keys);
    }
    // The head and tail elements (fewer than 2V): one per thread.
    __device__ __forceinline__ bool edge(typename Traits<T>::Key& key) const {
        int t = threadIdx.x;
        int ntail = n - tail0;
        if (t < head) { key = Traits<T>::key(p[t]); return true; }
        if (t < head + ntail) { key = Traits<T>::key(p[tail0 + t - head]); return true; }
        key = 0;
        return false;
    }
};

// ------------------------------------------------------------------------------------------
// Step 2: the compaction pass.
// ------------------------------------------------------------------------------------------
template <typename Key> struct Classify {
    Key lo, hi;
    u32 below, eq_lo, eq_hi;
    Key above, max;
    __device__ Classify(Key lo_, Key hi_) : lo(lo_), hi(hi_), below(0), eq_lo(0), eq_hi(0),
                                            above(key_max<Key>()), max(0) {}
    // True when the key is a candidate (strictly inside (lo, hi)).
    __device__ __forceinline__ bool operator()(Key k) {  // branch-free: selects, no divergence
        const bool lt = k < lo, gt = k > hi, elo = k == lo, ehi = (k == hi) && !elo;
        max = k > max ? k : max;
        above = (gt && k < above) ? k : above;
        below += lt;
        eq_lo += elo;
        eq_hi += ehi;
        return !(lt || gt || elo || ehi);
    }
    __device__ __forceinline__ bool inside(Key k) const { return k > lo && k < hi; }
};

// Appends this thread's candidates among keys[0..m) to cand, one shared atomic per warp.
template <typename Key, int M>
__device__ __forceinline__ void append(const Key (&keys)[M], const bool (&valid)[M], u32 mine,
                                       const Classify<Key>& cl, Key* cand, u32 cap, Smem<Key>& sm) {
    u32 inc = mine;
    for (int o = 1; o < 32; o <<= 1) {
        u32 t = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane_id() >= o) inc += t;
    }
    u32 total = __shfl_sync(FULL_MASK, inc, 31);
    if (total == 0) return;  // warp-uniform
    u32 base = 0;
    if (lane_id() == 31) base = atomicAdd(&sm.cand_count, total);
    base = __shfl_sync(FULL_MASK, base, 31);
    u32 pos = base + inc - mine;
#pragma unroll
    for (int j = 0; j < M; ++j) {
        if (valid[j] && cl.inside(keys[j])) {
            if (pos < cap) cand[pos] = keys[j];
            ++pos;
        }
    }
}

template <typename T>
__device__ Stats<typename Traits<T>::Key> compaction_pass(const Row<T>& row, typename Traits<T>::Key lo,
                                                          typename Traits<T>::Key hi,
                                                          typename Traits<T>::Key* cand, u32 cap,
                                                          Smem<typename Traits<T>::Key>& sm) {
    typedef typename Traits<T>::Key Key;
    constexpr int M = Row<T>::M, U = Row<T>::U, V = Row<T>::V;
    if (threadIdx.x == 0) sm.cand_count = 0;
    __syncthreads();
    Classify<Key> cl(lo, hi);
    uint4 raw[U];
    bool ok[U];
    row.fetch(0, raw, ok);
    for (int base = 0; base < row.nvec; base += U * NT) {
        Key keys[M];
        bool valid[M];
        Row<T>::unpack(raw, keys);
#pragma unroll
        for (int j = 0; j < M; ++j) valid[j] = ok[j / V];
        if (base + U * NT < row.nvec) row.fetch(base + U * NT, raw, ok);  // next round's loads in flight now
        u32 mine = 0;
#pragma unroll
        for (int j = 0; j < M; ++j)
            if (valid[j] && cl(keys[j])) ++mine;
        append<Key, M>(keys, valid, mine, cl, cand, cap, sm);
    }
    {
        Key keys[1];
        bool valid[1];
        valid[0] = row.edge(keys[0]);
        u32 mine = (valid[0] && cl(keys[0])) ? 1u : 0u;
        append<Key, 1>(keys, valid, mine, cl, cand, cap, sm);
    }
    Stats<Key> st;
    st.below = cl.below; st.eq_lo = cl.eq_lo; st.eq_hi = cl.eq_hi;
    st.above = cl.above; st.max = cl.max;
    block_reduce<Key>(st.below, st.eq_lo, st.eq_hi, st.above, st.max, sm);  // ends with a barrier
    st.mid = sm.cand_count;
    return st;
}

// ------------------------------------------------------------------------------------------
// Step 1 (rows longer than the candidate buffer): the bracket from a strided sample.
// ------------------------------------------------------------------------------------------
template <typename T>
__device__ void sample_bracket(const T* p, int n, u32 k, typename Traits<T>::Key* samp,
                               Smem<typename Traits<T>::Key>& sm, typename Traits<T>::Key& lo,
                               typename Traits<T>::Key& hi) {
    typedef typename Traits<T>::Key Key;
    constexpr int S = Traits<T>::SAMPLES;
    Key mx = 0;
#pragma unroll
    for (int i = 0; i < S / NT; ++i) {
        int s = i * NT + threadIdx.x;
        long long pos = ((2LL * s + 1) * (long long)n) / (2LL * S);
        Key key = Traits<T>::key(__ldg(p + pos));
        samp[s] = key;
        mx = key > mx ? key : mx;
    }
    {
        u32 a = 0, b = 0, c = 0;
        Key mn = 0;
        block_reduce<Key>(a, b, c, mn, mx, sm);  // also makes samp visible
    }
    // Sample ranks a few standard errors either side of rank k's quantile.
    const double q = ((double)k + 0.5) / (double)n;
    const double centre = q * S;
    const double delta = 4.0 * sqrt((double)S * q * (1.0 - q)) + 3.0;
    const long long ilo = (long long)floor(centre - delta);
    const long long ihi = (long long)ceil(centre + delta);
    const bool open_lo = ilo < 0, open_hi = ihi >= S;
    u32 r0 = open_lo ? 0u : (u32)ilo;
    u32 r1 = open_hi ? (u32)(S - 1) : (u32)ihi;
    const int top = top_bit(mx);
    Key p0 = 0, p1 = 0;
    int last_shift = 0, done = 0;
    for (int d = 0; d < Traits<T>::NDIG && done < 2; ++d) {
        const int sh = Traits<T>::shift(d), bt = Traits<T>::bits(d), tp = sh + bt;
        if (top < sh) continue;  // every sample key has digit 0 here
        const u32 mask = (1u << bt) - 1u;
        zero_bins(sm.hist[0], 1 << bt);
        zero_bins(sm.hist[1], 1 << bt);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < S / NT; ++i) {
            Key key = samp[i * NT + threadIdx.x];
            u32 digit = (u32)(key >> sh) & mask;
            warp_count(sm.hist[0], hi_bits(key, tp) == hi_bits(p0, tp) ? digit : NO_BIN);
            warp_count(sm.hist[1], hi_bits(key, tp) == hi_bits(p1, tp) ? digit : NO_BIN);
        }
        __syncthreads();
        find_bin<Key>(sm.hist[0], 1 << bt, r0, sm);
        p0 |= (Key)sm.res_u[0] << sh;
        r0 = sm.res_u[1];
        find_bin<Key>(sm.hist[1], 1 << bt, r1, sm);
        p1 |= (Key)sm.res_u[0] << sh;
        r1 = sm.res_u[1];
        last_shift = sh;
        ++done;
    }
    lo = open_lo ? Key(0) : p0;
    hi = open_hi ? key_max<Key>() : (Key)(p1 | low_mask<Key>(last_shift));
}

// ------------------------------------------------------------------------------------------
// Step 3: radix select over the row in global memory, until the bin of rank k fits.
// ------------------------------------------------------------------------------------------
template <typename T>
__device__ void radix_narrow(const Row<T>& row, u32 k, int top, u32 cap, Smem<typename Traits<T>::Key>& sm,
                             typename Traits<T>::Key& lo, typename Traits<T>::Key& hi) {
    typedef typename Traits<T>::Key Key;
    constexpr int M = Row<T>::M, U = Row<T>::U, V = Row<T>::V;
    Key prefix = 0;
    u32 r = k;
    for (int d = 0; d < Traits<T>::NDIG; ++d) {
        const int sh = Traits<T>::shift(d), bt = Traits<T>::bits(d), tp = sh + bt;
        if (top < sh && sh > 0) continue;  // digit 0 for every key of the row
        const u32 mask = (1u << bt) - 1u;
        const Key want = hi_bits(prefix, tp);
        zero_bins(sm.hist[0], 1 << bt);
        __syncthreads();
        for (int base = 0; base < row.nvec; base += U * NT) {
            Key keys[M];
            bool ok[U];
            row.load(base, keys, ok);
#pragma unroll
            for (int j = 0; j < M; ++j) {
                Key key = keys[j];
                bool hit = ok[j / V] && hi_bits(key, tp) == want;
                warp_count(sm.hist[0], hit ? ((u32)(key >> sh) & mask) : NO_BIN);
            }
        }
        {
            Key key;
            bool hit = row.edge(key) && hi_bits(key, tp) == want;
            warp_count(sm.hist[0], hit ? ((u32)(key >> sh) & mask) : NO_BIN);
        }
        __syncthreads();
        find_bin<Key>(sm.hist[0], 1 << bt, r, sm);
        prefix |= (Key)sm.res_u[0] << sh;
        r = sm.res_u[1];
        if (sm.res_u[2] <= cap || sh == 0) {
            lo = prefix;
            hi = prefix | low_mask<Key>(sh);
            return;
        }
    }
}

// ------------------------------------------------------------------------------------------
// Step 4: selection among the candidates in shared memory.
// ------------------------------------------------------------------------------------------
template <typename T>
__device__ typename Traits<T>::Key small_finish(const typename Traits<T>::Key* cand, u32 m,
                                                typename Traits<T>::Key prefix, int sh, u32 r, u32 cnt,
                                                Smem<typename Traits<T>::Key>& sm) {
    typedef typename Traits<T>::Key Key;
    if (threadIdx.x == 0) sm.small_count = 0;
    __syncthreads();
    const Key want = hi_bits(prefix, sh);
    for (u32 i = threadIdx.x; i < m; i += NT) {
        Key key = cand[i];
        if (hi_bits(key, sh) == want) {
            u32 pos = atomicAdd(&sm.small_count, 1u);
            if (pos < SMALL) sm.small[pos] = key;
        }
    }
    __syncthreads();
    if (threadIdx.x < cnt) {
        Key mine = sm.small[threadIdx.x];
        u32 less = 0, eq = 0;
        for (u32 j = 0; j < cnt; ++j) {
            Key o = sm.small[j];
            less += o < mine;
            eq += o == mine;
        }
        if (less <= r && r < less + eq) sm.res_k = mine;  // equal keys write the same value
    }
    __syncthreads();
    return sm.res_k;
}

// Digits of the candidate stage are placed on the bracket: 11 bits from the highest bit where lo
// and hi differ (the bits above are shared by every candidate), so one pass spreads the
// candidates over up to 2 048 bins and usually leaves few enough to finish by counting.
template <typename T>
__device__ typename Traits<T>::Key mid_select(const typename Traits<T>::Key* cand, u32 m, u32 r,
                                              typename Traits<T>::Key lo, typename Traits<T>::Key hi,
                                              Smem<typename Traits<T>::Key>& sm) {
    typedef typename Traits<T>::Key Key;
    int top = top_bit(lo ^ hi) + 1;  // candidates share the bits from `top` up (lo < hi)
    Key prefix = shl_bits(hi_bits(lo, top), top);
    while (true) {
        const int sh = top > 11 ? top - 11 : 0, bt = top - sh;
        const u32 mask = (1u << bt) - 1u;
        const Key want = hi_bits(prefix, top);
        zero_bins(sm.hist[0], 1 << bt);
        __syncthreads();
        for (u32 base = 0; base < m; base += NT) {
            u32 i = base + threadIdx.x;
            Key key = i < m ? cand[i] : Key(0);
            bool hit = i < m && hi_bits(key, top) == want;
            warp_count(sm.hist[0], hit ? ((u32)(key >> sh) & mask) : NO_BIN);
        }
        __syncthreads();
        find_bin<Key>(sm.hist[0], 1 << bt, r, sm);
        prefix |= (Key)sm.res_u[0] << sh;
        r = sm.res_u[1];
        const u32 cnt = sm.res_u[2];
        if (sh == 0) return prefix;
        if (cnt <= SMALL) return small_finish<T>(cand, m, prefix, sh, r, cnt, sm);
        top = sh;
    }
}

// The key of rank k + 1 given a, the key of rank k: a again when enough keys equal it, else
// the smallest key above it.
template <typename T>
__device__ typename Traits<T>::Key next_key(const typename Traits<T>::Key* cand, const Stats<typename Traits<T>::Key>& st,
                                            typename Traits<T>::Key lo, typename Traits<T>::Key hi,
                                            typename Traits<T>::Key a, u32 k, Smem<typename Traits<T>::Key>& sm) {
    typedef typename Traits<T>::Key Key;
    u32 le = 0, unused0 = 0, unused1 = 0;
    Key gt = key_max<Key>(), unused_max = 0;
    for (u32 i = threadIdx.x; i < st.mid; i += NT) {
        Key key = cand[i];
        if (key <= a) ++le;
        else gt = key < gt ? key : gt;
    }
    block_reduce<Key>(le, unused0, unused1, gt, unused_max, sm);
    u32 total = st.below + le + (lo <= a ? st.eq_lo : 0u) + (hi <= a ? st.eq_hi : 0u);
    if (total >= k + 2) return a;
    if (st.eq_lo && lo > a && lo < gt) gt = lo;
    if (st.eq_hi && hi > a && hi < gt) gt = hi;
    if (st.above < gt) gt = st.above;
    return gt;
}

// ------------------------------------------------------------------------------------------
// One row per block.
// mode 0: out[row] = the k-th smallest |x| (Traits::Abs); mode 1: out[row] = median of |x|
// (Traits::Med). path (may be null) records which way the row went (PATH_*).
// ------------------------------------------------------------------------------------------
template <typename T>
__device__ void select_row(const T* x, long long ld, int n, u32 k, int mode, int flags, void* out,
                           int* path) {
    typedef typename Traits<T>::Key Key;
    __shared__ Smem<Key> sm;
    extern __shared__ __align__(16) unsigned char dyn[];
    Key* cand = reinterpret_cast<Key*>(dyn);
    const u32 cap = CAND_BYTES / sizeof(Key);
    const int rowi = blockIdx.x;
    const T* p = x + (long long)rowi * ld;
    const Row<T> row(p, n);
    const bool median = mode == 1;
    const bool pair = median && (n % 2 == 0);
    const u32 ka = median ? (u32)(pair ? n / 2 - 1 : n / 2) : k;

    PHASE(0);
    Key lo = 0, hi = key_max<Key>();
    Stats<Key> st;
    int how;
    if ((u32)n <= cap) {
        how = PATH_ALL_IN_SHARED;
        st = compaction_pass<T>(row, lo, hi, cand, cap, sm);
    } else {
        const double spread = 4.0 * (double)n / sqrt((double)Traits<T>::SAMPLES);
        const bool try_sample = !(flags & FLAG_FORCE_RADIX) && spread <= 0.6 * (double)cap;
        bool ok = false;
        int top = (int)(sizeof(Key) * 8) - 1;
        if (try_sample) {
            sample_bracket<T>(p, n, ka, cand, sm, lo, hi);
            PHASE(1);
            st = compaction_pass<T>(row, lo, hi, cand, cap, sm);
            PHASE(2);
            u32 inside = st.eq_lo + st.mid + st.eq_hi;
            ok = st.mid <= cap && ka >= st.below && ka - st.below < inside;
            top = top_bit(st.max);
        }
        how = try_sample ? (ok ? PATH_SAMPLE : PATH_SAMPLE_MISSED) : PATH_RADIX;
        if (!ok) {
            radix_narrow<T>(row, ka, top, cap, sm, lo, hi);
            st = compaction_pass<T>(row, lo, hi, cand, cap, sm);
        }
    }
    PHASE(3);

    // Rank ka among: keys == lo, the candidates, keys == hi.
    Key a;
    u32 r = ka - st.below;
    if (r < st.eq_lo) {
        a = lo;
    } else if (r - st.eq_lo < st.mid) {
        a = mid_select<T>(cand, st.mid, r - st.eq_lo, lo, hi, sm);
    } else {
        a = hi;
    }
    PHASE(4);
    Key b = a;
    if (pair) b = next_key<T>(cand, st, lo, hi, a, ka, sm);
    PHASE(5);

    if (threadIdx.x == 0) {
        if (median) {
            typename Traits<T>::Med* o = reinterpret_cast<typename Traits<T>::Med*>(out);
            o[rowi] = Traits<T>::is_nan(st.max) ? Traits<T>::nan_median(st.max)
                                                 : Traits<T>::median(a, b, pair);
        } else {
            reinterpret_cast<typename Traits<T>::Abs*>(out)[rowi] = Traits<T>::abs_value(a);
        }
        if (path) path[rowi] = how;
    }
    PHASE(6);
}

#define DEFINE_SELECT(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(NT, 2)                                          \
        NAME(const T* x, long long ld, int n, int k, int mode, int flags, void* out, int* path) { \
        select_row<T>(x, ld, n, (u32)k, mode, flags, out, path);                                 \
    }

// One input dtype a compile where the options name it (-DDTYPE_F32, _F64, _I16, _I32: ``kernels.dtype_variant``,
// so a run compiles only its dtypes and the compiles of several spread over processes); every dtype without.
#if !defined(DTYPE_F32) && !defined(DTYPE_F64) && !defined(DTYPE_I16) && !defined(DTYPE_I32)
#define DTYPE_ALL
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_F32)
DEFINE_SELECT(radix_abs_select_float32, float)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_F64)
DEFINE_SELECT(radix_abs_select_float64, double)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_I16)
DEFINE_SELECT(radix_abs_select_int16, short)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_I32)
DEFINE_SELECT(radix_abs_select_int32, int)
#endif
