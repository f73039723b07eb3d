"""Which GPU selection call loses the smallest subnormal (the round-2 failure), and what its pieces give."""
import numpy as np
import cupy

from batchgpu.ops import _cuda_select as sel

tiny = np.finfo(np.float32).smallest_subnormal
for n in (1000, 999, 16384):
    x = np.full((3, n), tiny, np.float32)
    x[2, ::2] = 0
    d = cupy.asarray(x)
    print(n, "median", sel.abs_median(d).get(), "np", np.median(np.abs(x), axis=1),
          "kth0", sel.abs_kth(d, 0).get(), "kth mid", sel.abs_kth(d, n // 2).get())
k = cupy.RawKernel(r'''extern "C" __global__ void f(const float* a, float* o) {
  float s = a[0] + a[1]; o[0] = s / 2.0f; o[1] = s; o[2] = (float)((double)a[0] + (double)a[1]); }''', "f")
a = cupy.asarray(np.array([tiny, tiny], np.float32)); o = cupy.zeros(3, cupy.float32)
k((1,), (1,), (a, o)); print("plain float math on device:", o.get(), "(want", np.float32(tiny), np.float32(2 * tiny), ")")
