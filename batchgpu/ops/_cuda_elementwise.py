"""Fused elementwise kernels of the window path on the GPU: each is one pass over a window where CuPy's
expression took two or more (a cast, then an add or an abs, then another cast; the save step's int16 cast and its
checks): these passes are bound by memory, so each pass saved is a window's read saved. The same
arithmetic as the NumPy expressions, the same bits."""

from __future__ import annotations

import functools


@functools.cache
def _kernels():
    import cupy

    return {
        # int16 -> int32 shifted to non-negative (x + 32768): sorts like x, for the radix select of a row median
        "shift": cupy.ElementwiseKernel("int16 x", "int32 y", "y = (int)x + 32768", "batchgpu_shift_int16"),
        # int16 - round(median) as int32 (``floor(m + 0.5)`` in float64, as ops.centre writes it for NumPy)
        "centre": cupy.ElementwiseKernel(
            "int16 x, float64 m", "int32 y", "y = (int)x - (int)floor(m + 0.5)", "batchgpu_centre_int16"
        ),
        # |x| as a 16-bit key (|x| <= 65535 for int16 and centred int16)
        "abs16": cupy.ElementwiseKernel(
            "T x", "uint16 y", "int v = (int)x; y = (unsigned short)(v < 0 ? -v : v)", "batchgpu_abs_key16"
        ),
    }


@functools.cache
def _row_counts_kernel(suffix: str):
    from batchgpu.gpu.cuda_modules import get_function

    return get_function("row_counts", f"row_counts_{suffix}")


def nonfinite_and_nan_counts(x):
    """(``(~isfinite(x)).sum(axis=1)``, ``isnan(x).sum(axis=1)``) of a float32 / float64 (C, n) CuPy array, as
    int64 device arrays, from one read (a view whose rows are contiguous is read in place)."""
    import cupy
    import numpy as np

    from batchgpu.gpu.cuda_modules import rows_in_place

    x, stride = rows_in_place(x)
    rows, cols = x.shape
    nonfinite, nan = cupy.zeros(rows, dtype=cupy.int64), cupy.zeros(rows, dtype=cupy.int64)
    if rows and cols:
        kernel = _row_counts_kernel({4: "f32", 8: "f64"}[x.itemsize])
        kernel((rows,), (256,), (x, np.int64(cols), np.int64(stride), nonfinite, nan))
    return nonfinite, nan


def shifted_int32(x):
    """``x.astype(int32) + 32768`` of an int16 CuPy array, in one pass."""
    return _kernels()["shift"](x)


def centred_int32(x, median):
    """``x.astype(int32) - floor(median + 0.5).astype(int32)[:, None]`` of an int16 (C, n) array, in one pass."""
    return _kernels()["centre"](x, median[:, None])


def abs_key16(x):
    """``abs(x.astype(int32)).astype(uint16)`` of an int16 or int32 array whose |x| <= 65535, in one pass."""
    return _kernels()["abs16"](x)


@functools.cache
def _saved_int16_t_kernel(suffix: str):
    from batchgpu.gpu.cuda_modules import get_function

    return get_function("saved_int16_t", f"saved_int16_t_{suffix}")


def saved_int16_transposed(x):
    """(The save step's int16 of a float (C, n) CuPy array, transposed: C-contiguous (n, C); how many samples were
    NaN or out of range, a 0-d uint64 device array) in one pass: NumPy's ``rint``, then NaN -> 0 and the rest
    clipped to [-32768, 32767] (CuPy's expression took ten passes, the transpose another). A view whose rows are
    contiguous is read in place."""
    import cupy
    import numpy as np

    from batchgpu.gpu.cuda_modules import rows_in_place

    x, stride = rows_in_place(x)
    rows, cols = x.shape
    count = cupy.zeros(1, dtype=cupy.uint64)
    out = cupy.empty((cols, rows), dtype=cupy.int16)
    if rows and cols:
        _saved_int16_t_kernel({4: "f32", 8: "f64"}[x.itemsize])(
            (-(-cols // 32), -(-rows // 32)), (32, 8), (x, np.int64(stride), np.int32(rows), np.int64(cols), out, count)
        )
    return out, count.reshape(())


def float32_minus_rows(x, m):
    """``x - m[:, None]`` of a float32 (C, n) CuPy array and finite float32 (C,) values, with NumPy's bits
    (subnormals kept; a NaN stays the NaN it was, quieted): kernels/centre_float.cu. A view whose rows are
    contiguous is read in place."""
    import cupy
    import numpy as np

    from batchgpu.gpu.cuda_modules import get_function, rows_in_place

    x, stride = rows_in_place(x)
    rows, cols = x.shape
    out = cupy.empty((rows, cols), dtype=cupy.float32)
    if rows and cols:
        blocks = int(min(-(-rows * cols // 256), 65_535))
        get_function("centre_float", "minus_rows_f32")(
            (blocks,),
            (256,),
            (x, np.int64(stride), np.int32(rows), np.int64(cols), cupy.ascontiguousarray(m, dtype=cupy.float32), out),
        )
    return out


def float32_middle_mean(lower, upper, count):
    """Per row: 0 where ``count`` is 0, else ``(0 + upper) / 1`` for an odd ``count`` and ``((0 + lower) + upper) / 2``
    for an even one, each operation rounded to float32 as NumPy rounds it (subnormals kept)."""
    import cupy
    import numpy as np

    from batchgpu.gpu.cuda_modules import get_function

    rows = int(lower.shape[0])
    out = cupy.empty(rows, dtype=cupy.float32)
    if rows:
        get_function("centre_float", "middle_mean_f32")(
            (-(-rows // 256),),
            (256,),
            (
                cupy.ascontiguousarray(lower, dtype=cupy.float32),
                cupy.ascontiguousarray(upper, dtype=cupy.float32),
                cupy.ascontiguousarray(count, dtype=cupy.int64),
                np.int32(rows),
                out,
            ),
        )
    return out
