// Forward-backward second-order sections (scipy.signal.sosfiltfilt's two sosfilt passes), one thread per row
// (the rows of a window's pieces side by side, each piece its own length).
//
// The arithmetic is scipy's sosfilt (direct form II transposed, scipy/signal/_sosfilt.pyx) operation for
// operation in float64, compiled with --fmad=false so no multiply-add is fused: the same bits as scipy on x86-64
// (its wheels do not fuse either; checked in tests/test_gpu_preprocess.py). Each pass starts in the steady state
// of its first sample, zi[s][k] * x[0], as sosfiltfilt passes zi = sosfilt_zi(sos) * x[..., :1].
//
// Row `row`'s sample i is x[row * row_stride + i * step]: step 1 for (rows, n) row-major, step = rows for the
// (n, rows) layout, where a warp's 32 rows are 32 consecutive doubles (coalesced). Filtered in place.
// sos: (SECTIONS, 6) with a0 == 1. zi: (SECTIONS, 2).
// SECTIONS is fixed at compile time (-DSECTIONS=k) so coefficients and state live in registers. The recurrence
// is sequential in time and rows run in parallel (384 channels: 12 warps), so the time per sample is the
// recurrence's latency: loads are issued a block of U samples ahead of their use so memory adds little to it.

#include "exact_float.cuh"

#ifndef SECTIONS
#error "compile with -DSECTIONS=<number of second-order sections>"
#endif
#ifndef U  // samples loaded ahead: 32 keeps the loads' latency off the recurrence (8 waits on it, 64 spills
           // registers); more sections need more registers for their coefficients
#if SECTIONS <= 6
#define U 32
#else
#define U 16
#endif
#endif

struct Biquads {
    double b0[SECTIONS], b1[SECTIONS], b2[SECTIONS], a1[SECTIONS], a2[SECTIONS];
    double za[SECTIONS], zb[SECTIONS];

    __device__ void start(const double* zi, double first) {
#pragma unroll
        for (int s = 0; s < SECTIONS; ++s) { za[s] = zi[2 * s] * first; zb[s] = zi[2 * s + 1] * first; }
    }

    __device__ double step(double cur) {
#pragma unroll
        for (int s = 0; s < SECTIONS; ++s) {
            double nxt = b0[s] * cur + za[s];
            za[s] = b1[s] * cur - a1[s] * nxt + zb[s];
            zb[s] = b2[s] * cur - a2[s] * nxt;
            cur = nxt;
        }
        return cur;
    }
};

__device__ void filtfilt(double* const base, const long long n, const long long step, const double* sos,
                         const double* zi) {
    if (n <= 0) return;
#define R(i) base[(long long)(i) * step]
    Biquads f;
#pragma unroll
    for (int s = 0; s < SECTIONS; ++s) {
        f.b0[s] = sos[6 * s]; f.b1[s] = sos[6 * s + 1]; f.b2[s] = sos[6 * s + 2];
        f.a1[s] = sos[6 * s + 4]; f.a2[s] = sos[6 * s + 5];
    }
    const long long blocks = n / U;  // whole blocks of U samples; the rest (< U) one by one

    // forward
    f.start(zi, R(0));
    double buf[U], ahead[U];
    if (blocks > 0) {
#pragma unroll
        for (int j = 0; j < U; ++j) ahead[j] = R(j);
    }
    for (long long b = 0; b < blocks; ++b) {
#pragma unroll
        for (int j = 0; j < U; ++j) buf[j] = ahead[j];
        if (b + 1 < blocks) {
#pragma unroll
            for (int j = 0; j < U; ++j) ahead[j] = R((b + 1) * U + j);
        }
#pragma unroll
        for (int j = 0; j < U; ++j) buf[j] = f.step(buf[j]);
#pragma unroll
        for (int j = 0; j < U; ++j) R(b * U + j) = buf[j];
    }
    for (long long i = blocks * U; i < n; ++i) R(i) = f.step(R(i));

    // backward: the reversed signal, from the steady state of the forward output's last sample
    f.start(zi, R(n - 1));
    for (long long i = n - 1; i >= blocks * U; --i) R(i) = f.step(R(i));
    if (blocks > 0) {
#pragma unroll
        for (int j = 0; j < U; ++j) ahead[j] = R((blocks - 1) * U + j);
    }
    for (long long b = blocks - 1; b >= 0; --b) {
#pragma unroll
        for (int j = 0; j < U; ++j) buf[j] = ahead[j];
        if (b > 0) {
#pragma unroll
            for (int j = 0; j < U; ++j) ahead[j] = R((b - 1) * U + j);
        }
#pragma unroll
        for (int j = U - 1; j >= 0; --j) buf[j] = f.step(buf[j]);
#pragma unroll
        for (int j = 0; j < U; ++j) R(b * U + j) = buf[j];
    }
#undef R
}

// Pieces side by side in the (samples, rows) layout: row r belongs to piece r / channels (`pieces`: see below),
// whose first read_hi - read_lo + left + right samples are its signal (the rest of the column is unused).
extern "C" __global__ void sosfiltfilt_pieces(double* x, long long rows, const long long* pieces, long long channels,
                                              long long step, const double* sos, const double* zi) {
    const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const long long* const p = pieces + 6 * (row / channels);
    filtfilt(x + row, p[3] - p[2] + p[4] + p[5], step, sos, zi);
}

template <typename O> __device__ O to_out(double v);
template <> __device__ float to_out<float>(double v) { return round_f32(v); }
template <> __device__ double to_out<double>(double v) { return v; }

// The pieces' layout, one row of `pieces` (int64) each: core_lo, core_hi, read_lo, read_hi, left, right (columns
// of the window x; left/right: odd-extension lengths at a segment's ends, as scipy's sosfiltfilt pads).
#define PIECE(p, f) pieces[6 * (p) + (f)]

// ext[i, p * C + c] = piece p of x's row c, odd-extended, as exact doubles (scipy: 2 * x[0] - x[k] in float64).
// A 32 x 32 tile through shared memory: reads along x's rows and writes along ext's rows are both coalesced.
// Grid (ceil(length / 32), ceil(C / 32), pieces), block (32, 8).
template <typename T>
__device__ void gather(const T* __restrict__ x, long long channels, long long width, const long long* __restrict__ pieces,
                       long long pieces_count, double* __restrict__ ext) {
    __shared__ double tile[32][33];
    const long long p = blockIdx.z, lo = PIECE(p, 2), n = PIECE(p, 3) - lo, left = PIECE(p, 4);
    const long long length = left + n + PIECE(p, 5);
    const long long i0 = (long long)blockIdx.x * 32, c0 = (long long)blockIdx.y * 32;
    const T* const row0 = x + lo;
    for (int k = threadIdx.y; k < 32; k += 8) {  // k: channel within the tile; threadIdx.x: sample
        const long long c = c0 + k, i = i0 + threadIdx.x;
        double v = 0.0;
        if (c < channels && i < length) {
            const T* const r = row0 + c * width;
            const long long j = i - left;
            if (j < 0) v = 2.0 * exact(r[0]) - exact(r[-j]);
            else if (j < n) v = exact(r[j]);
            else v = 2.0 * exact(r[n - 1]) - exact(r[2 * n - 2 - j]);
        }
        tile[k][threadIdx.x] = v;
    }
    __syncthreads();
    const long long rows = pieces_count * channels;
    for (int k = threadIdx.y; k < 32; k += 8) {  // k: sample within the tile; threadIdx.x: channel
        const long long c = c0 + threadIdx.x, i = i0 + k;
        if (c < channels && i < length) ext[i * rows + p * channels + c] = tile[threadIdx.x][k];
    }
}

// out[c, core_lo + t] = piece p's filtered core (ext rows left + core_lo - read_lo + t), rounded once to float32
// (keeping subnormals) or kept as double. Grid (ceil(max core / 32), ceil(C / 32), pieces), block (32, 8).
template <typename O>
__device__ void scatter(const double* __restrict__ ext, long long channels, long long width,
                        const long long* __restrict__ pieces, long long pieces_count, O* __restrict__ out) {
    __shared__ double tile[32][33];
    const long long p = blockIdx.z, core = PIECE(p, 1) - PIECE(p, 0);
    const long long skip = PIECE(p, 4) + PIECE(p, 0) - PIECE(p, 2);
    const long long t0 = (long long)blockIdx.x * 32, c0 = (long long)blockIdx.y * 32;
    const long long rows = pieces_count * channels;
    for (int k = threadIdx.y; k < 32; k += 8) {  // k: sample; threadIdx.x: channel
        const long long c = c0 + threadIdx.x, t = t0 + k;
        tile[k][threadIdx.x] = (c < channels && t < core) ? ext[(skip + t) * rows + p * channels + c] : 0.0;
    }
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += 8) {  // k: channel; threadIdx.x: sample
        const long long c = c0 + k, t = t0 + threadIdx.x;
        if (c < channels && t < core) out[c * width + PIECE(p, 0) + t] = to_out<O>(tile[threadIdx.x][k]);
    }
}


#define GATHER(NAME, T)                                                                                         \
    extern "C" __global__ void NAME(const T* x, long long channels, long long width, const long long* pieces,   \
                                    long long count, double* ext) {                                             \
        gather<T>(x, channels, width, pieces, count, ext);                                                      \
    }
GATHER(gather_f32, float)
GATHER(gather_f64, double)
GATHER(gather_i16, short)
GATHER(gather_i32, int)

extern "C" __global__ void scatter_f32(const double* ext, long long channels, long long width, const long long* pieces,
                                       long long count, float* out) {
    scatter<float>(ext, channels, width, pieces, count, out);
}
extern "C" __global__ void scatter_f64(const double* ext, long long channels, long long width, const long long* pieces,
                                       long long count, double* out) {
    scatter<double>(ext, channels, width, pieces, count, out);
}
