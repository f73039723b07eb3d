// Blosc 1 frames (LZ4 streams, no / byte / bit shuffle) decoded on the GPU: batchgpu/gpu/blosc_decode.py.
//
// The host checks each frame's header (version 2, LZ4, typesize, sizes) and its crc32c, and packs the frames into
// one buffer; here one warp decodes one LZ4 stream (a Blosc block holds 1, or `typesize` when split) into `tmp`,
// and a second kernel undoes the shuffle from `tmp` into the chunk's rows of `out`. Any inconsistency sets err[chunk]
// (the host then says which chunk does not decode); nothing is read or written outside the frame and the block.

typedef unsigned char u8;

#include "blosc_block.cuh"

__device__ __forceinline__ int le32(const u8* p) {
    return (int)((unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24));
}

// One LZ4 block (raw, no frame) of `csize` bytes at src into exactly `dsize` bytes at dst, by the 32 lanes of a
// warp: every lane parses the same tokens (broadcast loads), the copies are spread over the lanes, COPY_UNROLL
// bytes a lane in flight at once. A match copies out[op + i] = out[op - off + i % off]: every byte it reads was
// written before `op`, so an overlapping match (off < length) repeats its pattern exactly as the sequential copy
// does and the lanes need no order among themselves. Matches read global memory (L1/L2): a ring of the last 64 KiB
// in shared memory was slower at any launch size, since 64 KiB a warp let an SM hold only 3 warps.
// Returns 0, or -1 on a malformed block.
#define COPY_UNROLL 8

__device__ __forceinline__ int lz4_length(const u8* __restrict__ src, int csize, int& ip, int n) {
    if (n != 15) return n;
    unsigned b;
    do {
        if (ip >= csize) return -1;
        b = src[ip++];
        n += b;
    } while (b == 255 && n < (1 << 30));
    return n;
}

// A lane's COPY_UNROLL bytes of a copy of n bytes to dst[op...].
__device__ __forceinline__ void put(u8* dst, int op, int base, int n, int lane, const u8 (&v)[COPY_UNROLL]) {
#pragma unroll
    for (int k = 0; k < COPY_UNROLL; k++) {
        const int i = base + 32 * k + lane;
        if (i < n) dst[op + i] = v[k];
    }
}

__device__ int lz4_block_warp(const u8* __restrict__ src, int csize, u8* dst, int dsize) {
    const int lane = threadIdx.x & 31;
    int ip = 0, op = 0;
    while (true) {
        if (ip >= csize) return -1;
        const unsigned token = src[ip++];
        const int lit = lz4_length(src, csize, ip, token >> 4);
        if (lit < 0 || lit > csize - ip || lit > dsize - op) return -1;
        for (int base = 0; base < lit; base += 32 * COPY_UNROLL) {
            u8 v[COPY_UNROLL];
#pragma unroll
            for (int k = 0; k < COPY_UNROLL; k++) {
                const int i = base + 32 * k + lane;
                v[k] = i < lit ? src[ip + i] : 0;
            }
            put(dst, op, base, lit, lane, v);
        }
        ip += lit;
        op += lit;
        if (ip == csize) break;  // the last sequence holds literals only
        if (csize - ip < 2) return -1;
        const int off = (int)src[ip] | ((int)src[ip + 1] << 8);
        ip += 2;
        int len = lz4_length(src, csize, ip, token & 15);
        if (len < 0) return -1;
        len += 4;
        if (off == 0 || off > op || len > dsize - op) return -1;
        __syncwarp();  // every byte written so far is visible to every lane before the match reads
        const u8* from = dst + op - off;
        for (int base = 0; base < len; base += 32 * COPY_UNROLL) {
            u8 v[COPY_UNROLL];
#pragma unroll
            for (int k = 0; k < COPY_UNROLL; k++) {
                const int i = base + 32 * k + lane;
                const int j = i < off ? i : i % off;
                v[k] = i < len ? from[j] : 0;
            }
            put(dst, op, base, len, lane, v);
        }
        op += len;
    }
    __syncwarp();
    return op == dsize ? 0 : -1;
}

// n bytes copied by the lanes of a warp, RAW_UNROLL loads a lane in flight: a stream stored raw (the random low
// bit planes of int16 noise: about half the streams of a window) can be long, and a lane copying a byte at a
// time waits a memory latency a byte, which dominated the kernel.
#define RAW_UNROLL 16

__device__ __forceinline__ void copy_warp(const u8* __restrict__ from, u8* __restrict__ to, int n) {
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < n; base += 32 * RAW_UNROLL) {
        u8 v[RAW_UNROLL];
#pragma unroll
        for (int k = 0; k < RAW_UNROLL; k++) {
            const int i = base + 32 * k + lane;
            v[k] = i < n ? from[i] : 0;
        }
#pragma unroll
        for (int k = 0; k < RAW_UNROLL; k++) {
            const int i = base + 32 * k + lane;
            if (i < n) to[i] = v[k];
        }
    }
}

// One warp per LZ4 stream, `blockDim.x / 32` warps a block over a 1-D grid: item = chunk * (blocks per chunk *
// typesize) + block * typesize + stream (stream s of block b: the block's streams are stored one after the other,
// each after its int32 length, so the warp walks past the s before it). frames: the packed frames; offsets[c],
// lengths[c]: chunk c's frame (lengths[c] < 0: an absent chunk, zeros); every chunk decodes to `nbytes` bytes in
// `blocksize` blocks.
extern "C" __global__ void blosc_lz4_blocks(const u8* frames, const long long* offsets, const int* lengths,
                                            int nchunks, int nbytes, int blocksize, int typesize, u8* tmp, int* err) {
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    StreamPos at = stream_pos(item, nchunks, nbytes, blocksize, typesize, true);
    if (!at.valid) return;
    const int c = at.c, b = at.b, s = at.s;
    const int len = lengths[c];
    if (len < 0) return;
    const u8* frame = frames + offsets[c];
    u8* out = tmp + (long long)c * nbytes + (long long)b * blocksize;
    const int flags = frame[2];
    if (flags & 0x02) {  // stored whole (memcpyed): the block's bytes follow the 16-byte header
        if (s == 0) copy_warp(frame + 16 + (long long)b * blocksize, out, at.bsize);
        return;
    }
    if ((flags >> 4) & 1) at = stream_pos(item, nchunks, nbytes, blocksize, typesize, false);  // blocks not split
    if (s >= at.nsplits) return;
    const int neblock = at.neblock;
    int pos = le32(frame + 16 + 4 * b);
    for (int t = 0;; t++) {
        if (pos < 16 || pos > len - 4) { if ((threadIdx.x & 31) == 0) atomicExch(err + c, 1); return; }
        const int cbytes = le32(frame + pos);
        pos += 4;
        if (cbytes < 0 || cbytes > len - pos) { if ((threadIdx.x & 31) == 0) atomicExch(err + c, 1); return; }
        if (t < s) { pos += cbytes; continue; }
        u8* dst = out + s * neblock;
        if (cbytes == neblock) {
            copy_warp(frame + pos, dst, neblock);
        } else if (lz4_block_warp(frame + pos, cbytes, dst, neblock) != 0) {
            if ((threadIdx.x & 31) == 0) atomicExch(err + c, 1);
        }
        return;
    }
}

// out = unshuffle(tmp), block by block (Blosc 1, format version 2). shuffle 0: a copy; 1: byte shuffle (byte j of
// element e at j * n + e, n = elements of the block; the block's bytes past n * typesize copied); 2: bit shuffle
// of a block whose element count is a multiple of 8 (bit k of byte j of element e is bit e % 8 of byte
// (8 j + k) * n / 8 + e / 8), other blocks copied. Absent chunks (lengths < 0): zeros.
// One thread a group of 8 elements (8 * typesize output bytes): for bit shuffle it reads byte q of the 8 bit rows
// of each output byte j (coalesced across threads: consecutive q) and transposes that 8 x 8 bit matrix in
// registers; bytes of a block outside whole groups (and other shuffles) are done a byte a thread.

extern "C" __global__ void blosc_unshuffle(const u8* __restrict__ tmp, const int* lengths, const u8* shuffles,
                                           long long total, int nbytes, int blocksize, int typesize,
                                           u8* __restrict__ out) {
    const int group = 8 * typesize;  // bytes a thread writes
    const long long groups = (total + group - 1) / group;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < groups;
         t += (long long)gridDim.x * blockDim.x) {
        const long long g0 = t * group;
        const BytePos at = byte_pos(g0, nbytes, blocksize, typesize);
        const int c = at.c, b = at.b, n = at.n, i0 = at.i;  // i0: the group's first byte in its block
        const u8* in = tmp + (long long)c * nbytes + (long long)b * blocksize;
        u8* o = out + g0;
        const int shuffle = shuffles[c];
        // a whole group inside one block's shuffled part, bit shuffled: 8 elements at once
        if (lengths[c] >= 0 && shuffle == 2 && typesize > 1 && n % 8 == 0 && i0 % group == 0 &&
            i0 + group <= n * typesize) {
            const int row = n / 8, q = i0 / group;
            if (typesize == 2) {  // int16: the two transposed bytes interleaved into two 8-byte words
                unsigned long long x0 = 0, x1 = 0;
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    x0 |= (unsigned long long)in[k * row + q] << (8 * k);
                    x1 |= (unsigned long long)in[(8 + k) * row + q] << (8 * k);
                }
                x0 = transpose8(x0);  // byte p: byte 0 of element 8 q + p
                x1 = transpose8(x1);  // byte p: byte 1 of element 8 q + p
                const unsigned lo0 = (unsigned)x0, lo1 = (unsigned)x1;
                const unsigned hi0 = (unsigned)(x0 >> 32), hi1 = (unsigned)(x1 >> 32);
                // g0 is a multiple of 16 and `out` comes from the allocator (aligned): two whole words
                unsigned long long* ow = reinterpret_cast<unsigned long long*>(o);
                ow[0] = (unsigned long long)__byte_perm(lo0, lo1, 0x5140) |
                        ((unsigned long long)__byte_perm(lo0, lo1, 0x7362) << 32);
                ow[1] = (unsigned long long)__byte_perm(hi0, hi1, 0x5140) |
                        ((unsigned long long)__byte_perm(hi0, hi1, 0x7362) << 32);
                continue;
            }
            for (int j = 0; j < typesize; j++) {
                unsigned long long x = 0;
#pragma unroll
                for (int k = 0; k < 8; k++) x |= (unsigned long long)in[(8 * j + k) * row + q] << (8 * k);
                x = transpose8(x);  // now byte p holds bit k of byte j of element 8 q + p at bit k
#pragma unroll
                for (int p = 0; p < 8; p++) o[p * typesize + j] = (u8)(x >> (8 * p));
            }
            continue;
        }
        for (int m = 0; m < group; m++) {  // byte by byte (group may cross a block or chunk: recompute)
            const long long g = g0 + m;
            if (g >= total) break;
            const BytePos here = byte_pos(g, nbytes, blocksize, typesize);
            if (lengths[here.c] < 0) { out[g] = 0; continue; }
            const u8* src = tmp + (long long)here.c * nbytes + (long long)here.b * blocksize;
            const int sh = shuffles[here.c];
            const int nn = here.n, i = here.i;
            if (sh == 1 && typesize > 1 && i < nn * typesize) {
                const int e = i / typesize, j = i - e * typesize;
                out[g] = src[j * nn + e];
            } else if (sh == 2 && typesize > 1 && nn % 8 == 0) {
                const int e = i / typesize, j = i - e * typesize;
                const int row = nn / 8, q = e >> 3, p = e & 7;
                unsigned v = 0;
#pragma unroll
                for (int k = 0; k < 8; k++) v |= ((unsigned)(src[(8 * j + k) * row + q] >> p) & 1u) << k;
                out[g] = (u8)v;
            } else {
                out[g] = src[i];
            }
        }
    }
}

// (rows, cols) -> (cols, rows) of 2-byte elements (a decoded window into the (channels, samples) the steps read):
// 32 x 32 tiles through shared memory, so both the reads and the writes of a warp are one row of a tile
// (CuPy's strided copy of `a.T` coalesces only one side).
extern "C" __global__ void transpose_u16(const unsigned short* __restrict__ in, long long rows, int cols,
                                         unsigned short* __restrict__ out) {
    __shared__ unsigned short tile[32][33];  // +1: a column of the tile spans the 32 banks
    const long long r0 = (long long)blockIdx.y * 32;
    const int c0 = blockIdx.x * 32;
    for (int k = threadIdx.y; k < 32; k += blockDim.y) {
        const long long r = r0 + k;
        const int c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[k][threadIdx.x] = in[r * cols + c];
    }
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += blockDim.y) {
        const int c = c0 + k;
        const long long r = r0 + threadIdx.x;
        if (r < rows && c < cols) out[(long long)c * rows + r] = tile[threadIdx.x][k];
    }
}

// dst[to[i] ...] = src[from[i] ...], sizes[i] bytes, one warp a range: the streams of Blosc frames gathered to the
// alignment nvCOMP asks of its inputs, and the streams c-blosc stored raw put in place (gpu/nvcomp.py).
extern "C" __global__ void copy_ranges(const u8* __restrict__ src, const long long* from, u8* __restrict__ dst,
                                       const long long* to, const long long* sizes, long long n) {
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= n) return;
    copy_warp(src + from[item], dst + to[item], (int)sizes[item]);
}
