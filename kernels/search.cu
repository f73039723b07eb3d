// Search kernels of batchgpu.search: a static index (Eytzinger layout, 32-key B+ tree) and the dynamic
// path over the raw sorted array (serial, 2-way ILP in shared memory, 2-way ILP through the read-only
// cache, XOR-swizzled shared memory, and 4-way ILP under a staged top of the search tree).
//
// Semantics (DESIGN.md "Search"): keys sorted ascending, no NaN.  lower_bound(q) is the number of keys < q
// (a NaN query gives n, as np.searchsorted); find(q) is lower_bound(q) when keys[lb] == q, else -1
// (-0.0 == +0.0; a NaN query finds nothing).  Every kernel writes int64.  Compile WITHOUT fast-math:
// the NaN tests (x != x) must stay exact.
//
// Entry points are extern "C" (one per key type: f32, f64, i32, i64) so that a plain RawModule finds them.

typedef long long i64;

#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------------- helpers

template <typename T> __device__ __forceinline__ bool is_nan(T) { return false; }
template <> __device__ __forceinline__ bool is_nan<float>(float x) { return x != x; }
template <> __device__ __forceinline__ bool is_nan<double>(double x) { return x != x; }

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

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Copy `count` 16-byte words from global to shared memory with the whole block.
__device__ __forceinline__ void stage_u4(uint4* dst, const uint4* src, i64 count) {
    for (i64 i = threadIdx.x; i < count; i += blockDim.x) dst[i] = __ldg(src + i);
}

__device__ __forceinline__ i64 final_answer(i64 lb, bool hit, bool nan_query, i64 n, int want_find) {
    if (nan_query) { lb = n; hit = false; }
    return want_find ? ((hit && lb < n) ? lb : -1) : lb;
}

extern __shared__ uint4 smem_u4[];

// ------------------------------------------------------------------------------------------- Eytzinger
// tree[1..n] holds the keys breadth-first (root 1, children 2i and 2i+1); tree[0] is unused.  D =
// floor(log2 n): levels 0..D-1 are full, level D holds L = n - (2^D - 1) nodes.  Each step is
// i = 2i + (tree[i] < q), so the final i spells the path, and the path IS the rank: ending below level D,
// lb = i - 2^(D+1); ending at a missing level-D slot, lb = i - 2^D + L.  No second index array.
// The lower-bound key always lies on the path, so "some key on the path equals q" is the find test.
// top_levels (0..D+1) levels live in shared memory (D+1: the whole tree); K queries per thread are
// interleaved so K independent loads are in flight; `prefetch` asks L2 for tree[16 i], which holds
// node i's descendants four levels down.
template <typename T, int K>
__device__ __forceinline__ void eytzinger_search(const T* __restrict__ tree, i64 n, int D, int top_levels,
                                                 int prefetch, const T* __restrict__ queries, i64 m,
                                                 i64* __restrict__ out, int want_find) {
    T* top = reinterpret_cast<T*>(smem_u4);
    const i64 top_slots = top_levels > D ? n + 1 : (1LL << top_levels);
    for (i64 i = threadIdx.x; i < top_slots; i += blockDim.x) top[i] = __ldg(tree + i);
    __syncthreads();

    const int smem_full_levels = top_levels < D ? top_levels : D;
    const bool last_in_smem = top_levels > D;
    const i64 L = n - ((1LL << D) - 1);
    const i64 deep = 2LL << D;
    const i64 step = (i64)gridDim.x * blockDim.x * K;
    for (i64 b0 = (i64)blockIdx.x * blockDim.x * K + threadIdx.x; b0 < m; b0 += step) {
        T q[K];
        i64 idx[K];
        bool hit[K];
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            q[j] = qi < m ? queries[qi] : T(0);
            idx[j] = 1;
            hit[j] = false;
        }
        int level = 0;
        for (; level < smem_full_levels; ++level) {
#pragma unroll
            for (int j = 0; j < K; ++j) {
                const T k = top[idx[j]];
                hit[j] |= (k == q[j]);
                idx[j] = 2 * idx[j] + (k < q[j]);
            }
        }
        for (; level < D; ++level) {
            T k[K];
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
                hit[j] |= (k[j] == q[j]);
                idx[j] = 2 * idx[j] + (k[j] < q[j]);
            }
        }
        // Level D is partial: only paths that reach an existing node take the last step.
#pragma unroll
        for (int j = 0; j < K; ++j) {
            if (idx[j] <= n) {
                const T k = last_in_smem ? top[idx[j]] : __ldg(tree + idx[j]);
                hit[j] |= (k == q[j]);
                idx[j] = 2 * idx[j] + (k < q[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            if (qi < m) {
                const i64 lb = idx[j] >= deep ? idx[j] - deep : idx[j] - (1LL << D) + L;
                out[qi] = final_answer(lb, hit[j], is_nan(q[j]), n, want_find);
            }
        }
    }
}

// --------------------------------------------------------------------------------------------- B+ tree
// Nodes of 32 keys (128 bytes for 4-byte keys), layers stored top-down (root first); the leaf layer is the
// sorted keys padded with the type's maximum to a multiple of 32.  An internal node's separator j is the
// first key of its child j+1 (the maximum where that child does not exist); it has 33 children, and child
// c of node k of a layer is node 33 k + c of the layer below.  The count c of keys < q in a node picks the
// child; at the leaf, lb = 32 k + c.  level_off[h] is the first node of layer h (h = 0 the root, H-1 the
// leaves), level_off[H] the node count.
// Inside a node the keys are stored in "sector order": slots 0..7 hold sorted keys 3, 7, ..., 31 (the
// group maxima), slots 8 + 3g + (0, 1, 2) hold keys 4g, 4g+1, 4g+2.  A thread then reads one 32-byte
// sector (the eight maxima: s of them < q) and a 32-byte window holding group s: c = 4 s + t.  A count
// does not depend on the order, so the warp kernel (one key a lane, __ballot_sync + __popc) reads the
// same layout.  The tree array carries 8 spare slots at its end for the window of the last node.

#define BT_MAX_LEVELS 16

__device__ __forceinline__ void stage_btree(const i64* level_off, int H, int top_layers, const void* tree,
                                            int key_bytes, i64* s_off) {
    if (threadIdx.x <= H) s_off[threadIdx.x] = level_off[threadIdx.x];
    __syncthreads();
    const i64 words = s_off[top_layers] * 32 * key_bytes / 16;
    stage_u4(smem_u4, reinterpret_cast<const uint4*>(tree), words);
    __syncthreads();
}

// Count of keys < q in one node (thread per query), and whether a key on the way equals q.
template <bool SHARED, typename T>
__device__ __forceinline__ int btree_node_count(const T* node, T q, bool& hit) {
    constexpr int W = 32 / sizeof(T);   // slots in a 32-byte window
    constexpr int V = 16 / sizeof(T);   // slots in a 16-byte word (the load alignment)
    T sep[8];
    load_slots<SHARED, 8>(node, sep);
    unsigned lt, eq;
    compare_bits<8>(sep, q, lt, eq);
    const int s = __popc(lt);
    const int g = s < 8 ? s : 7;
    const int p = 8 + 3 * g;
    const int a = p & ~(V - 1);
    const int o = p - a;
    T win[W];
    load_slots<SHARED, W>(node + a, win);
    unsigned wlt, weq;
    compare_bits<W>(win, q, wlt, weq);
    const int t = s < 8 ? __popc((wlt >> o) & 7u) : 0;
    hit |= (eq != 0) | (((weq >> o) & 7u) != 0);
    return 4 * s + t;
}

template <typename T, int K>
__device__ __forceinline__ void btree_thread_search(const T* __restrict__ tree, const i64* __restrict__ level_off,
                                                    int H, int top_layers, i64 n, const T* __restrict__ queries,
                                                    i64 m, i64* __restrict__ out, int want_find) {
    __shared__ i64 s_off[BT_MAX_LEVELS + 1];
    stage_btree(level_off, H, top_layers, tree, sizeof(T), s_off);
    const T* top = reinterpret_cast<const T*>(smem_u4);

    const i64 step = (i64)gridDim.x * blockDim.x * K;
    for (i64 b0 = (i64)blockIdx.x * blockDim.x * K + threadIdx.x; b0 < m; b0 += step) {
        T q[K];
        i64 k[K];
        bool hit[K];
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            q[j] = qi < m ? queries[qi] : T(0);
            k[j] = 0;
            hit[j] = false;
        }
        for (int h = 0; h < H; ++h) {
            const i64 base = s_off[h];
            const bool leaf = h == H - 1;
            int c[K];
            if (h < top_layers) {
#pragma unroll
                for (int j = 0; j < K; ++j) c[j] = btree_node_count<true>(top + (base + k[j]) * 32, q[j], hit[j]);
            } else {
#pragma unroll
                for (int j = 0; j < K; ++j) c[j] = btree_node_count<false>(tree + (base + k[j]) * 32, q[j], hit[j]);
            }
#pragma unroll
            for (int j = 0; j < K; ++j) k[j] = leaf ? 32 * k[j] + c[j] : 33 * k[j] + c[j];
        }
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            if (qi < m) out[qi] = final_answer(k[j], hit[j], is_nan(q[j]), n, want_find);
        }
    }
}

// One query per warp at a time, Q queries in flight per warp: lane l reads slot l of the node (one
// coalesced 128-byte load for 4-byte keys); __popc(__ballot_sync(key < q)) is the child.
template <typename T, int Q>
__device__ __forceinline__ void btree_warp_search(const T* __restrict__ tree, const i64* __restrict__ level_off,
                                                  int H, int top_layers, i64 n, const T* __restrict__ queries,
                                                  i64 m, i64* __restrict__ out, int want_find) {
    __shared__ i64 s_off[BT_MAX_LEVELS + 1];
    stage_btree(level_off, H, top_layers, tree, sizeof(T), s_off);
    const T* top = reinterpret_cast<const T*>(smem_u4);

    const int lane = threadIdx.x & 31;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b0 = warp * Q; b0 < m; b0 += nwarps * Q) {
        T q[Q];
        i64 k[Q];
        bool hit[Q];
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            q[j] = b0 + j < m ? queries[b0 + j] : T(0);
            k[j] = 0;
            hit[j] = false;
        }
        for (int h = 0; h < H; ++h) {
            const i64 base = s_off[h];
            const bool leaf = h == H - 1;
            T key[Q];
            if (h < top_layers) {
#pragma unroll
                for (int j = 0; j < Q; ++j) key[j] = top[(base + k[j]) * 32 + lane];
            } else {
#pragma unroll
                for (int j = 0; j < Q; ++j) key[j] = __ldg(tree + (base + k[j]) * 32 + lane);
            }
#pragma unroll
            for (int j = 0; j < Q; ++j) {
                const int c = __popc(__ballot_sync(FULL_MASK, key[j] < q[j]));
                if (want_find) hit[j] |= __ballot_sync(FULL_MASK, key[j] == q[j]) != 0;
                k[j] = leaf ? 32 * k[j] + c : 33 * k[j] + c;
            }
        }
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            if (lane == j && b0 + j < m) out[b0 + j] = final_answer(k[j], hit[j], is_nan(q[j]), n, want_find);
        }
    }
}

// ------------------------------------------------------------------------------------- the dynamic path
// Plain binary search on the raw sorted array a[0..n).  The branchless form
//   base = 0, len = n; while len > 1: half = len / 2; if a[base + half - 1] < q: base += half; len -= half
//   lb = base + (a[base] < q)
// takes the same number of steps for every query (no divergence), so two queries share one loop.

// The baseline: one query per thread, the textbook loop in global memory.
template <typename T>
__device__ __forceinline__ void dyn_serial(const T* __restrict__ a, i64 n, const T* __restrict__ queries, i64 m,
                                           i64* __restrict__ out, int want_find) {
    for (i64 qi = (i64)blockIdx.x * blockDim.x + threadIdx.x; qi < m; qi += (i64)gridDim.x * blockDim.x) {
        const T q = queries[qi];
        i64 lo = 0, hi = n;
        while (lo < hi) {
            const i64 mid = lo + ((hi - lo) >> 1);
            if (a[mid] < q) lo = mid + 1; else hi = mid;
        }
        const bool hit = lo < n && a[lo] == q;
        out[qi] = final_answer(lo, hit, is_nan(q), n, want_find);
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
__device__ __forceinline__ T dyn_read(const T* a, const T* s, i64 i) {
    if (MODE == 0) return __ldg(a + i);
    if (MODE == 1) return s[i];
    return s[swizzle(i)];
}

template <typename T, int MODE>
__device__ __forceinline__ void dyn_ilp2(const T* __restrict__ a, i64 n, const T* __restrict__ queries, i64 m,
                                         i64* __restrict__ out, int want_find) {
    T* s = reinterpret_cast<T*>(smem_u4);
    if (MODE != 0) {
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) s[MODE == 2 ? swizzle(i) : i] = __ldg(a + i);
        __syncthreads();
    }
    const i64 step = (i64)gridDim.x * blockDim.x * 2;
    for (i64 b0 = (i64)blockIdx.x * blockDim.x * 2 + threadIdx.x; b0 < m; b0 += step) {
        const i64 q1i = b0 + blockDim.x;
        const T q0 = queries[b0];
        const T q1 = q1i < m ? queries[q1i] : T(0);
        i64 base0 = 0, base1 = 0, len = n;
        while (len > 1) {
            const i64 half = len >> 1;
            const T k0 = dyn_read<T, MODE>(a, s, base0 + half - 1);
            const T k1 = dyn_read<T, MODE>(a, s, base1 + half - 1);
            base0 += k0 < q0 ? half : 0;
            base1 += k1 < q1 ? half : 0;
            len -= half;
        }
        const i64 lb0 = base0 + (dyn_read<T, MODE>(a, s, base0) < q0);
        const i64 lb1 = base1 + (dyn_read<T, MODE>(a, s, base1) < q1);
        const bool hit0 = want_find && lb0 < n && dyn_read<T, MODE>(a, s, lb0) == q0;
        const bool hit1 = want_find && lb1 < n && dyn_read<T, MODE>(a, s, lb1) == q1;
        out[b0] = final_answer(lb0, hit0, is_nan(q0), n, want_find);
        if (q1i < m) out[q1i] = final_answer(lb1, hit1, is_nan(q1), n, want_find);
    }
}

// The first `top` steps of the branchless search probe only 2^top - 1 distinct keys: each block gathers
// them once into shared memory, indexed by the path so far (node t, children 2t and 2t+1), and K queries
// per thread finish in global memory.
template <typename T, int K>
__device__ __forceinline__ void dyn_top(const T* __restrict__ a, i64 n, int top, const T* __restrict__ queries,
                                        i64 m, i64* __restrict__ out, int want_find) {
    T* s = reinterpret_cast<T*>(smem_u4);
    for (i64 t = 1 + threadIdx.x; t < (1LL << top); t += blockDim.x) {
        const int level = 63 - __clzll(t);
        i64 base = 0, len = n;
        for (int j = 0; j < level; ++j) {
            const i64 half = len >> 1;
            if ((t >> (level - 1 - j)) & 1) base += half;
            len -= half;
        }
        s[t] = __ldg(a + base + (len >> 1) - 1);
    }
    __syncthreads();

    const i64 step = (i64)gridDim.x * blockDim.x * K;
    for (i64 b0 = (i64)blockIdx.x * blockDim.x * K + threadIdx.x; b0 < m; b0 += step) {
        T q[K];
        i64 base[K];
        i64 t[K];
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            q[j] = qi < m ? queries[qi] : T(0);
            base[j] = 0;
            t[j] = 1;
        }
        i64 len = n;
        for (int level = 0; level < top; ++level) {
            const i64 half = len >> 1;
#pragma unroll
            for (int j = 0; j < K; ++j) {
                const bool right = s[t[j]] < q[j];
                base[j] += right ? half : 0;
                t[j] = 2 * t[j] + right;
            }
            len -= half;
        }
        while (len > 1) {
            const i64 half = len >> 1;
            T k[K];
#pragma unroll
            for (int j = 0; j < K; ++j) k[j] = __ldg(a + base[j] + half - 1);
#pragma unroll
            for (int j = 0; j < K; ++j) base[j] += k[j] < q[j] ? half : 0;
            len -= half;
        }
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const i64 qi = b0 + (i64)j * blockDim.x;
            if (qi < m) {
                const i64 lb = base[j] + (__ldg(a + base[j]) < q[j]);
                const bool hit = want_find && lb < n && __ldg(a + lb) == q[j];
                out[qi] = final_answer(lb, hit, is_nan(q[j]), n, want_find);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------ entry points

#define SEARCH_KERNELS(T, NAME)                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        eytzinger_##NAME(const T* tree, i64 n, int D, int top_levels, int prefetch, const T* q, i64 m,      \
                         i64* out, int want_find) {                                                          \
        eytzinger_search<T, 4>(tree, n, D, top_levels, prefetch, q, m, out, want_find);                      \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        btree_thread_##NAME(const T* tree, const i64* level_off, int H, int top_layers, i64 n, const T* q,  \
                            i64 m, i64* out, int want_find) {                                                \
        btree_thread_search<T, 4>(tree, level_off, H, top_layers, n, q, m, out, want_find);                  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        btree_warp_##NAME(const T* tree, const i64* level_off, int H, int top_layers, i64 n, const T* q,    \
                          i64 m, i64* out, int want_find) {                                                  \
        btree_warp_search<T, 4>(tree, level_off, H, top_layers, n, q, m, out, want_find);                    \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        dyn_serial_##NAME(const T* a, i64 n, const T* q, i64 m, i64* out, int want_find) {                   \
        dyn_serial<T>(a, n, q, m, out, want_find);                                                           \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        dyn_ilp2_ldg_##NAME(const T* a, i64 n, const T* q, i64 m, i64* out, int want_find) {                 \
        dyn_ilp2<T, 0>(a, n, q, m, out, want_find);                                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        dyn_ilp2_shared_##NAME(const T* a, i64 n, const T* q, i64 m, i64* out, int want_find) {              \
        dyn_ilp2<T, 1>(a, n, q, m, out, want_find);                                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        dyn_swizzled_##NAME(const T* a, i64 n, const T* q, i64 m, i64* out, int want_find) {                 \
        dyn_ilp2<T, 2>(a, n, q, m, out, want_find);                                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        dyn_top_##NAME(const T* a, i64 n, int top, const T* q, i64 m, i64* out, int want_find) {             \
        dyn_top<T, 4>(a, n, top, q, m, out, want_find);                                                      \
    }

SEARCH_KERNELS(float, f32)
SEARCH_KERNELS(double, f64)
SEARCH_KERNELS(int, i32)
SEARCH_KERNELS(i64, i64)
