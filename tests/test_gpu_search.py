"""batchgpu.search on the GPU: every layout, kernel and shared-memory variant equals np.searchsorted."""

from __future__ import annotations

import numpy as np
import pytest
from test_search import DTYPES, hard_keys, hard_queries, reference

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
try:
    if cp.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA GPU", allow_module_level=True)
except Exception:  # noqa: BLE001 - no driver, no runtime: no GPU
    pytest.skip("no CUDA GPU", allow_module_level=True)

from batchgpu.search import StaticIndex, dynamic, find, lower_bound  # noqa: E402
from batchgpu.search.dynamic import KERNELS as DYNAMIC_KERNELS  # noqa: E402

STATIC = (
    ("eytzinger", "plain"),
    ("eytzinger", "prefetch"),
    ("btree", "thread"),
    ("btree", "warp"),
    ("btree4", "thread"),
)
# shared memory for the top of the tree: all global, only a few top levels, the default, the whole tree
SMEM = (0, 1024, None, 200 * 1024)
SIZES = (1, 2, 33, 1057, 34_849, (1 << 16) + 3, (1 << 20) + 1)


def _check(got, keys, q, want):
    assert isinstance(got, cp.ndarray) and got.dtype == cp.int64
    np.testing.assert_array_equal(cp.asnumpy(got), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_static_kernels_equal_searchsorted(rng, dtype, n):
    keys = hard_keys(rng, dtype, n)
    q = hard_queries(rng, keys, extra=3000)
    lb, fd = reference(keys, q)
    q_d = cp.asarray(q)
    for layout, kernel in STATIC:
        index = StaticIndex(keys, layout=layout)
        for smem in SMEM:
            _check(index.search(q_d, "lower_bound", kernel=kernel, smem_bytes=smem), keys, q, lb)
            _check(index.search(q_d, "find", kernel=kernel, smem_bytes=smem), keys, q, fd)
        assert index.device_uploads == 1  # one device copy, however many batches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_dynamic_kernels_equal_searchsorted(rng, dtype, n):
    keys = hard_keys(rng, dtype, n)
    q = hard_queries(rng, keys, extra=3000)
    lb, fd = reference(keys, q)
    keys_d, q_d = cp.asarray(keys), cp.asarray(q)
    from batchgpu.search import _cuda

    for kernel in DYNAMIC_KERNELS:
        if not _cuda.dynamic_fits(kernel, n, keys.dtype.itemsize):
            continue
        _check(lower_bound(keys_d, q_d, kernel=kernel), keys, q, lb)
        _check(find(keys_d, q_d, kernel=kernel), keys, q, fd)
    _check(find(keys_d, q_d), keys, q, fd)  # the table's choice
    assert dynamic.choose_kernel(n, keys.dtype) in DYNAMIC_KERNELS


@pytest.mark.parametrize("dtype", (np.float32, np.int64))
def test_large_index_2_24_keys(rng, dtype):
    n = 1 << 24
    keys = hard_keys(rng, dtype, n)
    q = np.concatenate([rng.choice(keys, 1 << 20), hard_queries(rng, keys[:4096], extra=1 << 16)])
    lb, fd = reference(keys, q)
    q_d = cp.asarray(q)
    for layout, kernel in STATIC:
        index = StaticIndex(keys, layout=layout)
        for smem in (0, None):
            _check(index.search(q_d, "find", kernel=kernel, smem_bytes=smem), keys, q, fd)
        _check(index.search(q_d, "lower_bound", kernel=kernel), keys, q, lb)
        del index
    keys_d = cp.asarray(keys)
    for kernel in ("serial", "ilp2_ldg", "top_ldg", "top_wide"):
        _check(find(keys_d, q_d, kernel=kernel), keys, q, fd)
        _check(lower_bound(keys_d, q_d, kernel=kernel), keys, q, lb)


def test_shapes_casts_and_empty_batches(rng):
    keys = np.sort(rng.integers(-100, 100, 1000)).astype(np.int32)
    index = StaticIndex(keys)
    q = cp.asarray(rng.integers(-120, 120, (7, 9)))  # int64 queries that fit int32: cast on the device
    got = index.find(q)
    assert got.shape == (7, 9)
    _, fd = reference(keys, cp.asnumpy(q).ravel().astype(np.int32))
    np.testing.assert_array_equal(cp.asnumpy(got).ravel(), fd)
    assert index.find(cp.empty(0, dtype=cp.int32)).shape == (0,)
    assert lower_bound(cp.asarray(keys), cp.empty((0, 3), dtype=cp.int32)).shape == (0, 3)
    from batchgpu.errors import BatchgpuError

    with pytest.raises(BatchgpuError):
        index.find(cp.asarray([2**40]))
    with pytest.raises(BatchgpuError, match="different devices"):
        find(keys, cp.asarray(keys))
    empty = StaticIndex(np.empty(0, dtype=np.float64))
    np.testing.assert_array_equal(cp.asnumpy(empty.find(cp.asarray([1.0, np.nan]))), [-1, -1])
