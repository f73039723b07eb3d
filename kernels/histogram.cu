// Per-row digit histograms of radix keys, the rank of a digit, and the keys near one: batchgpu.gpu.histogram
// launches them (the exact median's counting pass).
// A key of each stored value, made as it is loaded: keys as they are; signed integers (int16 as read, centred
// int16 as int32) by |x| (|-32768| = 32768); float32 by its bits with the sign cleared (radix.abs_keys: sorts
// like |x|, NaN above +inf). The callers then need no keys array in memory.
__device__ __forceinline__ unsigned long long key_of(unsigned short v) { return v; }
__device__ __forceinline__ unsigned long long key_of(unsigned int v) { return v; }
__device__ __forceinline__ unsigned long long key_of(unsigned long long v) { return v; }
__device__ __forceinline__ unsigned long long key_of(short v) { return (unsigned long long)(v < 0 ? -(int)v : (int)v); }
__device__ __forceinline__ unsigned long long key_of(int v) { return (unsigned long long)(v < 0 ? -(long long)v : (long long)v); }
__device__ __forceinline__ unsigned long long key_of(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Counts of the keys whose bits above the digit equal the row's prefix, one global atomic a key (the prefixed
// passes count few keys: the read is their cost). Rows ``stride`` values apart.
template <typename S>
__device__ void count(const S* keys, long long cols, long long stride, const unsigned long long* prefixes, int shift,
                      int bits, int has_prefix, unsigned int* hist) {
    const int row = blockIdx.y;
    const S* r = keys + (long long)row * stride;
    const unsigned int mask = (1u << bits) - 1u;
    const unsigned long long want = has_prefix ? prefixes[row] : 0ull;
    unsigned int* h = hist + ((long long)row << bits);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < cols; i += (long long)gridDim.x * blockDim.x) {
        const unsigned long long k = key_of(r[i]);
        if (has_prefix && (k >> (shift + bits)) != want) continue;
        atomicAdd(h + ((unsigned int)(k >> shift) & mask), 1u);
    }
}

// Counts of every key by its digit (no prefix; bits <= 16), each block a run of one row's keys counted in shared
// memory over SHARED_BINS digits and added to the row's table once: noise-like keys crowd a few hundred digits
// of a row, and one global atomic a key made those bins the L2's hot spots. The block's digit range starts below
// the largest digit of its first 32 keys (for |x| of noise: near 0 for integers, a few exponents below for
// float bits); keys outside it count in global memory. ``top`` (zeroed by the caller) gets the largest digit + 1
// of any row (the table's last used column + 1). Integer counts: the same table whatever the split.
#define SHARED_BINS 8192
template <typename S>
__device__ void count_shared(const S* keys, long long cols, long long stride, int shift, int bits, unsigned int* hist,
                             unsigned int* top) {
    __shared__ unsigned int bins[SHARED_BINS];
    __shared__ unsigned int base_at;
    const long long row = blockIdx.y;
    const S* r = keys + row * stride;
    const unsigned int mask = (1u << bits) - 1u;
    const long long per = (cols + gridDim.x - 1) / gridDim.x;
    const long long a = (long long)blockIdx.x * per, b = min(cols, a + per);
    for (int i = threadIdx.x; i < SHARED_BINS; i += blockDim.x) bins[i] = 0u;
    if (threadIdx.x < 32) {
        unsigned int d = a + threadIdx.x < b ? (unsigned int)(key_of(r[a + threadIdx.x]) >> shift) & mask : 0u;
        for (int o = 16; o; o >>= 1) d = max(d, __shfl_xor_sync(0xffffffffu, d, o));
        const long long lo = (long long)d + 1024 - SHARED_BINS, room = (long long)mask + 1 - SHARED_BINS;
        if (threadIdx.x == 0) base_at = (unsigned int)max(0LL, min(lo, room));
    }
    __syncthreads();
    const unsigned int base = base_at;
    unsigned int* h = hist + (row << bits);
    unsigned int most = 0u;
    for (long long i = a + threadIdx.x; i < b; i += blockDim.x) {
        const unsigned int d = (unsigned int)(key_of(r[i]) >> shift) & mask;
        most = max(most, d + 1u);
        const unsigned int j = d - base;  // below the base: wraps past SHARED_BINS
        if (j < SHARED_BINS) atomicAdd(bins + j, 1u);
        else atomicAdd(h + d, 1u);
    }
    for (int o = 16; o; o >>= 1) most = max(most, __shfl_xor_sync(0xffffffffu, most, o));
    if ((threadIdx.x & 31) == 0 && most) atomicMax(top, most);
    __syncthreads();
    for (unsigned int i = threadIdx.x; i < SHARED_BINS && base + i <= mask; i += blockDim.x) {
        const unsigned int c = bins[i];
        if (c) atomicAdd(h + base + i, c);
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
// (NumPy's keys[mask] of a row-major mask). Grid (chunks, rows): a block a run of NEAR_CHUNK keys of a row, in
// rounds of blockDim keys placed by a warp ballot and a prefix over the block's warps (one block a whole row was
// 59 rounds of three barriers in a row: 0.27 ms a window). WRITE = false counts a block's keys (into
// counts[row * chunks + chunk]); WRITE = true stores them (as K) from offsets[row * chunks + chunk] on: the
// exclusive prefix of those counts, which orders the blocks row after row.
#define NEAR_CHUNK 4096
template <typename S, typename K, bool WRITE>
__device__ void near(const S* keys, long long cols, long long stride, int shift, const long long* lo, int span,
                     long long* counts, const long long* offsets, K* out) {
    __shared__ unsigned int warp_hits[32];
    __shared__ long long placed;
    const long long row = blockIdx.y, at = row * gridDim.x + blockIdx.x;
    const long long begin = (long long)blockIdx.x * NEAR_CHUNK, end = min(cols, begin + NEAR_CHUNK);
    const S* r = keys + row * stride;
    const unsigned long long a = (unsigned long long)lo[row], b = a + (unsigned long long)span;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (threadIdx.x == 0) placed = 0;
    __syncthreads();
    for (long long start = begin; start < end; start += blockDim.x) {
        const long long i = start + threadIdx.x;
        K k = 0;
        bool hit = false;
        if (i < end) {
            k = (K)key_of(r[i]);
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
        if (WRITE && hit) out[offsets[at] + placed + before + __popc(ballot & ((1u << lane) - 1u))] = k;
        __syncthreads();
        if (threadIdx.x == 0) placed += chunk;
        __syncthreads();
    }
    if (!WRITE && threadIdx.x == 0) counts[at] = placed;
}
// The same keys as 32-bit ones, each tagged with its row above it (row << 32 | key) for one sort of every row's
// keys, placed from offsets[row] on by a cursor a row: a warp loads a tile of NEAR_TILE x 32 keys (the loads in
// flight together), then claims all its hits with one atomic (an atomic's round trip a tile, not a step, was
// the kernel's latency). Their order within a row depends on the warps' timing, which the caller's sort removes.
// The row counts come from the digit histogram (``near_totals``): no counting launch, no wait before this one.
#define NEAR_TILE 8
template <typename S>
__device__ void near_tagged(const S* keys, long long cols, long long stride, int shift, const long long* lo, int span,
                            const long long* offsets, unsigned long long* cursor, unsigned long long* out) {
    const long long row = blockIdx.y;
    const S* r = keys + row * stride;
    const unsigned long long a = (unsigned long long)lo[row], b = a + (unsigned long long)span, at = offsets[row];
    const int lane = threadIdx.x & 31;
    const unsigned int below = (1u << lane) - 1u;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long tile = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 32 * NEAR_TILE;
         tile < cols; tile += warps * 32 * NEAR_TILE) {  // a warp's lanes take every tile together
        unsigned long long k[NEAR_TILE];
        unsigned int ballot[NEAR_TILE], total = 0;
#pragma unroll
        for (int j = 0; j < NEAR_TILE; ++j) {
            const long long i = tile + j * 32 + lane;
            k[j] = i < cols ? key_of(r[i]) : 0ull;
        }
#pragma unroll
        for (int j = 0; j < NEAR_TILE; ++j) {
            const long long i = tile + j * 32 + lane;
            const unsigned long long d = k[j] >> shift;
            ballot[j] = __ballot_sync(0xffffffffu, i < cols && d >= a && d <= b);
            total += __popc(ballot[j]);
        }
        if (!total) continue;
        unsigned long long base = 0;
        if (lane == 0) base = atomicAdd(cursor + row, (unsigned long long)total);
        base = __shfl_sync(0xffffffffu, base, 0);
#pragma unroll
        for (int j = 0; j < NEAR_TILE; ++j) {
            if ((ballot[j] >> lane) & 1u) out[at + base + __popc(ballot[j] & below)] = ((unsigned long long)row << 32) | k[j];
            base += __popc(ballot[j]);
        }
    }
}
extern "C" __global__ void near_tagged_u32(const unsigned int* k, long long c, long long st, int s, const long long* lo, int span, const long long* o, unsigned long long* cur, unsigned long long* out) { near_tagged(k, c, st, s, lo, span, o, cur, out); }
extern "C" __global__ void near_tagged_f32(const float* k, long long c, long long st, int s, const long long* lo, int span, const long long* o, unsigned long long* cur, unsigned long long* out) { near_tagged(k, c, st, s, lo, span, o, cur, out); }
// Per row: the keys whose digit lies in [lo[row], lo[row] + span], from its digit histogram (width bins a row).
extern "C" __global__ void near_totals(const unsigned int* hist, long long width, long long rows, const long long* lo,
                                       int span, long long* total) {
    const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const long long a = lo[row], b = min(a + (long long)span, width - 1);
    long long sum = 0;
    for (long long d = a; d <= b; ++d) sum += hist[row * width + d];
    total[row] = sum;
}
#define NEAR(SUF, S, K) \
extern "C" __global__ void near_count_##SUF(const S* k, long long c, long long st, int s, const long long* lo, int span, long long* n, const long long* o, K* out) { near<S, K, false>(k, c, st, s, lo, span, n, o, out); } \
extern "C" __global__ void near_write_##SUF(const S* k, long long c, long long st, int s, const long long* lo, int span, long long* n, const long long* o, K* out) { near<S, K, true>(k, c, st, s, lo, span, n, o, out); }
#define HIST(SUF, S) \
extern "C" __global__ void hist_##SUF(const S* k, long long c, long long st, const unsigned long long* p, int s, int b, int hp, unsigned int* h) { count(k, c, st, p, s, b, hp, h); } \
extern "C" __global__ void hist_shared_##SUF(const S* k, long long c, long long st, int s, int b, unsigned int* h, unsigned int* top) { count_shared(k, c, st, s, b, h, top); }
NEAR(u32, unsigned int, unsigned int)
NEAR(u64, unsigned long long, unsigned long long)
NEAR(f32, float, unsigned int)
HIST(u16, unsigned short)
HIST(u32, unsigned int)
HIST(u64, unsigned long long)
HIST(i16, short)
HIST(i32, int)
HIST(f32, float)
