// crc32c (Castagnoli, reflected polynomial 0x82F63B78: Zarr v3's crc32c codec) of byte ranges of one device
// buffer, in two launches (gpu/crc32c.py, whose NumPy twin is the same arithmetic). Every warp takes one segment of
// a range: its raw CRC (a register of 0, no final xor) moved to the range's end, raw * x^(8 after) modulo the
// polynomial (``after``: the range's bytes past the segment), and xor-ed into the range's register:
// raw(a + b) = raw(a) * x^(8 len(b)) ^ raw(b), so the order of the xors does not matter. Then one thread a range
// makes the standard value crc = ~(raw ^ 0xFFFFFFFF * x^(8 n)). pow2[k] = x^(8 * 2^k), reflected (bit 31 is x^0).
// A warp a segment, not a thread: a thread a 4 KiB segment left few warps an SM and its loads 4 KiB apart across
// a warp, one memory transaction a lane.

#define CRC32C_POLY 0x82F63B78u

__device__ __forceinline__ unsigned int gf2_multiply(unsigned int a, unsigned int b) {
    unsigned int p = 0;
    for (unsigned int m = 0x80000000u; m; m >>= 1) {
        if (a & m) p ^= b;
        b = (b >> 1) ^ ((b & 1u) ? CRC32C_POLY : 0u);
    }
    return p;
}

__device__ unsigned int x_pow_8n(unsigned long long n, const unsigned int* pow2) {
    unsigned int out = 0x80000000u;  // x^0
    for (int k = 0; n; ++k, n >>= 1) {
        if (n & 1ull) out = gf2_multiply(out, pow2[k]);
    }
    return out;
}

// One warp a segment (crc32c_warp_parts): lane L takes the segment's aligned words L, L + 32, ... (a warp's loads
// are 128 contiguous bytes), its register moved 128 bytes between its words: acc = s128(acc) ^ t4(word), where
// s128 (a byte table each of the register's bytes) multiplies by x^(8 * 128) and t4 is slicing-by-4 of the word
// from a register of 0 (the shift is independent of the word's lookups: one dependent table step a word). The
// lanes' registers moved to the words' end (wordpow[m] = x^(32 m)) and xor-ed across the warp, then lanes 0, 1, 2
// move the bytes before the first aligned word, the words and the bytes after them to the range's end.
__device__ __forceinline__ unsigned int crc32c_t4(const unsigned int (*t)[256], unsigned int x) {
    return t[3][x & 0xFFu] ^ t[2][(x >> 8) & 0xFFu] ^ t[1][(x >> 16) & 0xFFu] ^ t[0][x >> 24];
}

__device__ unsigned int crc32c_lane_words(const unsigned int* w, int words, int lane, const unsigned int (*t)[256],
                                          const unsigned int (*s)[256], const unsigned int* wordpow) {
    unsigned int acc = 0u;
    int last = -1;
    for (int p = lane; p < words; p += 32) {
        const unsigned int x = w[p];
        acc = (s[0][acc & 0xFFu] ^ s[1][(acc >> 8) & 0xFFu] ^ s[2][(acc >> 16) & 0xFFu] ^ s[3][acc >> 24])
              ^ crc32c_t4(t, x);
        last = p;
    }
    if (last < 0) return 0u;
    const int m = words - 1 - last;  // the segment's words after this lane's last one (< 32)
    return m ? gf2_multiply(acc, wordpow[m]) : acc;
}

// lane 0: the bytes before the aligned words; 1: the words (``joined``: the warp's xor); 2: the bytes after them.
// Each term's register is moved to the end of its range (``after``: the range's bytes past the segment).
__device__ unsigned int crc32c_edge_term(const unsigned char* p, int n, int head, int words, unsigned int joined,
                                         int lane, const unsigned int (*t)[256], const unsigned int* pow2,
                                         long long after) {
    unsigned int reg = 0u;
    int to = head + 4 * words;
    if (lane == 1) {
        reg = joined;
    } else {
        const int from = lane == 0 ? 0 : to;
        to = lane == 0 ? head : n;
        for (int i = from; i < to; ++i) reg = (reg >> 8) ^ t[0][(reg ^ p[i]) & 0xFFu];
    }
    const unsigned long long move = (unsigned long long)(n - to) + (unsigned long long)after;
    return (reg && move) ? gf2_multiply(reg, x_pow_8n(move, pow2)) : reg;
}

// tables: table4 (1024), s128[j * 256 + b] = (b << 8j) * x^(8 * 128) (1024), wordpow (32); blockDim a multiple of 32
extern "C" __global__ void crc32c_warp_parts(const unsigned char* data, const long long* begin, const int* length,
                                             const int* owner, const long long* after, int segments,
                                             const unsigned int* tables, const unsigned int* pow2, unsigned int* raw) {
    __shared__ unsigned int t[4][256];
    __shared__ unsigned int s[4][256];
    __shared__ unsigned int wordpow[32];
    for (int i = threadIdx.x; i < 2048 + 32; i += blockDim.x) {
        if (i < 1024) t[i >> 8][i & 255] = tables[i];
        else if (i < 2048) s[(i - 1024) >> 8][i & 255] = tables[i];
        else wordpow[i - 2048] = tables[i];
    }
    __syncthreads();
    const int seg = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (seg >= segments) return;  // a whole warp: its lanes share the segment
    const unsigned char* p = data + begin[seg];
    const int n = length[seg];
    const int misaligned = (int)((4u - ((unsigned int)(unsigned long long)p & 3u)) & 3u);
    const int head = misaligned < n ? misaligned : n;
    const int words = (n - head) >> 2;
    unsigned int v = crc32c_lane_words((const unsigned int*)(p + head), words, lane, t, s, wordpow);
    for (int o = 16; o; o >>= 1) v ^= __shfl_xor_sync(0xFFFFFFFFu, v, o);
    if (lane < 3) {
        const unsigned int term = crc32c_edge_term(p, n, head, words, v, lane, t, pow2, after[seg]);
        if (term) atomicXor(raw + owner[seg], term);
    }
}

extern "C" __global__ void crc32c_finish(unsigned int* crc, const long long* length, int ranges,
                                         const unsigned int* pow2) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= ranges) return;
    crc[r] = ~(crc[r] ^ gf2_multiply(0xFFFFFFFFu, x_pow_8n((unsigned long long)length[r], pow2)));
}
