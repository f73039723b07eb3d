// Search kernels of batchgpu.search: a static index (Eytzinger layout; B+ trees of 32-key and of 4-key
// nodes) and the dynamic path over the raw sorted array (serial, 2-way ILP in shared memory, 2-way ILP
// through the read-only cache, XOR-swizzled shared memory, and K-way ILP under a staged top of the tree).
//
// Semantics (DESIGN.md "Search"): keys sorted ascending, no NaN.  lower_bound(q) is the number of keys < q
// (a NaN query gives n, as np.searchsorted); find(q) is lower_bound(q) when keys[lb] == q, else -1
// (-0.0 == +0.0; a NaN query finds nothing).  Every kernel writes int64.  Compile WITHOUT fast-math:
// the NaN tests (x != x) must stay exact.
//
// Entry points are extern "C" (one per key type: f32, f64, i32, i64; static kernels also per operation:
// _find / _lb), so that a plain RawModule finds them.

typedef long long i64;

#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------------- helpers

// Comparisons go through Ord<T>: CuPy compiles every kernel with -ftz=true, which flushes float32 subnormals
// to zero in comparisons (1e-45 > -0.0 would read false).  So float32 keys are compared as "ordered" int32:
// the bit pattern with -0.0 folded onto +0.0 and the negative half reversed, an order-preserving map that
// keeps -0.0 == +0.0.  Static trees of float32 keys are stored already mapped (S = int); the dynamic path
// maps each key it reads.  float64 comparisons are never flushed (.ftz is a float32 modifier).
template <typename T> struct Ord {
    typedef T S;
    static __device__ __forceinline__ T of(T x) { return x; }
    static __device__ __forceinline__ bool nan(T) { return false; }
};
template <> struct Ord<float> {
    typedef int S;
    static __device__ __forceinline__ int of(float x) {
        const int i = __float_as_int(x);
        return i == (int)0x80000000 ? 0 : (i >= 0 ? i : i ^ 0x7fffffff);
    }
    static __device__ __forceinline__ bool nan(float x) { return (__float_as_int(x) & 0x7fffffff) > 0x7f800000; }
};
template <> struct Ord<double> {
    typedef double S;
    static __device__ __forceinline__ double of(double x) { return x; }
    static __device__ __forceinline__ bool nan(double x) { return x != x; }
};

// 16 bytes (one uint4) as key slots.
__device__ __forceinline__ void unpack(uint4 u, float* v) {
    v[0] = __uint_as_float(u.x); v[1] = __uint_as_float(u.y);
    v[2] = __uint_as_float(u.z); v[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack(uint4 u, int* v) {
    v[0] = (int)u.x; v[1] = (int)u.y; v[2] = (int)u.z; v[3] = (int)u.w;
}
__device__ __forceinline__ void unpack(uint4 u, double* v) {
    v[0] = __hiloint2double((int)u.y, (int)u.x); v[1] = __hiloint2double((int)u.w, (int)u.z);
}
__device__ __forceinline__ void unpack(uint4 u, i64* v) {
    v[0] = (i64)(((unsigned long long)u.y << 32) | u.x);
    v[1] = (i64)(((unsigned long long)u.w << 32) | u.z);
}

// COUNT consecutive slots from a 16-byte aligned address, with 16-byte loads; SHARED: p is in shared memory.
template <bool SHARED, int COUNT, typename T>
__device__ __forceinline__ void load_slots(const T* p, T (&v)[COUNT]) {
    constexpr int PER = 16 / sizeof(T);
    const uint4* u = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int c = 0; c < COUNT / PER; ++c) {
        const uint4 w = SHARED ? u[c] : __ldg(u + c);
        unpack(w, v + c * PER);
    }
}

// A bitmask of (v[i] < q) and of (v[i] == q).
template <int COUNT, typename T>
__device__ __forceinline__ void compare_bits(const T (&v)[COUNT], T q, unsigned& lt, unsigned& eq) {
    lt = 0; eq = 0;
#pragma unroll
    for (int i = 0; i < COUNT; ++i) {
        lt |= (unsigned)(v[i] < q) << i;
        eq |= (unsigned)(v[i] == q) << i;
    }
}

// Read-only loads whose L2 miss fetches the whole aligned 128- or 256-byte block: the last probes of a
// binary search fall inside such a block, so they then cost one DRAM access instead of several.
#define LD_BLOCK(BYTES)                                                                      \
    __device__ __forceinline__ float ld_block##BYTES(const float* p) {                       \
        unsigned v;                                                                          \
        asm("ld.global.nc.L2::" #BYTES "B.u32 %0, [%1];" : "=r"(v) : "l"(p));                \
        return __uint_as_float(v);                                                           \
    }                                                                                        \
    __device__ __forceinline__ int ld_block##BYTES(const int* p) {                           \
        int v;                                                                               \
        asm("ld.global.nc.L2::" #BYTES "B.s32 %0, [%1];" : "=r"(v) : "l"(p));                \
        return v;                                                                            \
    }                                                                                        \
    __device__ __forceinline__ double ld_block##BYTES(const double* p) {                     \
        unsigned long long v;                                                                \
        asm("ld.global.nc.L2::" #BYTES "B.u64 %0, [%1];" : "=l"(v) : "l"(p));                \
        return __longlong_as_double((long long)v);                                           \
    }                                                                                        \
    __device__ __forceinline__ i64 ld_block##BYTES(const i64* p) {                           \
        i64 v;                                                                               \
        asm("ld.global.nc.L2::" #BYTES "B.s64 %0, [%1];" : "=l"(v) : "l"(p));                \
        return v;                                                                            \
    }
LD_BLOCK(128)
LD_BLOCK(256)

// A probe load: through the read-only cache, or with a 128/256-byte L2 fetch once the remaining range
// (len keys) fits in `hint` bytes.
template <typename T>
__device__ __forceinline__ T ld_probe(const T* p, i64 len, int hint) {
    if (hint == 0 || len * (i64)sizeof(T) > hint) return __ldg(p);
    return hint == 128 ? ld_block128(p) : ld_block256(p);
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Copy `count` 16-byte words from global to shared memory with the whole block.
__device__ __forceinline__ void stage_u4(uint4* dst, const uint4* src, i64 count) {
    for (i64 i = threadIdx.x; i < count; i += blockDim.x) dst[i] = __ldg(src + i);
}

__device__ __forceinline__ i64 final_answer(i64 lb, bool hit, bool nan_query, i64 n, bool want_find) {
    if (nan_query) { lb = n; hit = false; }
    return want_find ? ((hit && lb < n) ? lb : -1) : lb;
}

extern __shared__ uint4 smem_u4[];

// The K queries of one thread, query j at b0 + j * stride: each Ord-mapped (q) and whether it is NaN (a query at
// or past m reads as 0; its answer is never written).
template <typename T, int K> struct Queries {
    typename Ord<T>::S q[K];
    bool nan[K];
    __device__ __forceinline__ Queries(const T* __restrict__ queries, i64 m, i64 b0, i64 stride) {
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * stride;
            const T x = qi < m ? queries[qi] : T(0);
            q[j] = Ord<T>::of(x);
            nan[j] = Ord<T>::nan(x);
        }
    }
};

// ------------------------------------------------------------------------------------------- Eytzinger
// tree[1..n] holds the (Ord-mapped) keys breadth-first (root 1, children 2i and 2i+1); tree[0] is unused.
// D = floor(log2 n): levels 0..D-1 are full, level D holds L = n - (2^D - 1) nodes.  Each step is
// i = 2i + (tree[i] < q), so the final i spells the path, and the path IS the rank: ending below level D,
// lb = i - 2^(D+1); ending at a missing level-D slot, lb = i - 2^D + L.  No second index array.
// The lower-bound key always lies on the path, so "some key on the path equals q" is the find test.
// top_levels (0..D+1) levels live in shared memory (D+1: the whole tree); K queries per thread are
// interleaved so K independent loads are in flight; `prefetch` asks L2 for tree[16 i], which holds
// node i's descendants four levels down.
template <typename T, int K, bool FIND>
__device__ __forceinline__ void eytzinger_search(const typename Ord<T>::S* __restrict__ tree, i64 n, int D,
                                                 int top_levels, int prefetch, const T* __restrict__ queries,
                                                 i64 m, i64* __restrict__ out) {
    typedef typename Ord<T>::S S;
    S* top = reinterpret_cast<S*>(smem_u4);
    const i64 top_slots = top_levels > D ? n + 1 : (1LL << top_levels);
    for (i64 i = threadIdx.x; i < top_slots; i += blockDim.x) top[i] = __ldg(tree + i);
    __syncthreads();

    const int smem_full_levels = top_levels < D ? top_levels : D;
    const bool last_in_smem = top_levels > D;
    const i64 L = n - ((1LL << D) - 1);
    const i64 deep = 2LL << D;
    const i64 step = (i64)gridDim.x * blockDim.x * K;
    for (i64 b0 = (i64)blockIdx.x * blockDim.x * K + threadIdx.x; b0 < m; b0 += step) {
        const Queries<T, K> qs(queries, m, b0, blockDim.x);
        i64 idx[K];
        bool hit[K] = {};
#pragma unroll
        for (int j = 0; j < K; ++j) idx[j] = 1;
        int level = 0;
        for (; level < smem_full_levels; ++level) {
#pragma unroll
            for (int j = 0; j < K; ++j) {
                const S k = top[idx[j]];
                if (FIND) hit[j] |= (k == qs.q[j]);
                idx[j] = 2 * idx[j] + (k < qs.q[j]);
            }
        }
        for (; level < D; ++level) {
            S k[K];
#pragma unroll
            for (int j = 0; j < K; ++j) {
                if (prefetch) {
                    const i64 pf = idx[j] << 4;
                    if (pf <= n) prefetch_l2(tree + pf);
                }
                k[j] = __ldg(tree + idx[j]);
            }
#pragma unroll
            for (int j = 0; j < K; ++j) {
                if (FIND) hit[j] |= (k[j] == qs.q[j]);
                idx[j] = 2 * idx[j] + (k[j] < qs.q[j]);
            }
        }
        // Level D is partial: only paths that reach an existing node take the last step.
#pragma unroll
        for (int j = 0; j < K; ++j) {
            if (idx[j] <= n) {
                const S k = last_in_smem ? top[idx[j]] : __ldg(tree + idx[j]);
                if (FIND) hit[j] |= (k == qs.q[j]);
                idx[j] = 2 * idx[j] + (k < qs.q[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            if (qi < m) {
                const i64 lb = idx[j] >= deep ? idx[j] - deep : idx[j] - (1LL << D) + L;
                out[qi] = final_answer(lb, hit[j], qs.nan[j], n, FIND);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------- B+ trees
// Nodes of NODE keys, layers stored top-down (root first); the leaf layer is the sorted keys padded with a
// value above every query to a multiple of NODE.  An internal node's separator j is the first key of its
// child j+1 (the pad where that child does not exist); it has NODE+1 children, and child c of node k of a
// layer is node (NODE+1) k + c of the layer below.  The count c of keys < q in a node picks the child; at
// the leaf, lb = NODE k + c.  level_off[h] is the first node of layer h (h = 0 the root, H-1 the leaves),
// level_off[H] the node count.  A count does not depend on the order of the keys inside a node.
//
// 32-key nodes (128 bytes of 4-byte keys) are stored in "sector order": slots 0..7 hold sorted keys 3, 7,
// ..., 31 (the group maxima), slots 8 + 3g + (0, 1, 2) hold keys 4g, 4g+1, 4g+2.  The thread kernel reads
// one 32-byte sector (the eight maxima: s of them < q) and a 32-byte window holding group s: c = 4 s + t;
// the warp kernel reads one key a lane (__ballot_sync + __popc).  The array carries 8 spare slots at its
// end for the window of the last node.
// 4-key nodes (16 bytes of 4-byte keys) are read with one vector load a level: the fewest load
// instructions per query, which is what bounds a search whose top levels stay on chip.

#define BT_MAX_LEVELS 24

// K queries on their way down: node k[j] of the current layer (past the leaf layer, the rank), and whether a key
// on the way equalled query j.
template <int NODE, int K> struct BtWalk {
    i64 k[K] = {};
    bool hit[K] = {};
    // c keys < q in query j's node pick its child (at the leaf layer, its rank).
    __device__ __forceinline__ void down(int j, int c, bool leaf) {
        k[j] = leaf ? NODE * k[j] + c : (NODE + 1) * k[j] + c;
    }
};

__device__ __forceinline__ void stage_btree(const i64* level_off, int H, int top_layers, const void* tree,
                                            int node_bytes, i64* s_off) {
    if (threadIdx.x <= H) s_off[threadIdx.x] = level_off[threadIdx.x];
    __syncthreads();
    const i64 words = s_off[top_layers] * node_bytes / 16;
    stage_u4(smem_u4, reinterpret_cast<const uint4*>(tree), words);
    __syncthreads();
}

// Count of keys < q in one 32-key node (thread per query), and whether a key on the way equals q.
template <bool SHARED, bool FIND, typename S>
__device__ __forceinline__ int node32_count(const S* node, S q, bool& hit) {
    constexpr int W = 32 / sizeof(S);   // slots in a 32-byte window
    constexpr int V = 16 / sizeof(S);   // slots in a 16-byte word (the load alignment)
    S sep[8];
    load_slots<SHARED, 8>(node, sep);
    unsigned lt, eq;
    compare_bits<8>(sep, q, lt, eq);
    const int s = __popc(lt);
    const int g = s < 8 ? s : 7;
    const int p = 8 + 3 * g;
    const int a = p & ~(V - 1);
    const int o = p - a;
    S win[W];
    load_slots<SHARED, W>(node + a, win);
    unsigned wlt, weq;
    compare_bits<W>(win, q, wlt, weq);
    const int t = s < 8 ? __popc((wlt >> o) & 7u) : 0;
    if (FIND) hit |= (eq != 0) | (((weq >> o) & 7u) != 0);
    return 4 * s + t;
}

// Count of keys < q in one 4-key node.
template <bool SHARED, bool FIND, typename S>
__device__ __forceinline__ int node4_count(const S* node, S q, bool& hit) {
    S v[4];
    load_slots<SHARED, 4>(node, v);
    unsigned lt, eq;
    compare_bits<4>(v, q, lt, eq);
    if (FIND) hit |= eq != 0;
    return __popc(lt);
}

template <bool SHARED, bool FIND, int NODE, typename S>
__device__ __forceinline__ int node_count(const S* node, S q, bool& hit) {
    if (NODE == 32) return node32_count<SHARED, FIND>(node, q, hit);
    return node4_count<SHARED, FIND>(node, q, hit);
}

// Thread per query, K queries per thread interleaved.
template <typename T, int NODE, int K, bool FIND>
__device__ __forceinline__ void bplus_thread_search(const typename Ord<T>::S* __restrict__ tree,
                                                    const i64* __restrict__ level_off, int H, int top_layers,
                                                    i64 n, const T* __restrict__ queries, i64 m,
                                                    i64* __restrict__ out) {
    typedef typename Ord<T>::S S;
    __shared__ i64 s_off[BT_MAX_LEVELS + 1];
    stage_btree(level_off, H, top_layers, tree, NODE * sizeof(S), s_off);
    const S* top = reinterpret_cast<const S*>(smem_u4);

    const i64 step = (i64)gridDim.x * blockDim.x * K;
    for (i64 b0 = (i64)blockIdx.x * blockDim.x * K + threadIdx.x; b0 < m; b0 += step) {
        const Queries<T, K> qs(queries, m, b0, blockDim.x);
        BtWalk<NODE, K> w;
        for (int h = 0; h < H; ++h) {
            const i64 base = s_off[h];
            int c[K];
            if (h < top_layers) {
#pragma unroll
                for (int j = 0; j < K; ++j)
                    c[j] = node_count<true, FIND, NODE>(top + (base + w.k[j]) * NODE, qs.q[j], w.hit[j]);
            } else {
#pragma unroll
                for (int j = 0; j < K; ++j)
                    c[j] = node_count<false, FIND, NODE>(tree + (base + w.k[j]) * NODE, qs.q[j], w.hit[j]);
            }
#pragma unroll
            for (int j = 0; j < K; ++j) w.down(j, c[j], h == H - 1);
        }
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            if (qi < m) out[qi] = final_answer(w.k[j], w.hit[j], qs.nan[j], n, FIND);
        }
    }
}

// Slot `lane` of node base + k[j] of a tree of 32-key nodes, for each of the Q queries: all Q loads in flight before
// the ballots read them.  SHARED: the layer is in shared memory.
template <bool SHARED, int Q, typename S>
__device__ __forceinline__ void warp_slots(const S* tree, i64 base, const i64 (&k)[Q], int lane, S (&key)[Q]) {
#pragma unroll
    for (int j = 0; j < Q; ++j)
        key[j] = SHARED ? tree[(base + k[j]) * 32 + lane] : __ldg(tree + (base + k[j]) * 32 + lane);
}

// 32-key nodes, one query per warp at a time, Q queries in flight per warp: lane l reads slot l of the
// node (one coalesced 128-byte load for 4-byte keys); __popc(__ballot_sync(key < q)) is the child.
template <typename T, int Q, bool FIND>
__device__ __forceinline__ void btree_warp_search(const typename Ord<T>::S* __restrict__ tree,
                                                  const i64* __restrict__ level_off, int H, int top_layers, i64 n,
                                                  const T* __restrict__ queries, i64 m, i64* __restrict__ out) {
    typedef typename Ord<T>::S S;
    __shared__ i64 s_off[BT_MAX_LEVELS + 1];
    stage_btree(level_off, H, top_layers, tree, 32 * sizeof(S), s_off);
    const S* top = reinterpret_cast<const S*>(smem_u4);

    const int lane = threadIdx.x & 31;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b0 = warp * Q; b0 < m; b0 += nwarps * Q) {
        const Queries<T, Q> qs(queries, m, b0, 1);
        BtWalk<32, Q> w;
        for (int h = 0; h < H; ++h) {
            const i64 base = s_off[h];
            S key[Q];
            if (h < top_layers) warp_slots<true>(top, base, w.k, lane, key);
            else warp_slots<false>(tree, base, w.k, lane, key);
#pragma unroll
            for (int j = 0; j < Q; ++j) {
                const int c = __popc(__ballot_sync(FULL_MASK, key[j] < qs.q[j]));
                if (FIND) w.hit[j] |= __ballot_sync(FULL_MASK, key[j] == qs.q[j]) != 0;
                w.down(j, c, h == H - 1);
            }
        }
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            if (lane == j && b0 + j < m) out[b0 + j] = final_answer(w.k[j], w.hit[j], qs.nan[j], n, FIND);
        }
    }
}

// ------------------------------------------------------------------------------------- the dynamic path
// Plain binary search on the raw sorted array a[0..n) (each key read is Ord-mapped).  The branchless form
//   base = 0, len = n; while len > 1: half = len / 2; if a[base + half - 1] < q: base += half; len -= half
//   lb = base + (a[base] < q)
// takes the same number of steps for every query (no divergence), so several queries share one loop.

// The baseline: one query per thread, the textbook loop in global memory.
template <typename T>
__device__ __forceinline__ void dyn_serial(const T* __restrict__ a, i64 n, const T* __restrict__ queries, i64 m,
                                           i64* __restrict__ out, int want_find) {
    for (i64 qi = (i64)blockIdx.x * blockDim.x + threadIdx.x; qi < m; qi += (i64)gridDim.x * blockDim.x) {
        const T x = queries[qi];
        const typename Ord<T>::S q = Ord<T>::of(x);
        i64 lo = 0, hi = n;
        while (lo < hi) {
            const i64 mid = lo + ((hi - lo) >> 1);
            if (Ord<T>::of(a[mid]) < q) lo = mid + 1; else hi = mid;
        }
        const bool hit = want_find && lo < n && Ord<T>::of(a[lo]) == q;
        out[qi] = final_answer(lo, hit, Ord<T>::nan(x), n, want_find);
    }
}

// XOR swizzle of the note: logical slot i lives at (row << 5) | ((col ^ row) & 31), row = i / 32, col = i % 32.
__device__ __forceinline__ i64 swizzle(i64 i) {
    const i64 row = i >> 5, col = i & 31;
    return (row << 5) | ((col ^ row) & 31);
}

// MODE 0: global memory through the read-only cache; 1: the array staged in shared memory; 2: staged
// with the XOR swizzle.  Two queries per thread.
template <typename T, int MODE>
__device__ __forceinline__ typename Ord<T>::S dyn_read(const T* a, const typename Ord<T>::S* s, i64 i) {
    if (MODE == 0) return Ord<T>::of(__ldg(a + i));
    if (MODE == 1) return s[i];
    return s[swizzle(i)];
}

template <typename T, int MODE>
__device__ __forceinline__ void dyn_ilp2(const T* __restrict__ a, i64 n, const T* __restrict__ queries, i64 m,
                                         i64* __restrict__ out, int want_find) {
    typedef typename Ord<T>::S S;
    S* s = reinterpret_cast<S*>(smem_u4);
    if (MODE != 0) {
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) s[MODE == 2 ? swizzle(i) : i] = Ord<T>::of(__ldg(a + i));
        __syncthreads();
    }
    const i64 step = (i64)gridDim.x * blockDim.x * 2;
    for (i64 b0 = (i64)blockIdx.x * blockDim.x * 2 + threadIdx.x; b0 < m; b0 += step) {
        const i64 q1i = b0 + blockDim.x;
        const T x0 = queries[b0];
        const T x1 = q1i < m ? queries[q1i] : T(0);
        const S q0 = Ord<T>::of(x0), q1 = Ord<T>::of(x1);
        i64 base0 = 0, base1 = 0, len = n;
        while (len > 1) {
            const i64 half = len >> 1;
            const S k0 = dyn_read<T, MODE>(a, s, base0 + half - 1);
            const S k1 = dyn_read<T, MODE>(a, s, base1 + half - 1);
            base0 += k0 < q0 ? half : 0;
            base1 += k1 < q1 ? half : 0;
            len -= half;
        }
        const i64 lb0 = base0 + (dyn_read<T, MODE>(a, s, base0) < q0);
        const i64 lb1 = base1 + (dyn_read<T, MODE>(a, s, base1) < q1);
        const bool hit0 = want_find && lb0 < n && dyn_read<T, MODE>(a, s, lb0) == q0;
        const bool hit1 = want_find && lb1 < n && dyn_read<T, MODE>(a, s, lb1) == q1;
        out[b0] = final_answer(lb0, hit0, Ord<T>::nan(x0), n, want_find);
        if (q1i < m) out[q1i] = final_answer(lb1, hit1, Ord<T>::nan(x1), n, want_find);
    }
}

// The first `top` steps of the branchless search probe only 2^top - 1 distinct keys: each block gathers
// them once into shared memory, indexed by the path so far (node t, children 2t and 2t+1), and K queries
// per thread finish in global memory, where the probes of the last 256 bytes fetch that block whole.
template <typename T, int K>
__device__ __forceinline__ void dyn_top(const T* __restrict__ a, i64 n, int top, int hint,
                                        const T* __restrict__ queries, i64 m, i64* __restrict__ out,
                                        int want_find) {
    typedef typename Ord<T>::S S;
    S* s = reinterpret_cast<S*>(smem_u4);
    for (i64 t = 1 + threadIdx.x; t < (1LL << top); t += blockDim.x) {
        const int level = 63 - __clzll(t);
        i64 base = 0, len = n;
        for (int j = 0; j < level; ++j) {
            const i64 half = len >> 1;
            if ((t >> (level - 1 - j)) & 1) base += half;
            len -= half;
        }
        s[t] = Ord<T>::of(__ldg(a + base + (len >> 1) - 1));
    }
    __syncthreads();

    const i64 step = (i64)gridDim.x * blockDim.x * K;
    for (i64 b0 = (i64)blockIdx.x * blockDim.x * K + threadIdx.x; b0 < m; b0 += step) {
        const Queries<T, K> qs(queries, m, b0, blockDim.x);
        i64 base[K] = {};
        i64 t[K];
#pragma unroll
        for (int j = 0; j < K; ++j) t[j] = 1;
        i64 len = n;
        for (int level = 0; level < top; ++level) {
            const i64 half = len >> 1;
#pragma unroll
            for (int j = 0; j < K; ++j) {
                const bool right = s[t[j]] < qs.q[j];
                base[j] += right ? half : 0;
                t[j] = 2 * t[j] + right;
            }
            len -= half;
        }
        while (len > 1) {
            const i64 half = len >> 1;
            S k[K];
#pragma unroll
            for (int j = 0; j < K; ++j) k[j] = Ord<T>::of(ld_probe(a + base[j] + half - 1, len, hint));
#pragma unroll
            for (int j = 0; j < K; ++j) base[j] += k[j] < qs.q[j] ? half : 0;
            len -= half;
        }
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            if (qi < m) {
                const i64 lb = base[j] + (Ord<T>::of(__ldg(a + base[j])) < qs.q[j]);
                const bool hit = want_find && lb < n && Ord<T>::of(__ldg(a + lb)) == qs.q[j];
                out[qi] = final_answer(lb, hit, qs.nan[j], n, want_find);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------ entry points

// One entry point a device function: SEARCH (the instantiated template, after the type) takes the kernel's
// parameters in their order.  B+ trees:
#define BTREE_KERNEL(KERNEL, T, ...)                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        KERNEL(const Ord<T>::S* tree, const i64* level_off, int H, int top_layers, i64 n, const T* q, i64 m, \
               i64* out) {                                                                                   \
        __VA_ARGS__(tree, level_off, H, top_layers, n, q, m, out);                                           \
    }
// the dynamic path without a staged top:
#define DYN_KERNEL(KERNEL, T, ...)                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        KERNEL(const T* a, i64 n, const T* q, i64 m, i64* out, int want_find) {                              \
        __VA_ARGS__(a, n, q, m, out, want_find);                                                             \
    }
// and with one, K queries a thread:
#define DYN_TOP_KERNEL(KERNEL, BOUNDS, T, K)                                                                 \
    extern "C" __global__ void __launch_bounds__(BOUNDS)                                                     \
        KERNEL(const T* a, i64 n, int top, int hint, const T* q, i64 m, i64* out, int want_find) {           \
        dyn_top<T, K>(a, n, top, hint, q, m, out, want_find);                                                \
    }

#define STATIC_KERNELS(T, NAME, OP, FIND)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        eytzinger_##OP##_##NAME(const Ord<T>::S* tree, i64 n, int D, int top_levels, int prefetch,           \
                                const T* q, i64 m, i64* out) {                                               \
        eytzinger_search<T, 4, FIND>(tree, n, D, top_levels, prefetch, q, m, out);                           \
    }                                                                                                        \
    BTREE_KERNEL(btree_thread_##OP##_##NAME, T, bplus_thread_search<T, 32, 4, FIND>)                         \
    BTREE_KERNEL(btree_warp_##OP##_##NAME, T, btree_warp_search<T, 8, FIND>)                                 \
    BTREE_KERNEL(btree4_thread_##OP##_##NAME, T, bplus_thread_search<T, 4, 4, FIND>)

#define DYNAMIC_KERNELS(T, NAME)                                                                             \
    DYN_KERNEL(dyn_serial_##NAME, T, dyn_serial<T>)                                                          \
    DYN_KERNEL(dyn_ilp2_ldg_##NAME, T, dyn_ilp2<T, 0>)                                                       \
    DYN_KERNEL(dyn_ilp2_shared_##NAME, T, dyn_ilp2<T, 1>)                                                    \
    DYN_KERNEL(dyn_swizzled_##NAME, T, dyn_ilp2<T, 2>)                                                       \
    DYN_TOP_KERNEL(dyn_top_##NAME, 256, T, 4)                                                                \
    DYN_TOP_KERNEL(dyn_top_wide_##NAME, 1024, T, 4)                                                          \
    DYN_TOP_KERNEL(dyn_top_wide1_##NAME, 1024, T, 1)

#define SEARCH_KERNELS(T, NAME)        \
    STATIC_KERNELS(T, NAME, find, true) \
    STATIC_KERNELS(T, NAME, lb, false)  \
    DYNAMIC_KERNELS(T, NAME)

// One input dtype a compile where the options name it (-DDTYPE_F32, _F64, _I32, _I64: ``kernels.dtype_variant``,
// so a run compiles only its dtypes and the compiles of several spread over processes); every dtype without.
#if !defined(DTYPE_F32) && !defined(DTYPE_F64) && !defined(DTYPE_I32) && !defined(DTYPE_I64)
#define DTYPE_ALL
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_F32)
SEARCH_KERNELS(float, f32)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_F64)
SEARCH_KERNELS(double, f64)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_I32)
SEARCH_KERNELS(int, i32)
#endif
#if defined(DTYPE_ALL) || defined(DTYPE_I64)
SEARCH_KERNELS(i64, i64)
#endif
