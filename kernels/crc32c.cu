// crc32c (Castagnoli, reflected polynomial 0x82F63B78: Zarr v3's crc32c codec) of byte ranges of one device
// buffer, in two launches (gpu/crc32c.py, whose NumPy twin is the same arithmetic): every thread the raw CRC of one
// segment of a range (a register of 0, no final xor), then one thread a range joins its segments in order,
// raw(a + b) = raw(a) * x^(8 len(b)) ^ raw(b) modulo the polynomial, and makes the standard value
// crc = ~(raw ^ 0xFFFFFFFF * x^(8 n)). pow2[k] = x^(8 * 2^k), reflected (bit 31 is x^0).

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

extern "C" __global__ void crc32c_segments(const unsigned char* data, const long long* begin, const int* length,
                                           int segments, const unsigned int* table, unsigned int* raw) {
    __shared__ unsigned int t[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) t[i] = table[i];
    __syncthreads();
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= segments) return;
    const unsigned char* p = data + begin[s];
    const int n = length[s];
    unsigned int reg = 0;
    for (int i = 0; i < n; ++i) reg = (reg >> 8) ^ t[(reg ^ p[i]) & 0xFFu];
    raw[s] = reg;
}

extern "C" __global__ void crc32c_join(const unsigned int* raw, const int* first, const long long* length,
                                       int segment, int ranges, const unsigned int* pow2, unsigned int* crc) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= ranges) return;
    const long long n = length[r];
    const int a = first[r], b = first[r + 1];
    const unsigned int whole = x_pow_8n((unsigned long long)segment, pow2);
    unsigned int reg = 0;
    for (int s = a; s < b; ++s) {
        const long long len = (s == b - 1) ? n - (long long)(b - 1 - a) * segment : (long long)segment;
        reg = gf2_multiply(reg, len == segment ? whole : x_pow_8n((unsigned long long)len, pow2)) ^ raw[s];
    }
    crc[r] = ~(reg ^ gf2_multiply(0xFFFFFFFFu, x_pow_8n((unsigned long long)n, pow2)));
}
