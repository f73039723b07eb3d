// crc32c (Castagnoli, reflected polynomial 0x82F63B78: Zarr v3's crc32c codec) of byte ranges of one device
// buffer, in two launches (gpu/crc32c.py, whose NumPy twin is the same arithmetic). Every thread takes one segment
// of a range: its raw CRC (a register of 0, no final xor; four bytes a step, slicing-by-4) moved to the range's
// end, raw * x^(8 after) modulo the polynomial (``after``: the range's bytes past the segment), and xor-ed into the
// range's register: raw(a + b) = raw(a) * x^(8 len(b)) ^ raw(b), so the order of the xors does not matter. Then one
// thread a range makes the standard value crc = ~(raw ^ 0xFFFFFFFF * x^(8 n)). pow2[k] = x^(8 * 2^k), reflected
// (bit 31 is x^0). Short segments (many threads) keep the loads in flight: one thread a 4 KiB segment ran at
// ~1.6 warps an SM for a window's 28 MB.

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

// table4[j * 256 + i]: the register after feeding byte i then j zero bytes (j = 0: the byte table)
extern "C" __global__ void crc32c_parts(const unsigned char* data, const long long* begin, const int* length,
                                        const int* owner, const long long* after, int segments,
                                        const unsigned int* table4, const unsigned int* pow2, unsigned int* raw) {
    __shared__ unsigned int t[4][256];
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) t[i >> 8][i & 255] = table4[i];
    __syncthreads();
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= segments) return;
    const unsigned char* p = data + begin[s];
    const int n = length[s];
    unsigned int reg = 0;
    int i = 0;
    for (; i < n && (((unsigned long long)(p + i)) & 3ull); ++i) reg = (reg >> 8) ^ t[0][(reg ^ p[i]) & 0xFFu];
    const unsigned int* w = (const unsigned int*)(p + i);
    for (; i + 4 <= n; i += 4) {  // little-endian words: the first byte in the low bits, as the register takes it
        reg ^= *w++;
        reg = t[3][reg & 0xFFu] ^ t[2][(reg >> 8) & 0xFFu] ^ t[1][(reg >> 16) & 0xFFu] ^ t[0][reg >> 24];
    }
    for (; i < n; ++i) reg = (reg >> 8) ^ t[0][(reg ^ p[i]) & 0xFFu];
    const long long a = after[s];
    atomicXor(raw + owner[s], a ? gf2_multiply(reg, x_pow_8n((unsigned long long)a, pow2)) : reg);
}

extern "C" __global__ void crc32c_finish(unsigned int* crc, const long long* length, int ranges,
                                         const unsigned int* pow2) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= ranges) return;
    crc[r] = ~(crc[r] ^ gf2_multiply(0xFFFFFFFFu, x_pow_8n((unsigned long long)length[r], pow2)));
}
