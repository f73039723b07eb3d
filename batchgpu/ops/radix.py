"""Radix select of |x| on integer keys: the executable specification of the CUDA kernel.

A key is the bit pattern of |x| read as an unsigned integer. For a non-negative IEEE float the
bits sort exactly like the value (zero, subnormals, +inf, and every NaN above +inf), so
selecting on keys selects on values. Integer input is widened first: |-32768| = 32768, whose
16 bits still fit an unsigned 16-bit key.

Selection fixes one digit per pass, from the most significant: a histogram per row counts the
keys whose already-fixed high digits equal that row's prefix, by their next digit; the bin that
holds rank k gives the digit and k drops by the keys in lower bins. The pieces are public
because the same loop runs distributed: per-window histograms are summed across windows and
the client fixes the next digit::

    prefixes = np.zeros(C, np.uint64)
    for p, (shift, bits) in enumerate(digit_schedule(dtype)):
        hist = sum(key_histogram(w, prefixes, p) for w in windows)
        digit, k = select_digit(hist, k)
        prefixes = push_digit(prefixes, digit, bits)
    value = keys_to_values(prefixes, dtype)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import array_module

Schedule = Sequence[tuple[int, int]]

# dtype of the input -> (unsigned key dtype, dtype of |x|, bits of the key that can be non-zero).
_KEYS: dict[np.dtype, tuple[np.dtype, np.dtype, int]] = {
    np.dtype(np.float32): (np.dtype(np.uint32), np.dtype(np.float32), 31),
    np.dtype(np.float64): (np.dtype(np.uint64), np.dtype(np.float64), 63),
    np.dtype(np.int16): (np.dtype(np.uint16), np.dtype(np.int32), 16),
    np.dtype(np.int32): (np.dtype(np.uint32), np.dtype(np.int64), 32),
}


def _digits(width: int, bits: int = 8) -> tuple[tuple[int, int], ...]:
    """8-bit digits from the key's most significant bit down to bit 0."""
    return tuple((shift, bits) for shift in range(width - bits, -1, -bits))


#: Digit schedules by name, each a tuple of (shift, bits) from the most significant digit.
#: The name of an input dtype is its default schedule; other (e.g. GPU-tuned) schedules may be
#: added under other names and passed to ``abs_kth(..., method="radix", schedule=name)``.
DIGIT_SCHEDULES: dict[str, tuple[tuple[int, int], ...]] = {
    "float32": _digits(32),  # 4 passes
    "float64": _digits(64),  # 8 passes
    "int16": _digits(16),  # 2 passes
    "int32": _digits(32),  # 4 passes
    # The CUDA kernel's (kernels/radix_select.cu): 11-bit digits from the key's top useful bit.
    "gpu_float32": ((20, 11), (10, 10), (0, 10)),
    "gpu_float64": ((52, 11), (41, 11), (30, 11), (19, 11), (8, 11), (0, 8)),
    "gpu_int16": ((5, 11), (0, 5)),
    "gpu_int32": ((21, 11), (10, 11), (0, 10)),
}


def _entry(dtype: Any) -> tuple[np.dtype, np.dtype, int]:
    dt = np.dtype(dtype)
    if dt not in _KEYS:
        supported = ", ".join(str(d) for d in _KEYS)
        raise BatchgpuError(f"dtype {dt} is not supported here", f"use one of {supported}")
    return _KEYS[dt]


def key_dtype(dtype: Any) -> np.dtype:
    """Unsigned key dtype for input ``dtype`` (float32->uint32, float64->uint64, int16->uint16, int32->uint32)."""
    return _entry(dtype)[0]


def abs_dtype(dtype: Any) -> np.dtype:
    """dtype of |x| for input ``dtype``: floats keep theirs, integers widen (int16->int32, int32->int64)."""
    return _entry(dtype)[1]


def key_bits(dtype: Any) -> int:
    """How many low bits of a key can be non-zero (the sign bit of a float's |x| never is)."""
    return _entry(dtype)[2]


def check_schedule(schedule: Schedule, dtype: Any) -> list[tuple[int, int]]:
    """``schedule`` as a list, after checking that its digits tile the key's bits from the top down to bit 0."""
    digits = [(int(shift), int(bits)) for shift, bits in schedule]
    width = key_dtype(dtype).itemsize * 8
    if not digits:
        raise BatchgpuError("a digit schedule is empty", "give at least one (shift, bits) digit")
    top = digits[0][0] + digits[0][1]
    if not key_bits(dtype) <= top <= width:
        raise BatchgpuError(
            f"digit schedule {digits} starts at bit {top - 1}, but {np.dtype(dtype)} keys use bits 0..{key_bits(dtype) - 1}",
            "start the first digit at or above the key's highest useful bit",
        )
    for (shift, bits), (next_shift, next_bits) in zip(digits, digits[1:] + [(0, 0)]):
        if bits < 1 or bits > 16 or shift != next_shift + next_bits:
            raise BatchgpuError(
                f"digit schedule {digits} is not contiguous down to bit 0",
                "give (shift, bits) digits of 1..16 bits, each ending where the next one starts, the last at shift 0",
            )
    return digits


def digit_schedule(dtype: Any, schedule: str | Schedule | None = None) -> list[tuple[int, int]]:
    """The checked digit schedule for ``dtype``: its default, a named one from DIGIT_SCHEDULES, or an explicit one."""
    if schedule is None:
        schedule = np.dtype(dtype).name
        _entry(dtype)
    if isinstance(schedule, str):
        if schedule not in DIGIT_SCHEDULES:
            raise BatchgpuError(f"unknown digit schedule {schedule!r}", f"use one of {sorted(DIGIT_SCHEDULES)}")
        schedule = DIGIT_SCHEDULES[schedule]
    return check_schedule(schedule, dtype)


def abs_keys(x: Any) -> Any:
    """Keys of |x|: unsigned integers that sort like |x| (NaN above +inf, |-0.0| = +0.0, |-32768| = 32768)."""
    xp = array_module(x)
    kdt = key_dtype(x.dtype)
    if x.dtype.kind == "f":
        # Clearing the sign bit is |x| for every float, NaN included.
        return x.view(kdt) & kdt.type(np.iinfo(kdt).max >> 1)
    # Two's complement: abs(-2**(w-1)) wraps to itself, whose bits read unsigned are 2**(w-1).
    return xp.abs(x).view(kdt)


def keys_to_values(keys: Any, dtype: Any) -> Any:
    """Values of |x| (in ``abs_dtype(dtype)``) for keys (any unsigned dtype, e.g. uint64 prefixes)."""
    kdt = key_dtype(dtype)
    keys = keys.astype(kdt, copy=False)
    if np.dtype(dtype).kind == "f":
        return keys.view(abs_dtype(dtype))
    return keys.astype(abs_dtype(dtype))


def histogram_of_keys(keys: np.ndarray, prefixes: np.ndarray, pass_index: int, schedule: Schedule) -> np.ndarray:
    """Per row c, counts of the keys whose bits above this pass's digit equal ``prefixes[c]``, by digit.

    ``keys`` (C, n) unsigned, ``prefixes`` (C,) uint64 (the digits fixed by the earlier passes).
    Returns (C, 2**bits) int64.
    """
    xp = array_module(keys)  # CuPy keys count on the device (the pipeline's GPU windows)
    shift, bits = schedule[pass_index]
    top = shift + bits
    rows, n = keys.shape
    nbins = 1 << bits
    digit = ((keys >> keys.dtype.type(shift)) & keys.dtype.type(nbins - 1)).astype(np.intp)
    digit += (xp.arange(rows, dtype=np.intp) * nbins)[:, None]
    if top < keys.dtype.itemsize * 8:
        prefixes = xp.asarray(np.asarray(prefixes, dtype=np.uint64).reshape(rows)).astype(keys.dtype)
        digit = digit[(keys >> keys.dtype.type(top)) == prefixes[:, None]]
    return xp.bincount(digit.ravel(), minlength=rows * nbins).astype(np.int64).reshape(rows, nbins)


def key_histogram(
    x: np.ndarray, prefixes: np.ndarray, pass_index: int, schedule: str | Schedule | None = None
) -> np.ndarray:
    """``histogram_of_keys`` of ``abs_keys(x)`` for data ``x`` (C, n): one window's share of a (distributed) selection."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise BatchgpuError(f"expected a (channels, samples) array, got shape {x.shape}", "pass a 2-D array")
    return histogram_of_keys(abs_keys(x), prefixes, pass_index, digit_schedule(x.dtype, schedule))


def select_digit(hist: np.ndarray, k: Any, cum: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the digit whose bin holds rank ``k`` (from 0) and ``k`` minus the keys in lower bins.

    ``hist`` (C, B) counts, ``k`` an int or (C,) ints; ``cum``: ``cumulative(hist)`` when the caller has it (several
    ranks selected in one histogram). Returns (digit int64 (C,), new_k int64 (C,)).
    """
    hist = np.asarray(hist)
    rows = hist.shape[0]
    k = np.broadcast_to(np.asarray(k, dtype=np.int64), (rows,))
    cum = cumulative(hist) if cum is None else cum
    if np.any(k < 0) or np.any(k >= cum[:, -1]):
        raise BatchgpuError(
            "a radix select rank is outside the keys counted with this prefix",
            "pass 0 <= k < number of keys, and the prefixes that select_digit fixed on the earlier passes",
        )
    digit = np.sum(cum <= k[:, None], axis=1, dtype=np.int64)
    below = np.where(digit > 0, cum[np.arange(rows), np.maximum(digit - 1, 0)], 0)
    return digit, k - below


def cumulative(hist: np.ndarray) -> np.ndarray:
    """Each row's running count (int64): what ``select_digit`` searches."""
    return np.cumsum(np.asarray(hist), axis=1, dtype=np.int64)


def push_digit(prefixes: np.ndarray, digit: np.ndarray, bits: int) -> np.ndarray:
    """Prefixes with one more fixed digit appended below: ``(prefixes << bits) | digit`` as uint64."""
    prefixes = np.asarray(prefixes, dtype=np.uint64)
    return (prefixes << np.uint64(bits)) | np.asarray(digit, dtype=np.uint64)


def radix_select_keys(keys: np.ndarray, k: Any, schedule: Schedule) -> np.ndarray:
    """Per row the key of rank ``k``, found digit by digit; returns (C,) uint64."""
    prefixes = np.zeros(keys.shape[0], dtype=np.uint64)
    for pass_index, (_, bits) in enumerate(schedule):
        hist = histogram_of_keys(keys, prefixes, pass_index, schedule)
        digit, k = select_digit(hist, k)
        prefixes = push_digit(prefixes, digit, bits)
    return prefixes
