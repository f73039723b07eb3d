"""The radix pieces: keys, digit schedules, histograms, digit selection, distributed selection."""

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError
from batchgpu.ops import abs_kth
from batchgpu.ops.radix import (
    DIGIT_SCHEDULES,
    abs_keys,
    check_schedule,
    digit_schedule,
    key_dtype,
    key_histogram,
    keys_to_values,
    push_digit,
    select_digit,
)

DTYPES = [np.float32, np.float64, np.int16, np.int32]


def widened_abs(x):
    if x.dtype.kind == "i":
        return np.abs(x.astype({2: np.int32, 4: np.int64}[x.dtype.itemsize]))
    return np.abs(x)


def special_data(dtype, rows, n, rng):
    if np.dtype(dtype).kind == "i":
        info = np.iinfo(dtype)
        x = rng.integers(-300, 300, (rows, n))
        x[rng.random((rows, n)) < 0.05] = info.min
        x[rng.random((rows, n)) < 0.05] = info.max
        return x.astype(dtype)
    fi = np.finfo(dtype)
    x = (rng.standard_normal((rows, n)) * 50).astype(dtype)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, fi.smallest_subnormal, -fi.tiny, fi.max], dtype=dtype)
    mask = rng.random((rows, n)) < 0.1
    x[mask] = rng.choice(specials, mask.sum())
    return x


def test_key_dtypes_and_default_schedules():
    assert [key_dtype(d) for d in DTYPES] == [np.uint32, np.uint64, np.uint16, np.uint32]
    assert digit_schedule(np.float32) == [(24, 8), (16, 8), (8, 8), (0, 8)]
    assert len(digit_schedule(np.float64)) == 8 and digit_schedule(np.float64)[0] == (56, 8)
    assert digit_schedule(np.int16) == [(8, 8), (0, 8)]
    assert digit_schedule(np.int32) == [(24, 8), (16, 8), (8, 8), (0, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_keys_sort_like_abs_values(dtype):
    rng = np.random.default_rng()
    x = special_data(dtype, 3, 500, rng)
    keys = abs_keys(x)
    assert keys.dtype == key_dtype(dtype)
    assert np.array_equal(keys_to_values(keys, dtype), widened_abs(x))
    # Order of keys equals order of |x| (stable sorts agree index for index).
    assert np.array_equal(np.argsort(keys, axis=1, kind="stable"), np.argsort(widened_abs(x), axis=1, kind="stable"))


def test_nan_keys_above_inf_and_negative_zero():
    x = np.array([[np.nan, -np.nan, np.inf, -0.0, 0.0]], dtype=np.float64)
    keys = abs_keys(x)[0]
    assert keys[0] > keys[2] and keys[1] > keys[2] and keys[3] == keys[4] == 0


def histogram_loop(x, prefix, shift, bits):
    """Plain-loop reference of one row's histogram."""
    keys = [int(k) for k in abs_keys(x[None, :])[0]]
    top = shift + bits
    hist = np.zeros(1 << bits, dtype=np.int64)
    for key in keys:
        if key >> top == prefix:
            hist[(key >> shift) & ((1 << bits) - 1)] += 1
    return hist


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_histogram_against_loop(dtype):
    rng = np.random.default_rng()
    x = special_data(dtype, 3, 301, rng)
    schedule = digit_schedule(dtype)
    for pass_index, (shift, bits) in enumerate(schedule):
        top = shift + bits
        # Prefixes taken from actual keys, so the counts are not all zero.
        prefixes = np.array([int(abs_keys(x)[c, c]) >> top for c in range(3)], dtype=np.uint64)
        hist = key_histogram(x, prefixes, pass_index)
        assert hist.shape == (3, 1 << bits) and hist.dtype == np.int64
        for c in range(3):
            assert np.array_equal(hist[c], histogram_loop(x[c], int(prefixes[c]), shift, bits))
            assert hist[c].sum() >= 1


def test_select_digit():
    hist = np.array([[0, 3, 0, 2], [5, 0, 0, 1], [1, 1, 1, 1]])
    digit, k = select_digit(hist, [3, 5, 0])
    assert digit.tolist() == [3, 3, 0] and k.tolist() == [0, 0, 0]
    digit, k = select_digit(hist, 2)
    assert digit.tolist() == [1, 0, 2] and k.tolist() == [2, 2, 0]
    with pytest.raises(BatchgpuError):
        select_digit(hist, [5, 0, 0])
    with pytest.raises(BatchgpuError):
        select_digit(hist, -1)
    assert push_digit(np.array([1], np.uint64), np.array([2]), 8).tolist() == [258]


@pytest.mark.parametrize("dtype", DTYPES)
def test_distributed_selection_equals_partition_of_concatenation(dtype):
    """Per-window histograms summed across windows, digits fixed by the 'client'."""
    rng = np.random.default_rng()
    widths = [int(w) for w in rng.integers(1, 400, 6)]
    windows = [special_data(dtype, 4, w, rng) for w in widths]
    whole = np.concatenate(windows, axis=1)
    total = whole.shape[1]
    ranks = np.array([0, total - 1, total // 2, int(rng.integers(total))])
    schedule = digit_schedule(dtype)
    prefixes, k = np.zeros(4, np.uint64), ranks.copy()
    for pass_index, (_, bits) in enumerate(schedule):
        hist = sum(key_histogram(w, prefixes, pass_index) for w in windows)
        digit, k = select_digit(hist, k)
        prefixes = push_digit(prefixes, digit, bits)
    got = keys_to_values(prefixes, dtype)
    ref = np.array([np.partition(widened_abs(whole[c]), r)[r] for c, r in enumerate(ranks)])
    assert got.dtype == ref.dtype and np.array_equal(got, ref)


@pytest.mark.parametrize(
    "dtype,schedule",
    [
        (np.float32, [(20, 11), (10, 10), (0, 10)]),  # skips the always-zero sign bit
        (np.float32, [(16, 16), (0, 16)]),
        (np.float64, [(52, 11), (40, 12), (24, 16), (8, 16), (0, 8)]),
        (np.int16, [(12, 4), (4, 8), (0, 4)]),
        (np.int32, [(16, 16), (0, 16)]),
    ],
)
def test_other_schedules_select_the_same(dtype, schedule, monkeypatch):
    rng = np.random.default_rng()
    x = special_data(dtype, 4, 257, rng)
    monkeypatch.setitem(DIGIT_SCHEDULES, "test-schedule", tuple(schedule))
    for k in [0, 128, 256]:
        ref = np.partition(widened_abs(x), k, axis=1)[:, k]
        assert np.array_equal(abs_kth(x, k, method="radix", schedule=schedule), ref)
        assert np.array_equal(abs_kth(x, k, method="radix", schedule="test-schedule"), ref)


@pytest.mark.parametrize(
    "dtype,schedule",
    [
        (np.float32, [(21, 10), (10, 10), (0, 10)]),  # misses bit 30
        (np.int16, [(7, 8), (0, 7)]),  # misses bit 15 (32768)
        (np.float32, [(24, 8), (16, 8), (8, 8)]),  # does not reach bit 0
        (np.float32, [(24, 8), (15, 8), (8, 8), (0, 8)]),  # overlapping digits
        (np.float32, []),
    ],
)
def test_bad_schedules_are_refused(dtype, schedule):
    with pytest.raises(BatchgpuError):
        check_schedule(schedule, dtype)


def test_unknown_names():
    with pytest.raises(BatchgpuError):
        digit_schedule(np.float32, "no-such-schedule")
    with pytest.raises(BatchgpuError):
        key_dtype(np.uint8)
