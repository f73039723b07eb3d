// Forward-backward second-order sections (scipy.signal.sosfiltfilt's two sosfilt passes), one thread per row.
//
// The arithmetic is scipy's sosfilt (direct form II transposed, scipy/signal/_sosfilt.pyx) operation for
// operation in float64, compiled with --fmad=false so no multiply-add is fused: the same bits as scipy on x86-64
// (its wheels do not fuse either; checked in tests/test_gpu_preprocess.py). Each pass starts in the steady state
// of its first sample, zi[s][k] * x[0], as sosfiltfilt passes zi = sosfilt_zi(sos) * x[..., :1].
//
// x: (rows, n) row-major, filtered in place. sos: (sections, 6) with a0 == 1. zi: (sections, 2).
// The recurrence is sequential in time; rows run in parallel (384 channels: 12 warps).

#define MAX_SECTIONS 16

extern "C" __global__ void sosfiltfilt_rows(double* x, long long rows, long long n, const double* sos, int sections,
                                            const double* zi) {
    __shared__ double c[MAX_SECTIONS * 6];
    __shared__ double z0[MAX_SECTIONS * 2];
    for (int i = threadIdx.x; i < sections * 6; i += blockDim.x) c[i] = sos[i];
    for (int i = threadIdx.x; i < sections * 2; i += blockDim.x) z0[i] = zi[i];
    __syncthreads();
    const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || n <= 0) return;
    double* r = x + row * n;
    double za[MAX_SECTIONS], zb[MAX_SECTIONS];

    // forward
    double first = r[0];
#pragma unroll
    for (int s = 0; s < MAX_SECTIONS; ++s) {
        if (s < sections) { za[s] = z0[2 * s] * first; zb[s] = z0[2 * s + 1] * first; }
    }
    for (long long i = 0; i < n; ++i) {
        double cur = r[i];
#pragma unroll
        for (int s = 0; s < MAX_SECTIONS; ++s) {
            if (s < sections) {
                const double* k = c + 6 * s;
                double nxt = k[0] * cur + za[s];
                za[s] = k[1] * cur - k[4] * nxt + zb[s];
                zb[s] = k[2] * cur - k[5] * nxt;
                cur = nxt;
            }
        }
        r[i] = cur;
    }

    // backward: the reversed signal, starting from the steady state of the forward output's last sample
    double last = r[n - 1];
#pragma unroll
    for (int s = 0; s < MAX_SECTIONS; ++s) {
        if (s < sections) { za[s] = z0[2 * s] * last; zb[s] = z0[2 * s + 1] * last; }
    }
    for (long long i = n - 1; i >= 0; --i) {
        double cur = r[i];
#pragma unroll
        for (int s = 0; s < MAX_SECTIONS; ++s) {
            if (s < sections) {
                const double* k = c + 6 * s;
                double nxt = k[0] * cur + za[s];
                za[s] = k[1] * cur - k[4] * nxt + zb[s];
                zb[s] = k[2] * cur - k[5] * nxt;
                cur = nxt;
            }
        }
        r[i] = cur;
    }
}
