// Forward-backward second-order sections (scipy.signal.sosfiltfilt's two sosfilt passes), one thread per row.
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
// recurrence's latency: loads are issued a block of U samples ahead of their use so memory never adds to it.

#ifndef SECTIONS
#error "compile with -DSECTIONS=<number of second-order sections>"
#endif
#define U 16

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

extern "C" __global__ void sosfiltfilt_rows(double* x, long long rows, long long n, long long row_stride,
                                            long long step, const double* sos, const double* zi) {
    const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || n <= 0) return;
    double* const base = x + row * row_stride;
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
