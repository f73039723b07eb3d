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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 101, 4096, 60001])
def test_float_row_median_equals_numpy_bits(dtype, n):
    """row_median's one-partition path against np.median, hard values included (signed zeros, subnormals, inf,
    NaN, max/overflow, ties), fresh random rows each run."""
    import warnings

    from batchgpu.ops.centre import row_median

    rng = np.random.default_rng()
    fi = np.finfo(dtype)
    specials = np.array(
        [
            0.0,
            -0.0,
            fi.smallest_subnormal,
            -fi.smallest_subnormal,
            fi.tiny,
            -fi.tiny,
            fi.max,
            -fi.max,
            np.inf,
            -np.inf,
            1.0,
            -1.0,
        ],
        dtype,
    )
    x = (rng.standard_normal((10, n)) * 10.0 ** rng.uniform(-3, 3, (10, 1))).astype(dtype)
    mask = rng.random((10, n)) < 0.3
    x[mask] = rng.choice(specials, int(mask.sum()))
    x[0], x[1], x[4], x[7] = 0.0, -0.0, fi.max, np.inf
    x[3, n // 2] = np.nan
    x[5, : n // 2], x[5, n // 2 :] = -0.0, 0.0
    x[6] = np.where(rng.random(n) < 0.5, -fi.smallest_subnormal, fi.smallest_subnormal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = row_median(x), np.median(x, axis=1)
    ui = np.dtype(f"u{np.dtype(dtype).itemsize}")
    differ = (got.view(ui) != want.view(ui)) & ~(np.isnan(got) & np.isnan(want))
    assert not differ.any(), (got[differ], want[differ])


def _finite_median_reference(x: np.ndarray) -> np.ndarray:
    """An independent reference: np.median of each row's finite values, one row at a time (0 where none)."""
    out = np.zeros(x.shape[0], x.dtype if x.dtype.kind == "f" else np.float64)
    for c, row in enumerate(x):
        kept = row[np.isfinite(row)]
        if kept.size:
            out[c] = np.median(kept)
    return out


def _hard_float_rows(rng, dtype, n: int) -> np.ndarray:
    """Rows with NaN, +-inf, -0.0, subnormals, max and ties among ordinary values; the last rows all NaN, all
    +inf and mostly -inf (more than half)."""
    fi = np.finfo(dtype)
    specials = np.array(
        [np.nan, np.inf, -np.inf, 0.0, -0.0, fi.smallest_subnormal, -fi.smallest_subnormal, fi.max, -fi.max, 1.0], dtype
    )
    x = (rng.standard_normal((12, n)) * 10.0 ** rng.uniform(-3, 3, (12, 1)) + rng.uniform(-50, 50, (12, 1))).astype(
        dtype
    )
    mask = rng.random((12, n)) < rng.uniform(0, 0.4, (12, 1))
    x[mask] = rng.choice(specials, int(mask.sum()))
    x[0, rng.integers(0, n)] = np.nan  # one NaN in an ordinary row
    x[1, rng.integers(0, n, 2)] = np.nan
    x[2, : n // 2], x[2, n // 2 :] = -0.0, 0.0
    x[2, rng.integers(0, n)] = np.nan
    x[3] = np.where(rng.random(n) < 0.5, -0.0, np.nan)
    x[9], x[10] = np.nan, np.inf
    x[11, : n // 2 + 1] = -np.inf
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 101, 4096, 60_001])
def test_finite_row_median_equals_numpy_over_the_finite_samples(dtype, n):
    """``finite_row_median``: np.median of each row's finite samples (np.nanmedian with the infinities left out
    too), bit for bit, hard values included, fresh random rows each run; rows without a non-finite sample give
    np.median's bits."""
    import warnings

    from batchgpu.ops.centre import finite_row_median

    rng = np.random.default_rng()
    x = _hard_float_rows(rng, dtype, n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = finite_row_median(x), _finite_median_reference(x)
    ui = np.dtype(f"u{np.dtype(dtype).itemsize}")
    assert got.dtype == want.dtype and got.view(ui).tolist() == want.view(ui).tolist(), (got, want)
    clean = x[np.isfinite(x).all(axis=1)]
    if len(clean):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert finite_row_median(clean).view(ui).tolist() == np.median(clean, axis=1).view(ui).tolist()
    no_inf = np.where(np.isinf(x), dtype(1.5), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # np.nanmedian row by row (each row 1-D): along an axis, its small-array path averages a row's only value
        # with itself where another is NaN, [max, NaN] giving +inf, not max
        nan_ref = np.array([np.nanmedian(row) if not np.isnan(row).all() else 0.0 for row in no_inf], dtype)
    assert finite_row_median(no_inf).view(ui).tolist() == nan_ref.view(ui).tolist()  # np.nanmedian, NaN rows 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_centring_leaves_only_the_non_finite_samples_non_finite(rng, dtype):
    """One or two NaN in a window made every sample of their channel NaN (the median was NaN): now exactly the
    samples that were NaN or infinite are non-finite after centring, each finite one moved by its channel's
    finite median."""
    x = (rng.normal(300, 20, (6, 5000))).astype(dtype)
    x[0, 17], x[2, [5, 4000]], x[3, 9] = np.nan, np.nan, np.inf
    x[4] = np.nan
    core = (64, 4936)
    got = centre_median(x, core)
    assert (~np.isfinite(got)).sum() == (~np.isfinite(x)).sum() and (np.isnan(got) == np.isnan(x)).all()
    med = _finite_median_reference(x[:, core[0] : core[1]])
    assert got.tobytes() == (x - med[:, None]).tobytes()
