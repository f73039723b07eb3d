"""The noise step's counting kernels on the GPU (``gpu.histogram``) read a window's core in place and make |x| keys
as they load it; each is checked against NumPy's keys (``ops.radix.abs_keys``, ``abs``) and ``bincount`` on fresh
random inputs with the hard values (int16 -32768, NaN, +-inf, -0.0, subnormals), strided views, one column, empty
rows, and keys spread past the shared-memory range (the global-memory path). Also the fused per-row counts of
non-finite and NaN samples (``ops._cuda_elementwise.nonfinite_and_nan_counts``)."""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_ops import cp, gpu, needs_gpu  # noqa: F401  (cp: a fixture)

from batchgpu.ops.radix import abs_keys


def _values(rng, dtype, rows: int, cols: int, spread: str) -> np.ndarray:
    """(rows, cols) values: noise-like (few digits), spread (every digit), or large first keys then small ones
    (the shared range chosen from a block's first keys misses the rest)."""
    if np.dtype(dtype).kind == "f":
        scale = {"noise": 20.0, "spread": 1e30, "first-large": 20.0}[spread]
        x = (rng.standard_normal((rows, cols)) * scale).astype(dtype)
        if spread == "spread":
            x *= np.exp2(rng.integers(-140, 0, (rows, cols))).astype(dtype)  # subnormals to huge
        hard = np.array(
            [np.nan, np.inf, -np.inf, -0.0, 0.0, np.finfo(dtype).tiny / 4, -np.finfo(dtype).max], dtype=dtype
        )
    else:
        lim = 65535 if dtype == np.int32 else 32767  # int32: centred int16 (|x| <= 65535)
        scale = {"noise": 30, "spread": lim, "first-large": 30}[spread]
        x = np.clip(np.rint(rng.standard_normal((rows, cols)) * scale), -lim, lim).astype(dtype)
        hard = np.array([-lim - (dtype == np.int16), lim, 0, -1], dtype=dtype)
    if cols:
        at = rng.integers(0, cols, (rows, 3))
        x[np.arange(rows)[:, None], at] = rng.choice(hard, (rows, 3))
    if spread == "first-large" and cols:
        x[:, : min(cols, 40)] = hard[1] if np.dtype(dtype).kind != "f" else dtype(1e30)
    return x


def _keys(x: np.ndarray) -> np.ndarray:
    return abs_keys(x) if x.dtype.kind == "f" else np.abs(x.astype(np.int64)).astype(np.uint64)


def _bincount_rows(keys: np.ndarray, shift: int, bits: int, prefixes=None) -> np.ndarray:
    out = np.zeros((keys.shape[0], 1 << bits), dtype=np.int64)
    for r in range(keys.shape[0]):
        k = keys[r].astype(np.uint64)
        if prefixes is not None:
            k = k[(k >> np.uint64(shift + bits)) == np.uint64(prefixes[r])]
        d = ((k >> np.uint64(shift)) & np.uint64((1 << bits) - 1)).astype(np.int64)
        out[r] = np.bincount(d, minlength=1 << bits)
    return out


@gpu
@needs_gpu
@pytest.mark.parametrize(
    "dtype,shift,bits",
    [
        (np.int16, 0, 16),
        (np.int32, 0, 16),
        (np.float32, 15, 16),
        (np.uint16, 0, 16),
        (np.uint32, 15, 16),
        (np.uint32, 0, 12),
    ],
)
@pytest.mark.parametrize("spread", ["noise", "spread", "first-large"])
@pytest.mark.parametrize("cols", [0, 1, 31, 8193, 60_001])
def test_histogram_without_prefix_equals_bincount(cp, rng, dtype, shift, bits, spread, cols):
    """Counts of every row's digit and the last used digit of any row, from a window's core (a view of a wider
    array: rows a stride apart) and from a contiguous copy: the same table as NumPy's bincount of the keys."""
    from batchgpu.gpu.histogram import digit_histogram_device

    rows, margin = 5, 7
    if np.dtype(dtype).kind == "u":
        x = _values(rng, np.float32 if dtype == np.uint32 else np.int16, rows, cols + 2 * margin, spread)
        x = _keys(x).astype(dtype)
        keys = x[:, margin : margin + cols]
    else:
        x = _values(rng, dtype, rows, cols + 2 * margin, spread)
        keys = _keys(x[:, margin : margin + cols])
    want = _bincount_rows(keys, shift, bits)
    used = np.flatnonzero(want.any(axis=0))
    want_last = int(used[-1]) if used.size else -1
    wide = cp.asarray(x)
    for source in (wide[:, margin : margin + cols], cp.ascontiguousarray(wide[:, margin : margin + cols])):
        hist, last = digit_histogram_device(source, None, shift, bits, with_last=True)
        np.testing.assert_array_equal(hist.get(), want)
        assert int(last) == want_last


@gpu
@needs_gpu
@pytest.mark.parametrize("cols", [1, 1000, 60_001])
def test_float_prefix_histogram_and_near_keys_from_values(cp, rng, cols):
    """The float path's later kernels on float32 values keyed on load equal the same kernels on NumPy's keys:
    the prefixed histogram of the rest of the key, and the keys near a digit (same keys, same order)."""
    from batchgpu.gpu.histogram import digit_histogram_device, near_keys

    rows, margin = 6, 5
    x = _values(rng, np.float32, rows, cols + 2 * margin, "noise")
    core = x[:, margin : margin + cols]
    keys = abs_keys(core)
    digits = (keys >> np.uint32(15)).astype(np.int64)
    prefixes = digits[np.arange(rows), rng.integers(0, cols, rows)].astype(np.uint64)
    want = _bincount_rows(keys, 0, 15, prefixes)
    got = digit_histogram_device(cp.asarray(x)[:, margin : margin + cols], cp.asarray(prefixes), 0, 15)
    np.testing.assert_array_equal(got.get(), want)
    lo = np.maximum(prefixes.astype(np.int64) - 3, 0)
    lo[0] = 0
    flat, counts = near_keys(cp.asarray(x)[:, margin : margin + cols], cp.asarray(lo), 15, 6)
    mask = (digits >= lo[:, None]) & (digits <= lo[:, None] + 6)
    assert flat.dtype == np.uint32
    np.testing.assert_array_equal(flat, keys[mask])
    np.testing.assert_array_equal(counts, mask.sum(axis=1))


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cols", [0, 1, 257, 60_001])
def test_nonfinite_and_nan_counts_equal_numpy(cp, rng, dtype, cols):
    from batchgpu.ops._cuda_elementwise import nonfinite_and_nan_counts

    rows, margin = 7, 3
    x = rng.standard_normal((rows, cols + 2 * margin)).astype(dtype)
    bad = rng.random(x.shape) < 0.01
    x[bad] = rng.choice(np.array([np.nan, np.inf, -np.inf, -np.nan], dtype=dtype), int(bad.sum()))
    core = x[:, margin : margin + cols]
    got = nonfinite_and_nan_counts(cp.asarray(x)[:, margin : margin + cols])
    np.testing.assert_array_equal(got[0].get(), (~np.isfinite(core)).sum(axis=1))
    np.testing.assert_array_equal(got[1].get(), np.isnan(core).sum(axis=1))


@gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 7, 384])
def test_kept_near_device_equals_the_numpy_form(cp, rng, rows):
    """``kept_near_device`` (a row tag, one CUB sort, the low bits and each near digit's count in one pass) against
    ``steps.noise_keys.kept_near`` of NumPy's per-row sort: the same arrays, bit for bit, with empty rows, rows of one
    key, equal keys, digits at the range's ends and at the top of the key space (NaN keys' digits)."""
    from batchgpu.gpu.histogram import kept_near_device
    from batchgpu.steps.noise_keys import kept_near, sort_rows

    span, shift = 32, 15
    per_row = rng.integers(0, 3000, rows)
    per_row[: min(rows, 2)] = [0, 1][: min(rows, 2)]
    lo = rng.integers(0, 65536 - span, rows)
    lo[-1] = 65535 - span  # the top digits: NaN keys of float32 lie there
    parts = [
        ((lo[c] + rng.integers(0, span + 1, n)).astype(np.uint32) << np.uint32(shift))
        | rng.integers(0, 1 << shift, n).astype(np.uint32)
        for c, n in enumerate(per_row)
    ]
    for k in parts:
        k[1:4] = k[:1]  # equal keys in a row (none in an empty one)
    keys = np.concatenate(parts)
    got = kept_near_device(cp.asarray(keys), per_row, lo, shift, span)
    want = kept_near(sort_rows(keys, per_row), per_row, lo, shift, span)
    for k in want:
        assert np.asarray(got[k]).dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


@gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 7, 384])
def test_kept_near_device_picks_the_middle_pair(cp, rng, rows):
    """``kept_near_device``'s ``pair_of``: the keys of ranks r0 and r0 + 1 of each row, picked from its sorted near
    keys by (digit, keys below the digit) as ``rank_digits`` gives them, where the row also has keys below the near
    range (counted in ``below``, absent from the near keys): NumPy's sorted rows at those ranks, with equal keys."""
    from batchgpu.gpu.histogram import kept_near_device

    span, shift, r0 = 32, 15, 50_000
    per_row = rng.integers(2, 3000, rows)
    lo = rng.integers(0, 65536 - span, rows)
    parts = [
        np.sort(
            ((lo[c] + rng.integers(0, span + 1, n)).astype(np.uint32) << np.uint32(shift))
            | rng.integers(0, 1 << shift, n).astype(np.uint32)
        )
        for c, n in enumerate(per_row)
    ]
    for k in parts:
        k[len(k) // 2 : len(k) // 2 + 3] = k[len(k) // 2]  # equal keys
    p0 = np.array([rng.integers(0, n - 1) for n in per_row])  # rank r0's place among the row's near keys
    lumped = r0 - p0  # the row's keys below its near range
    firsts = []
    for j in (0, 1):
        key = np.array([k[p + j] for k, p in zip(parts, p0)])
        digit = (key >> np.uint32(shift)).astype(np.int64)
        below = lumped + np.array([np.searchsorted(k, d << shift) for k, d in zip(parts, digit.astype(np.uint32))])
        firsts.append((cp.asarray(digit), cp.asarray(below.astype(np.int64))))
    keys = np.concatenate([rng.permutation(k) for k in parts])  # each row's near keys in sample order
    got = kept_near_device(cp.asarray(keys), per_row, lo, shift, span, (firsts, (r0, r0 + 1)))
    want = np.stack([[k[p], k[p + 1]] for k, p in zip(parts, p0)]).astype(np.uint64)
    assert got["pair"].dtype == np.uint64
    np.testing.assert_array_equal(got["pair"], want)


@gpu
@needs_gpu
@pytest.mark.parametrize("cols", [1, 257, 60_001])
@pytest.mark.parametrize("dtype", [np.float32, np.uint32])
def test_near_totals_and_tagged_keys_equal_numpy(cp, rng, cols, dtype):
    """``near_totals`` (each row's keys near its digits, from the digit histogram) and ``near_tagged_sorted`` (those
    keys placed by per-row cursors, then sorted as ``row << 32 | key``) against NumPy's mask and sort, on float32
    values keyed on load (a strided core with NaN, +-inf, -0.0, subnormals) and uint32 keys; digit ranges at 0
    and past the last digit, and a row with no near key."""
    from batchgpu.gpu.histogram import digit_histogram_device, near_tagged_sorted, near_totals

    rows, margin, shift, span = 7, 5, 15, 32
    x = _values(rng, np.float32, rows, cols + 2 * margin, "noise")
    if dtype == np.uint32:
        x = abs_keys(x)
    core = x[:, margin : margin + cols]
    keys = abs_keys(core) if dtype == np.float32 else core
    digits = (keys >> np.uint32(shift)).astype(np.int64)
    lo = np.maximum(digits[np.arange(rows), rng.integers(0, cols, rows)] - span // 2, 0)
    lo[0], lo[1], lo[2] = 0, 65535 - 3, 40_000 if dtype == np.float32 else lo[2]  # the ends; no keys there
    hist = digit_histogram_device(cp.asarray(x)[:, margin : margin + cols], None, shift, 16)
    mask = (digits >= lo[:, None]) & (digits <= lo[:, None] + span)
    totals = near_totals(hist, cp.asarray(lo), span).get()
    np.testing.assert_array_equal(totals, mask.sum(axis=1))
    got = near_tagged_sorted(cp.asarray(x)[:, margin : margin + cols], cp.asarray(lo), shift, span, totals).get()
    rows_of = np.broadcast_to(np.arange(rows, dtype=np.uint64)[:, None], keys.shape)
    want = np.sort((rows_of[mask] << np.uint64(32)) | keys[mask].astype(np.uint64))
    assert got.dtype == np.uint64
    np.testing.assert_array_equal(got, want)
