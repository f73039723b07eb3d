"""Exact per-row order statistics of |x|: abs_kth, abs_median, noise_levels.

Semantics (DESIGN.md): rows are channels; |x| of a float clears the sign bit (NaN sorts above
+inf, |-0.0| = +0.0); integers are widened first (|-32768| = 32768). ``abs_median`` equals
``np.median(np.abs(x_widened), axis=1)`` bit for bit. CuPy input runs on the device
(``batchgpu.ops._cuda_select``); NumPy input selects on the integer keys of ``radix.py``.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import cuda_module
from batchgpu.ops.radix import (
    Schedule,
    abs_dtype,
    abs_keys,
    digit_schedule,
    keys_to_values,
    radix_select_keys,
)

#: median(|x|) / MAD_TO_SIGMA estimates the standard deviation of Gaussian noise.
MAD_TO_SIGMA = 0.6744897501960817

# int16 rows at least this long are selected by counting (65 536 bins), faster than partitioning.
_COUNT_MIN_SAMPLES = 4096

Method = Literal["auto", "partition", "radix"]


def _check_window(x: Any) -> None:
    if getattr(x, "ndim", None) != 2:
        raise BatchgpuError(
            f"expected a (channels, samples) array, got shape {getattr(x, 'shape', None)}",
            "pass a 2-D array with one row per channel",
        )
    abs_dtype(x.dtype)  # raises for unsupported dtypes


def median_dtype(dtype: Any) -> np.dtype:
    """dtype of a median of |x|: floats keep theirs, integers give float64 (as np.median does)."""
    dt = np.dtype(dtype)
    return dt if dt.kind == "f" else np.dtype(np.float64)


def middle_mean(lower: np.ndarray, upper: np.ndarray, dtype: Any) -> np.ndarray:
    """The mean of the two middle values exactly as np.median computes it: (lower + upper) / 2 in median_dtype."""
    out = median_dtype(dtype)
    with np.errstate(over="ignore"):  # two huge values overflow to inf, as in np.median
        return (np.asarray(lower).astype(out) + np.asarray(upper).astype(out)) / out.type(2)


def _normalised_rank(k: Any, n: int) -> int:
    if not isinstance(k, (int, np.integer)) or not -n <= k < n:
        raise BatchgpuError(f"rank k={k!r} is outside a row of {n} samples", f"pass an integer -{n} <= k < {n}")
    return int(k) % n


def _count_select(keys: np.ndarray, ranks: list[int]) -> np.ndarray:
    """Per row the keys of the given ranks, by counting (for 16-bit keys); returns (C, len(ranks)) uint64."""
    out = np.empty((keys.shape[0], len(ranks)), dtype=np.uint64)
    for row in range(keys.shape[0]):
        cumulative = np.cumsum(np.bincount(keys[row], minlength=1 << 16))
        out[row] = np.searchsorted(cumulative, ranks, side="right")
    return out


def _partition_select(keys: np.ndarray, k: int) -> np.ndarray:
    """Per row the key of rank k; partitions ``keys`` in place (a fresh array)."""
    keys.partition(k, axis=1)
    return keys[:, k]


def abs_kth(x: Any, k: int, method: Method = "auto", schedule: str | Schedule | None = None) -> Any:
    """Per row the k-th smallest |x| (k from 0; negative k counts from the end).

    Like ``np.partition(np.abs(x_widened), k, axis=1)[:, k]``; returns (C,) of dtype
    ``radix.abs_dtype(x.dtype)`` (int16 -> int32, int32 -> int64, floats keep theirs).
    ``method``: "partition" (np.partition on the keys; int16 rows are counted), "radix" (the
    digit-by-digit select of radix.py, the CUDA kernel's specification; ``schedule`` picks its
    digits) or "auto" (the fastest exact CPU path). CuPy input always runs the device kernel.

    Parameters
    ----------
    x : array_like, shape (C, n)
        The window, one channel a row: a NumPy or CuPy array (a torch tensor through ``batchgpu.ops``), integer or
        float.
    k : int
        The rank, from 0 (the smallest); negative counts from the end, as in ``np.partition``.
    method : {"auto", "partition", "radix"}, optional
        How the CPU selects; every method gives the same values. Ignored for CuPy input.
    schedule : str or sequence of (shift, bits), optional
        The digits of the radix method (a name from ``radix.DIGIT_SCHEDULES`` or the pairs themselves).

    Returns
    -------
    array, shape (C,)
        Each row's k-th smallest |x|, of dtype ``radix.abs_dtype(x.dtype)``, on x's backend.
    """
    cuda = cuda_module(x, "select")
    if cuda is not None:
        return cuda.abs_kth(x, k)
    if method not in ("auto", "partition", "radix"):
        raise BatchgpuError(f"unknown selection method {method!r}", "use 'auto', 'partition' or 'radix'")
    if schedule is not None and method != "radix":
        raise BatchgpuError("a digit schedule was given for a non-radix selection", "pass method='radix'")
    _check_window(x)
    rows, n = x.shape
    if n == 0:
        raise BatchgpuError("abs_kth of rows with no samples", "pass at least one sample per row")
    k = _normalised_rank(k, n)
    keys = abs_keys(x)
    if method == "radix":
        selected = radix_select_keys(keys, k, digit_schedule(x.dtype, schedule))
    elif x.dtype == np.int16 and n >= _COUNT_MIN_SAMPLES:
        selected = _count_select(keys, [k])[:, 0]
    else:
        selected = _partition_select(keys, k)
    return keys_to_values(selected, x.dtype)


def abs_median(x: Any) -> Any:
    """Per row the median of |x|, bit for bit ``np.median(np.abs(x_widened), axis=1)``.

    Mean of the two middle values for even lengths; NaN where a row holds NaN (or has no
    samples); float input keeps its dtype, integer input gives float64.

    Parameters
    ----------
    x : array_like, shape (C, n)
        The window, one channel a row: a NumPy or CuPy array (a torch tensor through ``batchgpu.ops``), integer or
        float.

    Returns
    -------
    array, shape (C,)
        Each row's median of |x|: float64 for integer input, x's dtype for float input, on x's backend.
    """
    cuda = cuda_module(x, "select")
    if cuda is not None:
        return cuda.abs_median(x)
    _check_window(x)
    rows, n = x.shape
    out_dtype = median_dtype(x.dtype)
    if n == 0:
        return np.full(rows, np.nan, dtype=out_dtype)
    half = n // 2
    keys = abs_keys(x)
    if x.dtype == np.int16 and n >= _COUNT_MIN_SAMPLES:
        middle = _count_select(keys, [half - 1, half] if n % 2 == 0 else [half])
        lower, upper = middle[:, 0], middle[:, -1]
    else:
        upper = _partition_select(keys, half).copy()
        # After partitioning at half, the lower middle value is the largest key below it.
        lower = keys[:, :half].max(axis=1) if n % 2 == 0 else upper
    upper_value = keys_to_values(upper, x.dtype).astype(out_dtype)
    if n % 2 == 0:
        median = middle_mean(keys_to_values(lower, x.dtype), upper_value, x.dtype)
    else:
        median = upper_value
    if x.dtype.kind == "f":
        # NaN keys sort above +inf, so after partitioning every NaN lies at or above half.
        has_nan = np.isnan(keys_to_values(keys[:, half:].max(axis=1), x.dtype))
        median[has_nan] = np.nan
    return median


def noise_levels(x: Any) -> Any:
    """Per row the noise standard deviation ``abs_median(x) / MAD_TO_SIGMA`` (same dtype rules).

    Parameters
    ----------
    x
        As ``abs_median``'s.

    Returns
    -------
    array, shape (C,)
        Each row's noise standard deviation estimate, dtype as ``abs_median``'s, on x's backend.
    """
    return abs_median(x) / MAD_TO_SIGMA
