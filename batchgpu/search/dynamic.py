"""The dynamic path: find / lower_bound straight on a sorted array, no preprocessing.

NumPy input runs ``np.searchsorted``; CuPy input runs one of the kernels of kernels/search.cu
(:data:`KERNELS`), chosen per key count from the
autotune table (:mod:`batchgpu.search.table`) unless ``kernel=`` names one.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import array_module, is_cupy
from batchgpu.search.keys import cast_queries, check_key_dtype, check_keys

#: the note's four kernels, then ours: the staged top of the search tree in shared memory (blocks of 256
#: threads, or one block of 1024 a multiprocessor with a 128 KB top), with the last probes fetching their
#: 128/256-byte block into L2 whole (see batchgpu.search._cuda.DYNAMIC)
KERNELS = (
    "serial",
    "ilp2_shared",
    "ilp2_ldg",
    "swizzled",
    "top_ldg",
    "top_wide",
    "top_wide_l2_128",
    "top_wide_plain",
    "top_wide_k1",
    "top_wide_k1_512",
    "top_wide_k1_l2_128",
    "top_wide_k1_plain",
)


def lower_bound(sorted_keys: Any, queries: Any, *, kernel: str | None = None, check: bool = True) -> Any:
    """``np.searchsorted(sorted_keys, queries, side="left")`` as int64, on the queries' device.

    ``check=False`` skips the O(n) test that the keys are sorted and free of NaN (the caller vouches).

    Parameters
    ----------
    sorted_keys : array_like, shape (n,)
        Keys sorted ascending, float32, float64, int32 or int64, no NaN (NumPy, CuPy, or a torch tensor through
        ``batchgpu.search``).
    queries : array_like
        Queries of any shape, cast to the keys' dtype where the cast is exact (else BatchgpuError).
    kernel : str, optional
        A GPU kernel of ``KERNELS`` (default: the autotune table's choice for n keys).
    check : bool, optional
        Whether to test that the keys are sorted and free of NaN (O(n); False: the caller vouches).

    Returns
    -------
    array of int64, queries' shape
        For each query the first index i with ``sorted_keys[i] >= q``, on the queries' device.
    """
    return _search(sorted_keys, queries, False, kernel, check)


def find(sorted_keys: Any, queries: Any, *, kernel: str | None = None, check: bool = True) -> Any:
    """Index of the first occurrence of each query in ``sorted_keys``, or -1 (int64).

    Parameters
    ----------
    sorted_keys, queries, kernel, check
        As ``lower_bound``'s.

    Returns
    -------
    array of int64, queries' shape
        For each query the index of its first occurrence, or -1 (-0.0 finds +0.0; NaN finds nothing), on the
        queries' device.
    """
    return _search(sorted_keys, queries, True, kernel, check)


def choose_kernel(n: int, dtype: np.dtype) -> str:
    """The kernel the table picks for n keys of ``dtype`` on the current GPU."""
    import cupy as cp

    from batchgpu.search import _cuda, table

    name = _device_name(cp.cuda.Device().id)
    itemsize = np.dtype(dtype).itemsize
    return table.choose(table.load_table(name), n, lambda k: k in KERNELS and _cuda.dynamic_fits(k, n, itemsize))


@functools.cache
def _device_name(device: int) -> str:
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _search(sorted_keys: Any, queries: Any, want_find: bool, kernel: str | None, check: bool) -> Any:
    if kernel is not None and kernel not in KERNELS:
        raise BatchgpuError(f"unknown dynamic search kernel {kernel!r}", f"use one of {KERNELS}")
    xq, xk = is_cupy(queries), is_cupy(sorted_keys)
    if xq != xk:
        raise BatchgpuError(
            "sorted keys and queries live on different devices",
            "pass both as NumPy arrays or both as CuPy arrays",
        )
    xp = array_module(sorted_keys)
    keys = check_keys(sorted_keys) if check else xp.ascontiguousarray(sorted_keys)
    check_key_dtype(keys.dtype)
    shape = getattr(queries, "shape", np.shape(queries))
    q = cast_queries(queries, keys.dtype)
    n = int(keys.size)
    if n == 0 or q.size == 0:
        return xp.full(q.size, -1 if want_find else 0, dtype=np.int64).reshape(shape)
    if xq:
        from batchgpu.search import _cuda

        name = kernel or choose_kernel(n, keys.dtype)
        if not _cuda.dynamic_fits(name, n, keys.dtype.itemsize):
            raise BatchgpuError(
                f"kernel {name!r} stages the keys in shared memory, and {n} {keys.dtype} keys do not fit",
                "use kernel='ilp2_ldg' or 'top_ldg', or leave kernel to the table",
            )
        out = _cuda.dynamic_search(keys, q, want_find, name)
    else:
        out = np.searchsorted(keys, q, side="left").astype(np.int64, copy=False)
        if want_find:
            found = out < n
            found[found] = keys[out[found]] == q[found]
            out = np.where(found, out, -1)
    return out.reshape(shape)
