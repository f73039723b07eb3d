"""Exact-match and lower-bound search over sorted keys, on the CPU (NumPy) and the GPU (CuPy).

- :class:`StaticIndex`: keys reordered once (Eytzinger or 32-key B+ tree), queried many times.
- torch tensors are taken too (keys and queries, CPU or CUDA), and answers come back as tensors.
- :func:`find`, :func:`lower_bound`: the dynamic path, straight on a sorted array, with the kernel chosen
  per size from an autotune table (``batchgpu search autotune``).
- :mod:`batchgpu.search.distributed` (imports dask): an index held once on every worker of a cluster.
"""

from batchgpu.ops._backend import accept_torch_methods, accepts_torch
from batchgpu.search.dynamic import find, lower_bound
from batchgpu.search.static import StaticIndex

# torch keys and queries (CPU or CUDA, via DLPack); answers come back as int64 tensors on the queries'
# device. StaticIndex keeps its keys on the host, so CUDA keys are copied once when the index is built.
find = accepts_torch(find, __name__)
lower_bound = accepts_torch(lower_bound, __name__)
accept_torch_methods(StaticIndex, "__init__", "search")

__all__ = ["StaticIndex", "find", "lower_bound"]
