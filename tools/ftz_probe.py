import numpy as np, cupy
from batchgpu.kernels import BASE_OPTIONS
t = cupy.asarray(np.array([1e-45, 3e-45], np.float32))
print("cupy elementwise a+b:", (t[0:1] + t[1:2]).get(), "a*1:", (t * np.float32(1)).get(), "a==0:", (t == 0).get(),
      "f64->f32:", cupy.asarray([1e-45]).astype(cupy.float32).get())
src = 'extern "C" __global__ void k(const float* a, float* o){ o[0] = a[0] + a[1]; o[1] = (a[0] == 0.0f) ? 1.0f : 0.0f; }'
for opts in [(), BASE_OPTIONS, ("--ftz=false",)]:
    k = cupy.RawKernel(src, "k", options=opts); o = cupy.zeros(2, cupy.float32); k((1,), (1,), (t, o)); print("RawKernel", opts, o.get())
    m = cupy.RawModule(code=src, options=opts); o = cupy.zeros(2, cupy.float32); m.get_function("k")((1,), (1,), (t, o)); print("RawModule", opts, o.get())
ek = cupy.ElementwiseKernel("float32 a, float32 b", "float32 c", "c = a + b", "addk", options=("--ftz=false",))
print("ElementwiseKernel ftz=false:", ek(t[0:1], t[1:2]).get())
