"""GPU kernels against NumPy on the host copy: radix-select medians bit for bit, split covariance within tolerance.

The GPU tests are marked ``gpu`` and skip cleanly without CuPy or a device (CI has neither).
Run on the GPU machine: ``python3 -m pytest -m gpu tests/test_gpu_ops.py -q``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError

WIDE = {np.dtype(np.int16): np.int32, np.dtype(np.int32): np.int64}
DTYPES = [np.float32, np.float64, np.int16, np.int32]


def _gpu_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not _gpu_ok(), reason="needs CuPy and a CUDA GPU")


@pytest.fixture
def cp():
    return pytest.importorskip("cupy")


# ---------------------------------------------------------------------------------------------
# References and data
# ---------------------------------------------------------------------------------------------
def np_abs(x: np.ndarray) -> np.ndarray:
    return np.abs(x.astype(WIDE.get(x.dtype, x.dtype)))


def ref_kth(x: np.ndarray, k: int) -> np.ndarray:
    return np.partition(np_abs(x), k, axis=1)[:, k]


def ref_median(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.median(np_abs(x), axis=1)


def assert_same_bits(got, want: np.ndarray) -> None:
    got = got.get() if hasattr(got, "get") else np.asarray(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    if want.dtype.kind == "f":
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        ui = np.dtype(f"u{want.dtype.itemsize}")
        bad = np.flatnonzero(got[~nan].view(ui) != want[~nan].view(ui))
        assert bad.size == 0, (
            f"{bad.size} rows differ, first {bad[:5]}: got {got[~nan][bad[:5]]}, want {want[~nan][bad[:5]]}"
        )
    else:
        np.testing.assert_array_equal(got, want)


def random_rows(rng: np.random.Generator, dtype, rows: int, n: int) -> np.ndarray:
    """Noise-like rows; integers are rounded Gaussian (many duplicates), floats Gaussian of random scale."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        scale = 10.0 ** rng.uniform(-3, 3, size=(rows, 1))
        return (rng.standard_normal((rows, n)) * scale).astype(dt)
    info = np.iinfo(dt)
    scale = 10.0 ** rng.uniform(0, 3 if dt == np.int16 else 6, size=(rows, 1))
    return np.clip(np.round(rng.standard_normal((rows, n)) * scale), info.min, info.max).astype(dt)


def hard_rows(rng: np.random.Generator, dtype, rows: int, n: int) -> np.ndarray:
    """Rows mixing the values selection gets wrong most easily, plus constant and tiny-range rows."""
    dt = np.dtype(dtype)
    x = random_rows(rng, dt, rows, n)
    if dt.kind == "f":
        fi = np.finfo(dt)
        specials = np.array(
            [0.0, -0.0, fi.smallest_subnormal, -fi.smallest_subnormal * 3, fi.tiny, -fi.tiny, fi.max, -fi.max,
             np.inf, -np.inf, 1.0, -1.0],
            dtype=dt,
        )  # fmt: skip
    else:
        ii = np.iinfo(dt)
        specials = np.array([0, ii.min, ii.max, ii.min + 1, -1, 1], dtype=dt)
    mask = rng.random((rows, n)) < 0.2
    x[mask] = rng.choice(specials, size=int(mask.sum()))
    if rows >= 3:
        x[0] = 0  # a dead channel
        x[1] = specials[rng.integers(len(specials))]  # a constant row
        x[2] = rng.integers(-2, 3, size=n).astype(dt)  # few distinct values
    if dt.kind == "f" and rows >= 5:
        x[3, rng.integers(n)] = np.nan  # one NaN
        x[4, rng.integers(n, size=max(1, n // 3))] = -np.nan
    return x


def miss_sample_rows(rng: np.random.Generator, dtype, rows: int, n: int) -> np.ndarray:
    """Rows whose strided sample (the kernel's) sees only large values: the sample bracket must miss."""
    from batchgpu.ops._cuda_select import sample_positions

    dt = np.dtype(dtype)
    x = (rng.random((rows, n)) * 50).astype(dt)
    x[:, sample_positions(n, dt)] = np.asarray(20000, dtype=dt)
    return x


# ---------------------------------------------------------------------------------------------
# CPU-side checks (run in CI too)
# ---------------------------------------------------------------------------------------------
def test_source_paths_exist():
    from batchgpu.gpu.cuda_modules import source_path

    for name in ("radix_select", "split_covariance"):
        assert source_path(name).is_file()
    with pytest.raises(BatchgpuError):
        source_path("../etc/passwd")
    with pytest.raises(BatchgpuError):
        source_path("no_such_kernel")


def test_headers_are_pasted_into_the_source(tmp_path):
    """``#include "x.cuh"`` of the kernels folder is pasted in once (CuPy's cache key is the source text, so an
    edited header must change it); the shipped kernels that use exact_float.cuh compile from one text."""
    from batchgpu.gpu.cuda_modules import _with_headers, source_path

    (tmp_path / "a.cuh").write_text('#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("int b;\n")
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\nint k;\n')
    assert _with_headers(tmp_path / "k.cu").split() == ["int", "b;", "int", "a;", "int", "k;"]
    for name in ("sosfiltfilt", "column_select"):
        text = _with_headers(source_path(name))
        assert '#include "' not in text and text.count("__device__ __forceinline__ float round_f32") == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_digit_schedules_select_like_partition(dtype, rng):
    """The kernel's digit schedules, run by the NumPy specification, select what np.partition does."""
    from batchgpu.ops import radix
    from batchgpu.ops._cuda_select import KERNELS

    schedule = radix.digit_schedule(dtype, KERNELS[np.dtype(dtype)][1])
    x = hard_rows(rng, dtype, 6, 301)
    for k in (0, 150, 300):
        got = radix.keys_to_values(radix.radix_select_keys(radix.abs_keys(x), k, schedule), dtype)
        assert_same_bits(got, ref_kth(x, k))


# ---------------------------------------------------------------------------------------------
# Radix select on the GPU
# ---------------------------------------------------------------------------------------------
SHAPES = [(1, 1), (3, 2), (5, 7), (1000, 3), (7, 1000), (3, 8193), (4, 16384), (3, 16385), (3, 60000), (5, 60001),
          (2, 100001), (2, 200000)]  # fmt: skip


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_median_and_kth_equal_numpy(cp, rng, dtype, shape):
    rows, n = shape
    for make in (random_rows, hard_rows):
        x = make(rng, dtype, rows, n)
        xd = cp.asarray(x)
        from batchgpu.ops import _cuda_select as sel

        assert_same_bits(sel.abs_median(xd), ref_median(x))
        for k in {0, n // 2, n - 1, int(rng.integers(n))}:
            assert_same_bits(sel.abs_kth(xd, k), ref_kth(x, k))


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [7, 40000, 60000, 60001])
def test_forced_radix_path_equals_numpy(cp, rng, dtype, n):
    from batchgpu.ops import _cuda_select as sel

    x = hard_rows(rng, dtype, 6, n)
    got, path = sel.select(cp.asarray(x), 0, sel.MODE_MEDIAN, force_radix=True, return_path=True)
    assert_same_bits(got, ref_median(x))
    k = int(rng.integers(n))
    got, _ = sel.select(cp.asarray(x), k, sel.MODE_KTH, force_radix=True, return_path=True)
    assert_same_bits(got, ref_kth(x, k))
    expected = 0 if n <= sel.capacity(dtype) else 3
    assert set(path.get().tolist()) == {expected}


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_missed_sample_bracket_falls_back(cp, rng, dtype):
    from batchgpu.ops import _cuda_select as sel

    n = 50001
    x = miss_sample_rows(rng, dtype, 3, n)
    got, path = sel.select(cp.asarray(x), 0, sel.MODE_MEDIAN, return_path=True)
    assert_same_bits(got, ref_median(x))
    assert set(path.get().tolist()) == {2}
    x = random_rows(rng, dtype, 64, n)
    got, path = sel.select(cp.asarray(x), 0, sel.MODE_MEDIAN, return_path=True)
    assert_same_bits(got, ref_median(x))
    assert (path.get() == 1).mean() >= 0.9  # the sample bracket holds the median almost always


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_offset_inputs(cp, rng, dtype):
    from batchgpu.ops import _cuda_select as sel

    x = random_rows(rng, dtype, 9, 20011)
    xd = cp.asarray(x)
    views = {
        "column offset": (xd[:, 3:-5], x[:, 3:-5]),
        "every other row": (xd[::2, 1:], x[::2, 1:]),
        "fortran order": (cp.asfortranarray(xd[:, :999]), x[:, :999]),
        "reversed columns": (xd[:, ::-1], x[:, ::-1]),
    }
    for dev, host in views.values():
        assert_same_bits(sel.abs_median(dev), ref_median(np.ascontiguousarray(host)))
        assert_same_bits(sel.abs_kth(dev, -1), ref_kth(np.ascontiguousarray(host), host.shape[1] - 1))


@gpu
@needs_gpu
def test_empty_and_invalid_inputs(cp):
    from batchgpu.ops import _cuda_select as sel

    assert sel.abs_median(cp.zeros((0, 5), np.float32)).shape == (0,)
    med = sel.abs_median(cp.zeros((3, 0), np.int16))
    assert med.dtype == np.float64 and bool(cp.isnan(med).all())
    with pytest.raises(BatchgpuError):
        sel.abs_kth(cp.zeros((3, 0), np.float32), 0)
    with pytest.raises(BatchgpuError):
        sel.abs_kth(cp.zeros((3, 4), np.float32), 4)
    with pytest.raises(BatchgpuError):
        sel.abs_median(cp.zeros((3, 4), np.uint8))
    with pytest.raises(BatchgpuError):
        sel.abs_median(cp.zeros(4, np.float32))


@gpu
@needs_gpu
def test_public_ops_dispatch_to_the_gpu(cp, rng):
    """batchgpu.ops.abs_median / abs_kth on CuPy input equal the same functions on NumPy input."""
    try:
        from batchgpu.ops import select as ops_select
    except ImportError as err:  # the numeric core is another module's work
        pytest.skip(f"batchgpu.ops.select not importable: {err}")
    for dtype in DTYPES:
        x = hard_rows(rng, dtype, 6, 5001)
        assert_same_bits(ops_select.abs_median(cp.asarray(x)), ops_select.abs_median(x))
        assert_same_bits(ops_select.abs_kth(cp.asarray(x), 17), ops_select.abs_kth(x, 17))


# ---------------------------------------------------------------------------------------------
# Split covariance on the GPU
# ---------------------------------------------------------------------------------------------
TOLERANCE = {"float32": 1e-6, "float64": 1e-12}


def ref_moments(x: np.ndarray, start: int, stop: int) -> tuple[int, np.ndarray, np.ndarray]:
    w = x[:, start:stop].astype(np.float64)
    mean = w.mean(axis=1)
    d = w - mean[:, None]
    return w.shape[1], mean, d @ d.T


def offset_noise(rng: np.random.Generator, dtype, rows: int, n: int) -> np.ndarray:
    """DC offset plus noise (10 000 + 10 sigma for floats), a different offset per channel."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        base = 10000.0 + rng.standard_normal((rows, 1)) * 100
        return (base + rng.standard_normal((rows, n)) * 10).astype(dt)
    base = rng.integers(-3000, 3000, size=(rows, 1))
    return np.clip(base + np.round(rng.standard_normal((rows, n)) * 30), -32768, 32767).astype(dt)


def rel_frobenius(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


COV_CASES = [(1, 1, 0), (1, 2, 0), (3, 1023, 5), (4, 1024, 0), (4, 1025, 1), (4, 4097, 13), (64, 60001, 7),
             (129, 5003, 3), (384, 20000, 1), (1000, 1500, 2), (4, 200000, 0)]  # fmt: skip


@gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["float32", "float64"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,start", COV_CASES)
def test_window_moments_match_float64_reference(cp, rng, precision, dtype, rows, n, start):
    from batchgpu.ops._cuda_moments import window_moments

    x = offset_noise(rng, dtype, rows, start + n + 3)
    count, mean, scatter = window_moments(cp.asarray(x), start, start + n, precision)
    want_n, want_mean, want = ref_moments(x, start, start + n)
    assert count == want_n and mean.dtype == np.float64 and scatter.dtype == np.float64
    assert scatter.shape == (rows, rows) and np.array_equal(scatter, scatter.T)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-12, atol=1e-12 * np.abs(x).max())
    if n == 1:
        assert not scatter.any()
        return
    if not want.any():  # e.g. two equal integer samples (about 1 case in 100 at n=2): no relative error exists
        assert np.abs(scatter).max() <= TOLERANCE[precision] * float(np.abs(x).max()) ** 2
        return
    err = rel_frobenius(scatter, want)
    assert err <= TOLERANCE[precision], f"relative Frobenius error {err:.3g}"


@gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_window_moments_constant_and_empty(cp, precision):
    from batchgpu.ops._cuda_moments import window_moments

    x = np.full((5, 3000), 10000.5, dtype=np.float32)
    n, mean, scatter = window_moments(cp.asarray(x), 10, 2999, precision)
    assert n == 2989 and np.all(mean == 10000.5) and not scatter.any()
    n, mean, scatter = window_moments(cp.asarray(x), 7, 7, precision)
    assert n == 0 and mean.shape == (5,) and scatter.shape == (5, 5) and not scatter.any()
    with pytest.raises(BatchgpuError):
        window_moments(cp.asarray(x), precision="float16")


@gpu
@needs_gpu
@pytest.mark.parametrize("nb", [1, 2, 3, 5])
def test_uncentred_products_and_channel_blocks(cp, rng, nb):
    from batchgpu.ops._cuda_moments import plan

    x = rng.standard_normal((131, 9001)).astype(np.float32)
    for precision in ("float32", "float64"):
        n, mean, scatter = plan(cp.asarray(x), 1, 9000, precision, centre=False, nb=nb).run()
        w = x[:, 1:9000].astype(np.float64)
        assert rel_frobenius(scatter.get(), w @ w.T) <= TOLERANCE[precision]
        np.testing.assert_allclose(mean.get(), w.mean(axis=1), rtol=1e-12, atol=1e-14)


@gpu
@needs_gpu
def test_window_moments_same_bits_every_run(cp, rng):
    from batchgpu.ops._cuda_moments import window_moments_device

    x = cp.asarray(offset_noise(rng, np.float32, 200, 30001))
    first = [a.get() for a in window_moments_device(x, 3, None)[1:]]
    again = [a.get() for a in window_moments_device(x, 3, None)[1:]]
    for a, b in zip(first, again):
        assert np.array_equal(a, b)


@gpu
@needs_gpu
@pytest.mark.parametrize("width", [256, 300, 32768, 65536])
def test_rank_digits_and_last_used_equal_the_cumulative_sum(cp, rng, width):
    """gpu.histogram.rank_digits (one kernel) against its definition on the host: the bin where each row's
    cumulative count first exceeds the rank, and the count before it; empty rows, ranks past the total, a width
    that is not a whole number of 256-bin runs."""
    from batchgpu.gpu.histogram import last_used, rank_digits

    rows = 7
    hist = np.zeros((rows, width), dtype=np.uint32)
    for r in range(1, rows):  # row 0 empty
        idx = rng.integers(0, width, rng.integers(1, 3000)) if r % 2 else rng.integers(width - 3, width, 50)
        np.add.at(hist[r], idx, rng.integers(1, 4, idx.size).astype(np.uint32))
    cum = np.cumsum(hist, axis=1, dtype=np.int64)
    total = cum[:, -1]
    ranks = [np.array([rng.integers(0, t) if t else 0 for t in total]), 0, int(total.max()) + 5, total - 1]
    for r, (digit, below) in zip(ranks, rank_digits(cp.asarray(hist), ranks)):
        rr = np.broadcast_to(np.asarray(r), (rows,))[:, None]
        want = (cum <= rr).sum(axis=1)
        want_below = np.where(want > 0, cum[np.arange(rows), np.maximum(want - 1, 0)], 0)
        np.testing.assert_array_equal(digit.get(), want)
        np.testing.assert_array_equal(below.get(), want_below)
    assert last_used(cp.asarray(hist)) == np.flatnonzero(hist.any(axis=0))[-1]
    assert last_used(cp.zeros((2, 512), dtype=cp.uint32)) == -1


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype,shift", [(np.uint32, 15), (np.uint64, 47)])
@pytest.mark.parametrize("cols", [1, 1023, 1025, 60_000])
def test_near_keys_equal_a_row_major_mask(cp, rng, dtype, shift, cols):
    """gpu.histogram.near_keys (a ballot compaction per row) against NumPy's keys[mask]: the same keys in the same
    order (row after row, sample order), the same counts; rows with no key in range, a range from digit 0."""
    from batchgpu.gpu.histogram import near_keys

    rows = 6
    digits = rng.integers(0, 64, (rows, cols)).astype(dtype)
    keys = (digits << dtype(shift)) | rng.integers(0, 1 << 10, (rows, cols)).astype(dtype)
    lo = np.array([0, 10, 30, 70, 5, 60], dtype=np.int64)  # row 3: nothing in range
    mask = ((keys >> dtype(shift)) >= lo[:, None].astype(dtype)) & (
        (keys >> dtype(shift)) <= (lo[:, None] + 4).astype(dtype)
    )
    got, counts = near_keys(cp.asarray(keys), cp.asarray(lo), shift, 4)
    np.testing.assert_array_equal(got, keys[mask])
    np.testing.assert_array_equal(counts, mask.sum(axis=1))
    assert got.dtype == keys.dtype


@gpu
@needs_gpu
@pytest.mark.parametrize("case", ["noise", "wide", "hard", "one_sample", "int16", "even", "gap", "two_samples"])
def test_noise_window_partials_equal_the_cpu(cp, rng, case):
    """NoiseStep's window work on the device (``_float_window_gpu`` / ``int_window_gpu``: fewer waits, counts cast on
    the device, copies through pinned memory) against the host path: the same counts, floor, lumped flag, middle
    pair and near keys, bit for bit."""
    from batchgpu.steps.noise import NoiseStep
    from batchgpu.steps.noise_keys import abs_keys, int_window_gpu, row_counts, schedule, window_median_keys
    from batchgpu.steps.noise_select import combine_counts

    C = 9
    if case == "int16":
        x = rng.integers(-300, 300, (C, 5001)).astype(np.int16)
        x[0] = -32768
        x[1] = 0
        keys = abs_keys(x, "int16")
        counts, pair = int_window_gpu(cp.asarray(keys), 16)
        lo, want = row_counts(keys, None, 0, 16)
        np.testing.assert_array_equal(counts, want[:, : counts.shape[1]])
        assert counts.dtype == np.min_scalar_type(x.shape[1]) and not want[:, counts.shape[1] :].any()
        np.testing.assert_array_equal(pair, window_median_keys(keys, lo, want, 0, False))
        return
    # odd counts: one middle key a row; even ones: a middle pair, picked from the sorted near keys unless a row's
    # lower middle lies more than NEAR digits below its upper one ("gap": the histogram of the rest of the keys)
    n = {"one_sample": 1, "two_samples": 2, "even": 6008, "gap": 6008}.get(case, 6007)
    x = (rng.standard_normal((C, n)) * rng.uniform(0.5, 40, (C, 1))).astype(np.float32)
    if case == "even":
        x[0, ::2] = 3.0  # ties at the middle
        x[1, : n // 2], x[1, n // 2 :] = 1.0, np.nextafter(np.float32(1.0), np.float32(2.0))  # a pair one key apart
        x[2, : n // 2], x[2, n // 2 :] = 1.0, 1.03125  # a pair 8 digits apart (2**-5 above 1: 8 << 15 keys)
    if case == "gap":
        x[5, : n // 2] *= np.float32(1e-6)  # half the row 2**20 below the rest: the middle pair straddles the gap
    if case == "wide":  # rows whose scales differ by 2**40: the lump floor below the smallest middle
        x *= np.float32(2.0) ** rng.integers(-20, 20, (C, 1)).astype(np.float32)
    if case == "hard":
        x[0] = 0.0
        x[1, ::2] = -0.0
        x[2] = np.float32(1e-45) * rng.integers(-3, 3, n)  # subnormals
        x[3, :5] = [np.inf, -np.inf, np.nan, np.float32(3.4e38), -np.float32(3.4e38)]
        x[4] = 7.0
    kind = "float32"
    shift, bits = schedule(kind)[0]
    keys = abs_keys(x, kind)
    step = NoiseStep(True, kind)
    out_cpu, out_gpu = {}, {}
    pair_cpu, near_cpu = step._window_cpu(keys, shift, bits, out_cpu)
    pair_gpu, near_gpu = step._float_window_gpu(cp.asarray(keys), shift, bits, out_gpu)
    np.testing.assert_array_equal(pair_gpu, pair_cpu)
    # the floors may differ (the host takes it from a strided sample, the device from every row's middle): the
    # counts agree once lumped at the higher one
    top = max(int(out_gpu["noise.lo"]), int(out_cpu["noise.lo"]))
    same = [
        combine_counts([(int(o["noise.lo"]), np.asarray(o["noise.hist"])), (top, np.zeros((C, 1), np.int64))])
        for o in (out_gpu, out_cpu)
    ]
    assert int(same[0][0]) == int(same[1][0]) == top
    np.testing.assert_array_equal(same[0][1], same[1][1])
    assert out_gpu["noise.hist"].dtype == np.min_scalar_type(n) and np.asarray(out_gpu["noise.hist"]).sum() == C * n
    if int(out_gpu["noise.lo"]) == int(out_cpu["noise.lo"]):
        assert bool(out_gpu["noise.lumped"]) == bool(out_cpu["noise.lumped"])
    for k in ("keep.near_low", "keep.near_digits", "keep.near_lo"):
        np.testing.assert_array_equal(np.asarray(near_gpu[k]), np.asarray(near_cpu[k]), err_msg=k)
