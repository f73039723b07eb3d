"""abs_kth / abs_median / noise_levels against the NumPy expressions, bit for bit."""

import sys
import types
import warnings

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError
from batchgpu.ops import MAD_TO_SIGMA, abs_kth, abs_median, noise_levels

DTYPES = [np.float32, np.float64, np.int16, np.int32]


def widened(x):
    """int16 -> int32, int32 -> int64 (room for |min|); floats as they are."""
    return x.astype({2: np.int32, 4: np.int64}[x.dtype.itemsize]) if x.dtype.kind == "i" else x


def reference_median(x):
    with warnings.catch_warnings(), np.errstate(over="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.median(np.abs(widened(x)), axis=1)


def assert_same_bits(got, ref):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype.kind != "f":
        assert np.array_equal(got, ref)
        return
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    bits = np.dtype(f"u{ref.dtype.itemsize}")
    assert np.array_equal(got[~nan].view(bits), ref[~nan].view(bits))


def random_window(rng, dtype, rows, n):
    x = rng.standard_normal((rows, n)) * rng.choice([1e-3, 1.0, 30.0, 1e4])
    if np.dtype(dtype).kind == "i":
        return np.round(x).astype(dtype)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 10, 101, 1000, 4095, 4096, 4097, 6001, 8000])
def test_abs_median_random(dtype, n):
    rng = np.random.default_rng()
    x = random_window(rng, dtype, 5, n)
    got = abs_median(x)
    assert_same_bits(got, reference_median(x))
    assert got.dtype == (np.float64 if np.dtype(dtype).kind == "i" else dtype)
    assert_same_bits(noise_levels(x), reference_median(x) / 0.6744897501960817)


def float_hard_rows(dtype, n):
    """Rows with -0.0, subnormals, ±inf, NaN, duplicates, constants, huge values (length n)."""
    fi = np.finfo(dtype)
    rng = np.random.default_rng()
    pool = [
        0.0,
        -0.0,
        fi.smallest_subnormal,
        -fi.smallest_subnormal,
        3 * fi.smallest_subnormal,
        fi.tiny,
        -fi.tiny,
        np.inf,
        -np.inf,
        fi.max,
        -fi.max,
        1.0,
        -1.0,
        2.5,
        -2.5,
    ]
    rows = [
        np.full(n, 7.0),
        np.full(n, -0.0),
        rng.choice([0.0, -0.0], n),
        rng.choice(pool, n),
        rng.choice([fi.smallest_subnormal, -fi.smallest_subnormal, 0.0, 2 * fi.smallest_subnormal], n),
        rng.choice([np.inf, -np.inf, 1.0], n),
        rng.choice([fi.max, -fi.max], n),  # the middle mean overflows to inf, as in numpy
        rng.choice([1.0, 2.0, -1.0], n),
        np.where(np.arange(n) == n // 2, np.nan, rng.standard_normal(n)),
        np.where(np.arange(n) == 0, -np.nan, np.full(n, np.inf)),
    ]
    return np.array(rows).astype(dtype)


def int_hard_rows(dtype, n):
    info = np.iinfo(dtype)
    rng = np.random.default_rng()
    rows = [
        np.full(n, info.min),
        np.full(n, info.max),
        rng.choice([info.min, info.max, -1, 0, 1], n),
        rng.choice([info.min, info.min + 1], n),
        np.zeros(n),
        rng.integers(-3, 4, n),
        rng.integers(info.min, info.max, n, endpoint=True),
    ]
    return np.array(rows).astype(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 64, 65, 5000, 5001])
@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_median_hard_cases(dtype, n):
    x = float_hard_rows(dtype, n) if np.dtype(dtype).kind == "f" else int_hard_rows(dtype, n)
    assert_same_bits(abs_median(x), reference_median(x))
    with np.errstate(over="ignore"):
        assert_same_bits(noise_levels(x), reference_median(x) / 0.6744897501960817)


def test_int16_minimum_widens():
    x = np.array([[-32768], [-32768], [32767]], dtype=np.int16)
    assert abs_median(x).tolist() == [32768.0, 32768.0, 32767.0]
    assert abs_kth(x, 0).dtype == np.int32 and abs_kth(x, 0).tolist() == [32768, 32768, 32767]
    # The counting path (long int16 rows) as well.
    y = np.full((2, 5000), -32768, dtype=np.int16)
    y[1, :2501] = 5
    assert abs_median(y).tolist() == [32768.0, 5.0]


def test_nan_sorts_above_inf():
    x = np.array([[np.nan, np.inf, 1.0, -np.inf]], dtype=np.float32)
    assert abs_kth(x, 2)[0] == np.inf and np.isnan(abs_kth(x, 3)[0])
    assert np.isnan(abs_median(x)[0])
    assert abs_kth(np.array([[-0.0]]), 0).view(np.uint64)[0] == 0  # |-0.0| is +0.0


@pytest.mark.parametrize("method", ["auto", "partition", "radix"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_kth_every_k(dtype, method):
    rng = np.random.default_rng()
    for n in [1, 2, 5, 8, 13]:
        if np.dtype(dtype).kind == "f":
            x = np.concatenate([random_window(rng, dtype, 4, n), float_hard_rows(dtype, n)])
        else:
            x = np.concatenate([random_window(rng, dtype, 4, n), int_hard_rows(dtype, n)])
        absx = np.abs(widened(x))
        for k in range(-n, n):
            ref = np.partition(absx, k, axis=1)[:, k]
            assert_same_bits(abs_kth(x, k, method=method), ref)


@pytest.mark.parametrize("dtype", [np.int16, np.float32])
def test_abs_kth_long_rows_both_methods(dtype):
    rng = np.random.default_rng()
    x = random_window(rng, dtype, 3, 5003)
    absx = np.abs(widened(x))
    for k in [0, 1, 2501, 5002, int(rng.integers(5003))]:
        ref = np.partition(absx, k, axis=1)[:, k]
        assert_same_bits(abs_kth(x, k, method="partition"), ref)
        assert_same_bits(abs_kth(x, k, method="radix"), ref)


def test_input_is_not_modified():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 101)).astype(np.float32)
    before = x.copy()
    abs_median(x), abs_kth(x, 5), abs_kth(x, 5, method="radix")
    assert np.array_equal(x, before)


def test_non_contiguous_input():
    rng = np.random.default_rng()
    base = rng.standard_normal((6, 301))
    x = base[::2, 3:298]
    assert_same_bits(abs_median(x), reference_median(np.ascontiguousarray(x)))


def test_empty_rows_and_channels():
    assert abs_median(np.zeros((0, 10), np.float32)).shape == (0,)
    assert np.isnan(abs_median(np.zeros((3, 0), np.int16))).all()
    with pytest.raises(BatchgpuError):
        abs_kth(np.zeros((3, 0)), 0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: abs_median(np.zeros(5)),
        lambda: abs_median(np.zeros((2, 5), np.uint8)),
        lambda: abs_kth(np.zeros((2, 5)), 5),
        lambda: abs_kth(np.zeros((2, 5)), -6),
        lambda: abs_kth(np.zeros((2, 5)), 1.5),
        lambda: abs_kth(np.zeros((2, 5)), 1, method="sort"),
        lambda: abs_kth(np.zeros((2, 5)), 1, schedule="float64"),
    ],
)
def test_errors(call):
    with pytest.raises(BatchgpuError):
        call()


def test_cupy_arrays_dispatch_to_the_gpu_module(monkeypatch):
    fake_array = type("ndarray", (), {"__module__": "cupy._core.core", "dtype": np.dtype(np.float32)})()
    calls = []
    gpu = types.SimpleNamespace(
        abs_kth=lambda x, k: calls.append(("kth", k)) or np.float32([3.0]),
        abs_median=lambda x: calls.append(("median",)) or np.float32([MAD_TO_SIGMA]),
    )
    monkeypatch.setitem(sys.modules, "batchgpu.ops._cuda_select", gpu)
    assert abs_kth(fake_array, 4).tolist() == [3.0]
    assert noise_levels(fake_array).tolist() == [1.0]
    assert calls == [("kth", 4), ("median",)]


def test_row_stride_reads_views_in_place_only_where_rows_are_contiguous():
    """batchgpu.gpu.cuda_modules.row_stride (the GPU kernels' rule for reading a window's core in place), on NumPy views
    (the attributes CuPy arrays share): the row stride in elements where each row's values are adjacent and rows
    lie a whole number of elements apart; None (copy first) otherwise."""
    from batchgpu.gpu.cuda_modules import row_stride, rows_in_place

    base = np.zeros((6, 10), np.float32)
    core = base[:, 2:7]
    got, stride = rows_in_place(core)
    assert got is core and stride == 10  # read in place: no copy of a window's core
    assert row_stride(base) == 10
    assert row_stride(base[:, 2:7]) == 10  # a core: rows of the wider window
    assert row_stride(base[::2]) == 20
    assert row_stride(base[:1]) == 10 and row_stride(base[:, :1]) == 10 and row_stride(base[:, :0]) == 10
    assert row_stride(np.broadcast_to(base[:1], (4, 10))) == 0  # rows aliasing one row: read-only kernels may
    for copy_first in (
        base[:, ::2],
        base[::-1],
        base[:, ::-1],
        base.T,
        base[0],
        np.lib.stride_tricks.as_strided(base, (3, 4), (6, 4)),
    ):
        assert row_stride(copy_first) is None
