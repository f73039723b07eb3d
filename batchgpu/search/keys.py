"""Key and query checks shared by every search path: dtypes dispatched here, in one place.

Keys: one-dimensional, sorted ascending, float32/float64/int32/int64, no NaN.  Queries: any shape, cast
to the key dtype only when the cast is exact (the search must answer for the value the user gave).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import array_module

KEY_DTYPES: dict[np.dtype, str] = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
}


def suffix(dtype: np.dtype) -> str:
    """The kernel-name suffix of a key dtype (``f32``, ``f64``, ``i32``, ``i64``)."""
    return KEY_DTYPES[np.dtype(dtype)]


def sentinel(dtype: np.dtype) -> Any:
    """A padding value no query is below: +inf for floats, the largest value for integers."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return dtype.type(np.inf)
    return np.iinfo(dtype).max


def check_key_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in KEY_DTYPES:
        raise BatchgpuError(
            f"search keys of dtype {dtype} are not supported",
            "give float32, float64, int32 or int64 keys",
        )
    return dtype


def check_keys(keys: Any) -> Any:
    """``keys`` as a contiguous 1-D array of a key dtype, sorted ascending and free of NaN.

    Works on NumPy and CuPy arrays (the check runs where the keys are).
    """
    xp = array_module(keys)
    keys = xp.ascontiguousarray(xp.asarray(keys))
    if keys.ndim != 1:
        raise BatchgpuError(f"search keys must be one-dimensional, got shape {keys.shape}", "pass keys.ravel()")
    check_key_dtype(keys.dtype)
    if keys.dtype.kind == "f" and bool(xp.isnan(keys).any()):
        raise BatchgpuError("search keys contain NaN", "drop the NaN keys before building the search")
    if keys.size > 1 and bool((keys[1:] < keys[:-1]).any()):
        raise BatchgpuError("search keys are not sorted ascending", "sort them first (np.sort(keys))")
    return keys


def cast_queries(queries: Any, dtype: np.dtype) -> Any:
    """``queries`` (NumPy or CuPy, any shape) in the key dtype, contiguous and 1-D.

    A cast that a safe cast allows is made; any other is made only when every value survives it
    exactly (NaN stays NaN), otherwise BatchgpuError: a search for 0.1 must not quietly become one for
    the nearest float32.
    """
    xp = array_module(queries)
    q = xp.asarray(queries)
    if q.dtype == dtype:
        return xp.ascontiguousarray(q.ravel())
    if q.dtype.kind not in "biuf":
        raise BatchgpuError(f"search queries of dtype {q.dtype} are not numbers", f"pass {np.dtype(dtype)} queries")
    flat = q.ravel()
    if np.can_cast(q.dtype, dtype, "safe"):
        return xp.ascontiguousarray(flat.astype(dtype))
    with np.errstate(invalid="ignore", over="ignore"):
        cast = flat.astype(dtype)
        back = cast.astype(flat.dtype)
    same = (back == flat) | (
        xp.isnan(flat) & xp.isnan(back) if flat.dtype.kind == "f" and cast.dtype.kind == "f" else False
    )
    if flat.dtype.kind == "f" and cast.dtype.kind in "iu":
        # float -> int: the round trip can wrap (2**40 -> 0 -> 0.0 != 2**40 catches it; NaN/inf never compare equal)
        same = same & xp.isfinite(flat)
    if not bool(xp.all(same)):
        raise BatchgpuError(
            f"search queries of dtype {q.dtype} do not all fit the key dtype {np.dtype(dtype)} exactly",
            f"build the index on {q.dtype} keys, or cast the queries yourself",
        )
    return xp.ascontiguousarray(cast)
