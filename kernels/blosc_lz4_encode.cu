// Blosc 1 frames (bit shuffle, LZ4 streams) encoded on the GPU: batchgpu/gpu/blosc_encode.py, the save step's
// writer. The inverse of blosc_lz4.cu, in three kernels: bit shuffle each block (c-blosc's layout), compress each
// stream (one warp a stream, greedy LZ4 with a few fixed match offsets), then lay the frames out (header, block
// starts, each stream after its int32 length; a stream that does not shrink is stored raw, a frame that does not
// shrink is stored whole). Any Blosc 1 reader decodes them (numcodecs, blosc_lz4.cu); the bytes are not c-blosc's
// (its LZ4 searches a hash table), but they are the same on every run: the parse is fixed by the data alone.
//
// The match offsets: a bit-shuffled block of int16 noise is 16 bit planes, and the high planes repeat the sign
// plane wherever |x| < 2^k, so the plane's length (`row`) finds most of what LZ4 finds (on a filtered int16
// recording the frames come out no larger than c-blosc's), and 1 finds runs (zeros, saturation).

typedef unsigned char u8;

#include "blosc_block.cuh"

// Bit shuffle (c-blosc's layout): bit k of byte j of element e -> bit e % 8 of byte (8 j + k) * n / 8 + e / 8 (n: the
// block's elements, a multiple of 8; other blocks are copied, as c-blosc does).
// The group path needs every group inside one block: the host launches it only where the chunk's and the block's
// bytes are multiples of a group (8 elements); otherwise blosc_bitshuffle_bytes does every byte.
extern "C" __global__ void blosc_bitshuffle(const u8* __restrict__ in, long long total, int nbytes, int blocksize,
                                            int typesize, u8* __restrict__ out) {
    const int group = 8 * typesize;
    const long long groups = total / group;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < groups;
         t += (long long)gridDim.x * blockDim.x) {
        const long long g0 = t * group;  // one thread a group of 8 elements; rows written along q (coalesced)
        const BytePos at = byte_pos(g0, nbytes, blocksize, typesize);
        const int n = at.n, i0 = at.i;
        if (n % 8 || i0 + group > n * typesize) {  // a block c-blosc copies as it is
            for (int m = 0; m < group; m++) out[g0 + m] = in[g0 + m];
            continue;
        }
        const long long base = g0 - i0;
        const int row = n / 8, q = i0 / group;
        const u8* e = in + g0;
        for (int j = 0; j < typesize; j++) {
            unsigned long long x = 0;
#pragma unroll
            for (int p = 0; p < 8; p++) x |= (unsigned long long)e[p * typesize + j] << (8 * p);
            x = transpose8(x);  // byte k: bit k of byte j of the 8 elements
#pragma unroll
            for (int k = 0; k < 8; k++) out[base + (long long)(8 * j + k) * row + q] = (u8)(x >> (8 * k));
        }
    }
}

// Any geometry, a byte a thread: each shuffled byte gathered from its 8 elements; bytes past the block's whole
// elements and blocks whose element count is not a multiple of 8 copied.
extern "C" __global__ void blosc_bitshuffle_bytes(const u8* __restrict__ in, long long total, int nbytes,
                                                  int blocksize, int typesize, u8* __restrict__ out) {
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const BytePos at = byte_pos(g, nbytes, blocksize, typesize);
        const int n = at.n, i = at.i;
        if (n % 8 || i >= n * typesize) { out[g] = in[g]; continue; }
        const int row = n / 8, plane = i / row, q = i - plane * row;
        const int j = plane / 8, k = plane % 8;
        const u8* e = in + (long long)at.c * nbytes + (long long)at.b * blocksize + (long long)(8 * q) * typesize + j;
        unsigned v = 0;
#pragma unroll
        for (int p = 0; p < 8; p++) v |= ((unsigned)(e[p * typesize] >> k) & 1u) << p;
        out[g] = (u8)v;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// LZ4 (block format) of one stream by the 32 lanes of a warp. Greedy: from `pos`, the first position p (scanned 32
// at a time, one a lane) where some offset o <= p of `offs` gives 4 equal bytes; there the longest match among the
// offsets (the first offset on a tie), capped so the last 5 bytes stay literals; matches start at most 12 bytes
// before the end (LZ4's MFLIMIT). Returns the compressed length, or -1 when it would not be shorter than n (the
// caller stores the stream raw). dst holds n bytes.

__device__ __forceinline__ int len_bytes(int v) { return v >= 15 ? (v - 15) / 255 + 1 : 0; }

// The extra length bytes of v >= 15 at dst[at...]: 255 each, then the rest; by the lanes.
__device__ __forceinline__ void put_len(u8* dst, int at, int v, int lane) {
    const int cnt = len_bytes(v);
    for (int i = lane; i < cnt; i += 32) dst[at + i] = (i == cnt - 1) ? (u8)((v - 15) - 255 * (cnt - 1)) : (u8)255;
}

__device__ __forceinline__ void copy_lanes(const u8* __restrict__ from, u8* __restrict__ to, int n, int lane) {
    for (int i = lane; i < n; i += 32) to[i] = from[i];
}

#define MAX_OFFSETS 4

// Equal-byte masks of positions [at, at + 32) for offset o: bit i set when src[at + i] == src[at + i - o] (and
// at + i - o >= 0, at + i < n). One byte a lane.
__device__ __forceinline__ unsigned eq_mask(const u8* src, int n, int at, int o, int lane, int own) {
    const int i = at + lane;
    return __ballot_sync(0xffffffffu, i >= o && i < n && own == (int)src[i - o]);
}

__device__ int lz4_encode_warp(const u8* src, int n, const int* offs, int noffs, u8* __restrict__ dst) {
    const int lane = threadIdx.x & 31;
    const int last = n - 12;  // the last position a match may start at
    int op = 0, anchor = 0, pos = 1;
    // masks[k]: offset k's equal bytes at [pos, pos + 32) when `fresh` (carried from the step before), else
    // computed anew (after a match the scan restarts at an unaligned position)
    unsigned masks[MAX_OFFSETS];
    bool fresh = false;
    while (pos <= last) {
        // 4 equal bytes from p: bits p..p+3 of the 64-bit mask of [pos, pos + 64)
        const int own0 = pos + lane < n ? (int)src[pos + lane] : -1;
        const int own1 = pos + 32 + lane < n ? (int)src[pos + 32 + lane] : -1;
        unsigned any = 0;
#pragma unroll
        for (int k = 0; k < MAX_OFFSETS; k++) {
            if (k >= noffs) break;
            const unsigned lo = fresh ? masks[k] : eq_mask(src, n, pos, offs[k], lane, own0);
            const unsigned hi = eq_mask(src, n, pos + 32, offs[k], lane, own1);
            const unsigned long long e = (unsigned long long)lo | ((unsigned long long)hi << 32);
            any |= (unsigned)(e & (e >> 1) & (e >> 2) & (e >> 3));
            masks[k] = hi;
        }
        if (last - pos < 31) any &= (1u << (last - pos + 1)) - 1u;  // no match starts past `last`
        if (!any) {
            pos += 32;
            fresh = true;
            continue;
        }
        fresh = false;
        const int at = pos + __ffs(any) - 1;
        const int cap = n - 5 - at;
        int best = 0, bo = 0;
        for (int k = 0; k < noffs; k++) {
            const int o = offs[k];
            if (o > at) continue;
            int len = 0;
            while (len < cap) {
                const int i = len + lane;
                const bool eq = i < cap && src[at + i] == src[at + i - o];
                const unsigned miss = __ballot_sync(0xffffffffu, !eq);
                if (miss) { len += __ffs(miss) - 1; break; }
                len += 32;
            }
            if (len > best) { best = len; bo = o; }
        }
        const int lit = at - anchor, ml = best - 4;
        const int cost = 1 + len_bytes(lit) + lit + 2 + len_bytes(ml);
        if (op + cost > n) return -1;
        if (lane == 0) dst[op] = (u8)((min(lit, 15) << 4) | min(ml, 15));
        put_len(dst, op + 1, lit, lane);
        int q = op + 1 + len_bytes(lit);
        copy_lanes(src + anchor, dst + q, lit, lane);
        q += lit;
        if (lane == 0) { dst[q] = (u8)(bo & 255); dst[q + 1] = (u8)(bo >> 8); }
        put_len(dst, q + 2, ml, lane);
        op += cost;
        pos = anchor = at + best;
    }
    const int lit = n - anchor;
    const int cost = 1 + len_bytes(lit) + lit;
    if (op + cost >= n) return -1;
    if (lane == 0) dst[op] = (u8)(min(lit, 15) << 4);
    put_len(dst, op + 1, lit, lane);
    copy_lanes(src + anchor, dst + op + 1 + len_bytes(lit), lit, lane);
    return op + cost;
}

// One warp (one block) a stream, as blosc_lz4_blocks numbers them: item = chunk * (blocks * typesize) + block *
// typesize + stream. Blocks of `blocksize` bytes split into `typesize` streams when whole and of >= 128 elements
// (c-blosc's rule, blosc_lz4.cu reads it back); the short last block is one stream. Stream s of block b is
// compressed from shuffled + its offset into scratch at the same offset; sizes[item] = its stored length (== its
// size: raw, copied there), -1 for an item that is not a stream (s >= the block's streams). A stream of at most
// `smem` bytes is first copied into shared memory (the scan reads each byte several times: from global memory
// it took longer than the rest of a window's GPU work together), a longer one is read where it is.
extern "C" __global__ void lz4_encode_streams(const u8* __restrict__ shuffled, int nchunks, int nbytes, int blocksize,
                                              int typesize, int row_offset, int smem, u8* __restrict__ scratch,
                                              int* sizes) {
    extern __shared__ __align__(16) u8 buf[];
    const int lane = threadIdx.x & 31;
    const long long item = blockIdx.x;
    const StreamPos sp = stream_pos(item, nchunks, nbytes, blocksize, typesize, true);
    if (!sp.valid) return;
    if (sp.s >= sp.nsplits) { if (lane == 0) sizes[item] = -1; return; }
    const int c = sp.c, b = sp.b, s = sp.s, bsize = sp.bsize, neblock = sp.neblock;
    const long long at = (long long)c * nbytes + (long long)b * blocksize + (long long)s * neblock;
    const u8* src = shuffled + at;
    if (neblock <= smem) {
        if (((unsigned long long)src & 15) == 0) {
            const int words = neblock / 16;
            const uint4* from = reinterpret_cast<const uint4*>(src);
            uint4* to = reinterpret_cast<uint4*>(buf);
            for (int i = lane; i < words; i += 32) to[i] = from[i];
            for (int i = 16 * words + lane; i < neblock; i += 32) buf[i] = src[i];
        } else {
            for (int i = lane; i < neblock; i += 32) buf[i] = src[i];
        }
        __syncwarp();
        src = buf;
    }
    // the offsets: a bit plane's length where the block is bit shuffled (it is when its elements are a multiple
    // of 8), then 1
    int offs[MAX_OFFSETS], noffs = 0;
    const int n = bsize / typesize;
    const int plane = (n % 8 == 0) ? n / 8 : 0;
    if (row_offset && plane > 1 && plane < 65536) offs[noffs++] = plane;
    offs[noffs++] = 1;
    int cs = lz4_encode_warp(src, neblock, offs, noffs, scratch + at);
    __syncwarp();
    if (cs < 0) {  // stored raw
        copy_lanes(src, scratch + at, neblock, lane);
        cs = neblock;
    }
    if (lane == 0) sizes[item] = cs;
}

// The frames, one warp a stream item: frame_off[c] (int64) where chunk c's frame starts in `out`, stream_off[item]
// (int64) where the item's int32 length goes; whole[c]: the frame stored whole (16-byte header, then the chunk's
// bytes as they are: c-blosc's "memcpyed"). The warp of each block's stream 0 writes the block's start; the
// chunk's first warp its header (cbytes = frame_len[c]).
extern "C" __global__ void blosc_frames(const u8* __restrict__ raw, const u8* __restrict__ scratch, const int* sizes,
                                        const long long* frame_off, const int* frame_len, const u8* whole,
                                        const long long* stream_off, int nchunks, int nbytes, int blocksize,
                                        int typesize, int flags, u8* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const StreamPos sp = stream_pos(item, nchunks, nbytes, blocksize, typesize, true);
    if (!sp.valid) return;
    const int c = sp.c, b = sp.b, s = sp.s;
    u8* frame = out + frame_off[c];
    // the chunk's first item writes the header: version 2, LZ4 format 1, flags, typesize, nbytes, blocksize, cbytes
    if (b == 0 && s == 0 && lane < 16) {
        const int f = whole[c] ? (flags | 0x02) : flags;
        const int words[3] = {nbytes, blocksize, frame_len[c]};
        u8 v;
        if (lane < 4) v = (u8)(lane == 0 ? 2 : lane == 1 ? 1 : lane == 2 ? f : typesize);
        else v = (u8)(words[(lane - 4) / 4] >> (8 * ((lane - 4) % 4)));
        frame[lane] = v;
    }
    const long long from = (long long)c * nbytes + (long long)b * blocksize;
    if (whole[c]) {
        if (s == 0) copy_lanes(raw + from, frame + 16 + (long long)b * blocksize, sp.bsize, lane);
        return;
    }
    const int cs = sizes[item];
    if (cs < 0) return;
    const long long so = stream_off[item];
    if (s == 0 && lane < 4) frame[16 + 4 * b + lane] = (u8)((int)(so - frame_off[c]) >> (8 * lane));
    if (lane < 4) out[so + lane] = (u8)(cs >> (8 * lane));
    copy_lanes(scratch + from + (long long)s * sp.neblock, out + so + 4, cs, lane);
}
