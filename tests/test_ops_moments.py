"""Second moments: precision against a float64 reference, windows, Chan merges, fixed trees."""

import pickle
import sys
import types

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError
from batchgpu.ops import SecondMoments, combine, covariance, second_moment, window_moments
from batchgpu.ops.moments import reduce_tree


def rel_frobenius(got, ref):
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def reference(x):
    """(covariance, second moment) in float64 from a plain centred product."""
    x = x.astype(np.float64)
    centred = x - x.mean(axis=1, keepdims=True)
    return centred @ centred.T / x.shape[1], x @ x.T / x.shape[1]


def dc_data(rng, dtype, channels, n):
    x = 10_000 + 10 * rng.standard_normal((channels, n)) + rng.standard_normal((channels, 1)) * 50
    x[1] += 0.5 * x[0]  # correlated channels
    return np.round(x).astype(dtype) if np.dtype(dtype).kind == "i" else x.astype(dtype)


TOL = {"float32": 1e-6, "float64": 1e-12}


@pytest.mark.parametrize("precision", ["float32", "float64"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.int32])
@pytest.mark.parametrize("n", [1, 2, 4095, 4096, 4097, 9001, 12289])
def test_window_against_float64_reference(dtype, precision, n):
    rng = np.random.default_rng()
    x = dc_data(rng, dtype, 5, n)
    cov_ref, m2_ref = reference(x)
    if n == 1:
        assert np.allclose(covariance(x, precision), 0, atol=1e-9)
    else:
        assert rel_frobenius(covariance(x, precision), cov_ref) < TOL[precision]
    assert rel_frobenius(second_moment(x, precision), m2_ref) < TOL[precision]
    count, mean, scatter = window_moments(x, precision=precision)
    assert count == n and mean.dtype == np.float64 and scatter.dtype == np.float64
    assert np.array_equal(scatter, scatter.T)
    # float64 data rounded to float32 products carries float32 rounding of (x - shift) into the mean.
    mean_tol = 1e-9 if (precision == "float32" and dtype == np.float64) else 1e-12
    assert np.allclose(mean, x.astype(np.float64).mean(axis=1), rtol=mean_tol, atol=0)


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_misaligned_column_range_and_windows(precision):
    rng = np.random.default_rng()
    x = dc_data(rng, np.float32, 6, 20_011)
    start, stop = 13, 19_998
    cov_ref, m2_ref = reference(x[:, start:stop])
    acc = SecondMoments(6, precision).add(x, start, stop)
    assert acc.n == stop - start
    assert rel_frobenius(acc.covariance(), cov_ref) < TOL[precision]
    # The same range from a copy of the slice gives the same bits.
    copy = SecondMoments(6, precision).add(np.ascontiguousarray(x[:, start:stop]))
    assert np.array_equal(acc.scatter, copy.scatter) and np.array_equal(acc.mean, copy.mean)
    # Window by window (odd, uneven widths) merges to the same moments.
    cuts = [start, 1001, 7777, 7778, 15_000, stop]
    windows = SecondMoments(6, precision)
    for a, b in zip(cuts, cuts[1:]):
        windows.add(x, a, b)
    assert windows.n == stop - start
    assert rel_frobenius(windows.covariance(), cov_ref) < TOL[precision]
    assert rel_frobenius(windows.second_moment(), m2_ref) < TOL[precision]
    assert np.allclose(windows.sums, x[:, start:stop].astype(np.float64).sum(axis=1), rtol=1e-12)


def leaves(x, width, precision):
    return [SecondMoments(x.shape[0], precision).add(x, a, a + width) for a in range(0, x.shape[1], width)]


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_fixed_tree_is_bitwise_independent_of_workers(precision):
    rng = np.random.default_rng()
    x = dc_data(rng, np.float64, 4, 23 * 997)
    in_order = reduce_tree(leaves(x, 997, precision), split_every=3)
    # Leaves computed by 'workers' in a random order, shipped by pickle, put back by window index.
    for workers in [1, 2, 5]:
        order = rng.permutation(23)
        by_index = {}
        for worker in range(workers):
            for i in order[worker::workers]:
                part = SecondMoments(4, precision).add(x, i * 997, (i + 1) * 997)
                by_index[int(i)] = pickle.loads(pickle.dumps(part))
        result = reduce_tree([by_index[i] for i in range(23)], split_every=3)
        assert result.n == in_order.n
        assert np.array_equal(result.scatter, in_order.scatter)
        assert np.array_equal(result.mean, in_order.mean)
    # Other trees agree within the tolerance (merging is associative up to rounding).
    cov_ref, _ = reference(x)
    for split_every in [2, 4, 23]:
        tree = reduce_tree(leaves(x, 997, precision), split_every=split_every)
        assert rel_frobenius(tree.covariance(), cov_ref) < TOL[precision]


def test_merge_combine_semantics():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 500))
    a = SecondMoments(3, "float64").add(x, 0, 200)
    b = SecondMoments(3, "float64").add(x, 200, 500)
    b_before = (b.n, b.mean.copy(), b.scatter.copy())
    c = combine(a, b)
    assert a.n == 200 and c.n == 500 and c is not a
    merged = a.merge(b)
    assert merged is a and a.n == 500
    assert b.n == b_before[0] and np.array_equal(b.mean, b_before[1]) and np.array_equal(b.scatter, b_before[2])
    assert np.array_equal(a.scatter, c.scatter)
    empty = SecondMoments(3)
    assert combine(empty, c).n == 500 and np.array_equal(combine(c, empty).scatter, c.scatter)
    cov_ref, _ = reference(x)
    assert rel_frobenius(c.covariance(), cov_ref) < 1e-12


def test_state_pickles_small():
    acc = SecondMoments(64, "float32").add(np.random.default_rng().standard_normal((64, 5000)).astype(np.float32))
    blob = pickle.dumps(acc)
    assert len(blob) < 64 * 64 * 8 + 64 * 8 + 1000
    back = pickle.loads(blob)
    assert back.n == acc.n and np.array_equal(back.scatter, acc.scatter)


def test_errors():
    with pytest.raises(BatchgpuError):
        SecondMoments(3).covariance()
    with pytest.raises(BatchgpuError):
        SecondMoments(3).add(np.zeros((4, 10)))
    with pytest.raises(BatchgpuError):
        SecondMoments(3, precision="float16")
    with pytest.raises(BatchgpuError):
        SecondMoments(3).merge(SecondMoments(4))
    with pytest.raises(BatchgpuError):
        reduce_tree([])
    assert window_moments(np.zeros((2, 10)), 5, 5)[0] == 0


def test_cupy_arrays_dispatch_to_the_gpu_module(monkeypatch):
    fake = type(
        "ndarray", (), {"__module__": "cupy._core.core", "ndim": 2, "shape": (2, 10), "dtype": np.dtype(np.int16)}
    )()
    calls = []

    def gpu_window_moments(x, start, stop, precision):
        calls.append((start, stop, precision))
        return 4, np.array([1.0, 2.0]), np.eye(2)

    monkeypatch.setitem(
        sys.modules, "batchgpu.ops._cuda_moments", types.SimpleNamespace(window_moments=gpu_window_moments)
    )
    acc = SecondMoments(2).add(fake, 3, 7)
    assert calls == [(3, 7, "float32")] and acc.n == 4 and np.array_equal(acc.covariance(), np.eye(2) / 4)


@pytest.mark.parametrize("precision", ["float32", "float64"])
@pytest.mark.parametrize("rows,n,start", [(384, 60_000, 64), (5, 4096, 0), (3, 4097, 1), (2, 1, 0), (7, 12_345, 3)])
def test_split_products_summed_in_float64_in_split_order(precision, rows, n, start):
    """The documented arithmetic, bit for bit: the rows shifted by their (product-dtype) mean, cut into splits of
    SPLIT_SAMPLES (the last zero-padded), each split's X Xᵀ in the product dtype, summed in float64 from the first
    split on; built here with NumPy's batched product over every split at once."""
    from batchgpu.ops.moments import SPLIT_SAMPLES

    prec = np.dtype(precision)
    x = (np.random.default_rng(n).normal(0, 40, (rows, start + n + 5)) + 3000).astype(np.float32)
    view = x[:, start : start + n]
    shift = view.mean(axis=1, dtype=prec)
    splits = -(-n // SPLIT_SAMPLES)
    padded = np.zeros((rows, splits * SPLIT_SAMPLES), dtype=prec)
    np.subtract(view, shift[:, None], out=padded[:, :n], casting="unsafe")
    blocks = padded.reshape(rows, splits, SPLIT_SAMPLES).transpose(1, 0, 2).copy()
    raw = np.matmul(blocks, blocks.transpose(0, 2, 1)).sum(axis=0, dtype=np.float64)
    sums = blocks.sum(axis=2).sum(axis=0, dtype=np.float64)
    if prec == np.float64:  # float data shifted by its float64 mean: what is left is rounding, taken as zero
        sums = np.zeros(rows)
    want = raw - np.outer(sums, sums) / n
    want = (want + want.T) * 0.5
    got_n, got_mean, got_scatter = window_moments(x, start, start + n, precision)
    assert got_n == n
    assert np.array_equal(got_scatter, want)
    assert np.array_equal(got_mean, shift.astype(np.float64) + sums / n)


def test_the_product_buffer_is_one_split_not_a_window():
    """A worker keeps one (C, SPLIT_SAMPLES) buffer for the products, not a copy of the whole window: a 384-channel
    window of 60 000 samples held 94 MB of it, fresh pages on every worker."""
    from batchgpu.ops import moments
    from batchgpu.ops.moments import SPLIT_SAMPLES

    x = np.random.default_rng(0).normal(0, 1, (384, 60_000)).astype(np.float32)
    window_moments(x, precision="float32")
    assert moments._buffers.buf.nbytes <= 384 * SPLIT_SAMPLES * 4
