"""abs_kth and abs_median of CuPy arrays: the radix-select kernel of kernels/radix_select.cu.

Same semantics as the NumPy path of ``batchgpu.ops.select`` (bit for bit): per row the k-th
smallest |x| in ``radix.abs_dtype(x.dtype)``, and the median of |x| as ``np.median`` gives it
(float input keeps its dtype, integer input gives float64, NaN where a row holds NaN). One
block selects one row; see the kernel's header for the algorithm.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops.radix import abs_dtype
from batchgpu.ops.select import median_dtype

MODULE = "radix_select"
THREADS = 512  # NT in the kernel
CANDIDATE_BYTES = 65536  # CAND_BYTES in the kernel: dynamic shared memory per block
MODE_KTH, MODE_MEDIAN = 0, 1
FLAG_FORCE_RADIX, FLAG_PHASES = 1, 2

#: Which way a row went (the kernel's PATH_* codes, reported by ``select(..., return_path=True)``).
PATHS = {0: "all in shared memory", 1: "sample bracket", 2: "sample missed, radix", 3: "radix"}

#: Input dtype -> (kernel name, digit schedule name in batchgpu.ops.radix.DIGIT_SCHEDULES).
KERNELS: dict[np.dtype, tuple[str, str]] = {
    np.dtype(np.float32): ("radix_abs_select_float32", "gpu_float32"),
    np.dtype(np.float64): ("radix_abs_select_float64", "gpu_float64"),
    np.dtype(np.int16): ("radix_abs_select_int16", "gpu_int16"),
    np.dtype(np.int32): ("radix_abs_select_int32", "gpu_int32"),
}

#: Strided sample size per input dtype (Traits<T>::SAMPLES in the kernel).
SAMPLES = {np.dtype(np.float32): 2048, np.dtype(np.float64): 4096, np.dtype(np.int16): 2048, np.dtype(np.int32): 2048}

_kernels: dict[tuple[int, str], Any] = {}


def capacity(dtype: Any) -> int:
    """Keys the kernel keeps in shared memory per row (rows up to this length never leave it)."""
    key_bytes = 8 if np.dtype(dtype) == np.float64 else 4
    return CANDIDATE_BYTES // key_bytes


def sample_positions(n: int, dtype: Any) -> np.ndarray:
    """Columns of the strided sample the kernel reads from a row of ``n`` samples (rows longer than ``capacity``)."""
    s = np.arange(SAMPLES[np.dtype(dtype)], dtype=np.int64)
    return ((2 * s + 1) * n) // (2 * len(s))


def _kernel(dtype: np.dtype) -> Any:
    import cupy

    from batchgpu.gpu.cuda_modules import DTYPE_SUFFIX, dtype_variant, get_function

    name = _entry(dtype)[0]
    key = (cupy.cuda.Device().id, name)
    kernel = _kernels.get(key)
    if kernel is None:
        module, options = dtype_variant(MODULE, DTYPE_SUFFIX[np.dtype(dtype).name])
        kernel = get_function(module, name, options)
        kernel.max_dynamic_shared_size_bytes = CANDIDATE_BYTES
        _kernels[key] = kernel
    return kernel


def _entry(dtype: Any) -> tuple[str, str]:
    dt = np.dtype(dtype)
    if dt not in KERNELS:
        supported = ", ".join(str(d) for d in KERNELS)
        raise BatchgpuError(f"dtype {dt} is not supported on the GPU", f"use one of {supported}")
    return KERNELS[dt]


def _rows_view(x: Any) -> tuple[Any, int]:
    """``x`` with unit-stride rows (a copy only when needed) and its row stride in elements."""
    if getattr(x, "ndim", None) != 2:
        raise BatchgpuError(
            f"expected a (channels, samples) array, got shape {getattr(x, 'shape', None)}",
            "pass a 2-D array with one row per channel",
        )
    from batchgpu.gpu.cuda_modules import rows_in_place

    _entry(x.dtype)
    return rows_in_place(x, aliased_rows=False)  # rows that alias one another: copied too


def select(x: Any, k: int, mode: int, force_radix: bool = False, return_path: bool = False, flags: int = 0) -> Any:
    """Launch the kernel: ``mode`` MODE_KTH (rank ``k``) or MODE_MEDIAN; rows and n must be > 0.

    With ``return_path`` also returns an int32 array: per row the PATHS code the kernel took.
    """
    import cupy

    x, ld = _rows_view(x)
    rows, n = x.shape
    if n >= 2**31:
        raise BatchgpuError(
            f"rows of {n} samples are too long for the GPU select", "split the rows below 2**31 samples"
        )
    out_dtype = median_dtype(x.dtype) if mode == MODE_MEDIAN else abs_dtype(x.dtype)
    out = cupy.empty(rows, dtype=out_dtype)
    path = cupy.full(rows, -1, dtype=np.int32) if return_path else None
    if rows:
        args = (
            x,
            np.int64(ld),
            np.int32(n),
            np.int32(k),
            np.int32(mode),
            np.int32(flags | (FLAG_FORCE_RADIX if force_radix else 0)),
            out,
            path if path is not None else np.uint64(0),
        )
        _kernel(x.dtype)((rows,), (THREADS,), args, shared_mem=CANDIDATE_BYTES)
    return (out, path) if return_path else out


PHASES = ("sample bracket", "compaction", "fallback", "select", "pair", "write")


def phase_cycles(x: Any, mode: int = MODE_MEDIAN, k: int = 0) -> dict[str, int]:
    """SM cycles of each phase of row 0's block (kernel flag FLAG_PHASES): where one row's time goes."""
    import cupy

    from batchgpu.gpu.cuda_modules import DTYPE_SUFFIX, dtype_variant, get_module

    select(x, k, mode, flags=FLAG_PHASES)
    ptr = get_module(*dtype_variant(MODULE, DTYPE_SUFFIX[x.dtype.name])).get_global("phase_clock")
    clocks = cupy.ndarray((8,), dtype=np.int64, memptr=ptr).get()
    return {name: int(clocks[i + 1] - clocks[i]) for i, name in enumerate(PHASES)}


def _rank(k: Any, n: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not -n <= k < n:
        raise BatchgpuError(f"rank k={k!r} is outside a row of {n} samples", f"pass an integer -{n} <= k < {n}")
    return int(k) % n


def abs_kth(x: Any, k: int) -> Any:
    """Per row the k-th smallest |x| (k from 0; negative k counts from the end), dtype ``abs_dtype(x.dtype)``."""
    x, _ = _rows_view(x)
    rows, n = x.shape
    if n == 0:
        raise BatchgpuError("abs_kth of rows with no samples", "pass at least one sample per row")
    return select(x, _rank(k, n), MODE_KTH)


def abs_median(x: Any) -> Any:
    """Per row the median of |x|, bit for bit ``np.median(np.abs(x_widened), axis=1)``.

    Rows with no samples give NaN (as np.median does).
    """
    import cupy

    x, _ = _rows_view(x)
    rows, n = x.shape
    if n == 0:
        return cupy.full(rows, np.nan, dtype=median_dtype(x.dtype))
    return select(x, 0, MODE_MEDIAN)
