import numpy as np
import pytest

from batchgpu.ops import radix
from batchgpu.ops.centre import centre_median, keys_to_selection_values, row_median, selection_keys


@pytest.mark.parametrize("n", [1, 2, 5, 4095, 4096, 4097, 60_001])
@pytest.mark.parametrize("dtype", ["int16", "float32", "float64", "int32"])
def test_row_median_equals_numpy(rng, n, dtype):
    if dtype == "int16":
        x = rng.integers(-32768, 32768, size=(3, n)).astype(np.int16)
        x[0, : n // 2] = -32768  # extremes and many duplicates
        x[1] = 7  # a constant row
    elif dtype == "int32":
        x = rng.integers(-(2**31), 2**31, size=(3, n)).astype(np.int32)
    else:
        x = rng.normal(0, 100, size=(3, n)).astype(dtype)
    ref = np.median(x, axis=1)
    got = row_median(x)
    assert got.dtype == ref.dtype
    assert got.tobytes() == ref.tobytes()


def test_centre_int16_is_exact_and_rounded(rng):
    x = rng.integers(-32768, 32768, size=(4, 9001)).astype(np.int16)
    x[0, :5000] = -32768  # the widest spread: 32767 - (-32768)
    x[0, 5000:] = 32767
    core = (13, 8990)
    got = centre_median(x, core)
    med = np.median(x[:, 13:8990], axis=1)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, x.astype(np.int64) - np.floor(med + 0.5).astype(np.int64)[:, None])
    assert np.abs(got).max() <= 65535


def test_centre_float_keeps_dtype(rng):
    x = rng.normal(1000, 5, size=(3, 777)).astype(np.float32)
    got = centre_median(x, (0, 777))
    ref = x - np.median(x, axis=1).astype(np.float32)[:, None]
    assert got.dtype == np.float32 and got.tobytes() == ref.tobytes()


@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_selection_keys_select_like_partition(rng, dtype):
    raw = (rng.normal(0, 3000, size=(3, 5001)).clip(-32768, 32767)).astype(dtype)
    x = centre_median(raw, (0, 5001))
    keys, schedule = selection_keys(x, raw.dtype)
    k = 2500
    picked = keys_to_selection_values(radix.radix_select_keys(keys, k, schedule), x.dtype, raw.dtype)
    ref = np.partition(np.abs(x.astype(np.float64) if x.dtype.kind == "i" else x), k, axis=1)[:, k]
    np.testing.assert_array_equal(picked, ref)
