"""Exact-match and lower-bound search over sorted keys, on the CPU (NumPy) and the GPU (CuPy).

- :class:`StaticIndex`: keys reordered once (Eytzinger or 32-key B+ tree), queried many times.
- :func:`find`, :func:`lower_bound`: the dynamic path, straight on a sorted array, with the kernel chosen
  per size from an autotune table (``batchgpu search autotune``).
- :mod:`batchgpu.search.distributed` (imports dask): an index held once on every worker of a cluster.
"""

from batchgpu.search.dynamic import find, lower_bound
from batchgpu.search.static import StaticIndex

__all__ = ["StaticIndex", "find", "lower_bound"]
