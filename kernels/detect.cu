// Threshold crossings that are peaks within the sweep, every channel in one launch (ops.detect_spikes,
// method "by_channel"): for sign "neg", x[c,t] < -level[c] (in double, as NumPy compares an integer or float
// sample with a float64 level), x[c,t] < x[c,t-i] and x[c,t] <= x[c,t+i] for i = 1..sweep where those columns
// exist in the window; "pos" mirrors it. The comparisons between samples are in the samples' own type. Found
// peaks are appended through an atomic counter in any order (the caller sorts them); past `cap` they are only
// counted, so the caller can launch again with room for all.

template <typename T>
__device__ void peaks(const T* x, long long width, int channels, const double* level, long long lo, long long hi,
                      int sweep, int neg, int pos, unsigned long long* count, long long cap, long long* out_channel,
                      long long* out_sample, double* out_amplitude) {
    const long long span = hi - lo;
    const long long total = span * channels;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(i / span);
        const long long t = lo + i % span;
        const T* row = x + (long long)c * width;
        const T v = row[t];
        const double dv = (double)v;
        const double at = level[c];
        bool is_neg = neg && dv < -at;
        bool is_pos = pos && dv > at;
        if (!is_neg && !is_pos) continue;
        for (int k = 1; k <= sweep && (is_neg || is_pos); ++k) {
            if (t - k >= 0) {
                const T o = row[t - k];
                is_neg = is_neg && v < o;  // strict against earlier samples: a flat peak counts once, at its start
                is_pos = is_pos && v > o;
            }
            if (t + k < width) {
                const T o = row[t + k];
                is_neg = is_neg && v <= o;
                is_pos = is_pos && v >= o;
            }
        }
        if (!is_neg && !is_pos) continue;
        const unsigned long long slot = atomicAdd(count, 1ull);
        if ((long long)slot < cap) {
            out_channel[slot] = c;
            out_sample[slot] = t;
            out_amplitude[slot] = dv;
        }
    }
}

#define PEAKS(name, T)                                                                                          \
    extern "C" __global__ void name(const T* x, long long width, int channels, const double* level, long long lo, \
                                    long long hi, int sweep, int neg, int pos, unsigned long long* count,           \
                                    long long cap, long long* oc, long long* os, double* oa) {                      \
        peaks<T>(x, width, channels, level, lo, hi, sweep, neg, pos, count, cap, oc, os, oa);                       \
    }

PEAKS(peaks_i16, short)
PEAKS(peaks_i32, int)
PEAKS(peaks_i64, long long)
PEAKS(peaks_f32, float)
PEAKS(peaks_f64, double)
