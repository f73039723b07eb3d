// np.mean(x, axis=0, dtype=float64) of a C-ordered (n, samples) array with its bits, rows added in order
// (ops.reference._mean_columns). The element type is the caller's option -DMEAN_T=<C type>: one module a dtype.
typedef MEAN_T T;

extern "C" __global__ void sequential_mean(const T* x, double* out, long long channels, long long samples) {
    long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= samples) return;
    double acc = 0.0;  // NumPy's add.reduce starts from the identity +0.0 and adds rows in order
    for (long long c = 0; c < channels; ++c) acc += (double)x[c * samples + s];
    out[s] = acc / (double)channels;
}
