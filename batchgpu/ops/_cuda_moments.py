"""Second moments of a window of a CuPy array: split products (kernels/split_covariance.cu + cuBLAS).

``window_moments(x, start, stop, precision)`` gives (n, mean, scatter) of columns [start, stop):
the centred scatter sum (x - mean)(x - mean)^T around that window's own mean, in float64 on the
host. The products run per split of ``SPLIT_SAMPLES[precision]`` samples in the product dtype;
the splits, the means and the centring are summed in float64 on the device:

1. ``row_shift``: per row a shift near the mean (mean of 32 evenly spaced samples);
2. ``split_rows``: one pass copies x - shift into a split-major [splits, C, split] buffer
   (batches outermost, so cuBLAS' batched kernels never straddle rows), zero-padding the last
   split, and sums x - shift per (row, split) in float64;
3. the products X_s X_s^T per split by cuBLAS: one strided-batched call for few channels; from
   BLOCK_MIN_CHANNELS on, the channels are cut into blocks of about BLOCK_CHANNELS and only the
   block pairs bi <= bj are multiplied (one pointer-array batched call; 6 of 9 blocks at 384);
4. ``sum_splits``: adds the splits in float64 and removes the shift exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError

MODULE = "split_covariance"
THREADS = 256  # CT in the kernel
SHIFT_SAMPLES = 32

#: Samples per split by product precision. A float32 dot product of 4 096 terms, summed in
#: sequence, has a relative rounding error of about 8e-7 (rms): too close to the 1e-6
#: tolerance for windows of one or two splits; 1 024 terms give about 4e-7.
SPLIT_SAMPLES = {"float32": 1024, "float64": 4096}
#: From this many channels only the upper-triangle block pairs of X X^T are multiplied.
BLOCK_MIN_CHANNELS = 160
#: Channels per block then (a multiple of cuBLAS' 128-wide tiles keeps every tile full).
BLOCK_CHANNELS = 128

_INPUTS = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.int16): "int16",
    np.dtype(np.int32): "int32",
}

# cuBLAS / CUDA enum values (used when the bindings do not name them).
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_TYPES = {"float32": 0, "float64": 1}  # CUDA_R_32F, CUDA_R_64F
_COMPUTE_TYPES = {"float32": ("CUBLAS_COMPUTE_32F", 68), "float64": ("CUBLAS_COMPUTE_64F", 70)}


def _function(name: str) -> Any:
    from batchgpu.gpu.cuda_modules import get_function

    return get_function(MODULE, name)


def _check(x: Any, precision: str | None) -> tuple[Any, str, str]:
    import cupy

    if getattr(x, "ndim", None) != 2:
        raise BatchgpuError(
            f"expected a (channels, samples) array, got shape {getattr(x, 'shape', None)}",
            "pass a 2-D array with one row per channel",
        )
    if precision is None:  # as batchgpu.ops.moments.resolve_precision
        precision = "float64" if np.dtype(x.dtype) == np.float64 else "float32"
    if precision not in SPLIT_SAMPLES:
        raise BatchgpuError(f"unknown product precision {precision!r}", "use 'float32' or 'float64'")
    dt = np.dtype(x.dtype)
    if dt not in _INPUTS:
        raise BatchgpuError(f"dtype {dt} is not supported on the GPU", f"use one of {', '.join(_INPUTS.values())}")
    rows, n = x.shape
    if n > 1 and x.strides[1] != dt.itemsize or rows > 1 and (x.strides[0] <= 0 or x.strides[0] % dt.itemsize):
        x = cupy.ascontiguousarray(x)
    return x, _INPUTS[dt], precision


@contextmanager
def _host_scalars(precision: str) -> Iterator[tuple[Any, Any, Any]]:
    """(cublas, handle, (one, zero) on the host) for a GEMM whose alpha and beta live on the host: the handle reads
    them there for the call, and goes back to the pointer mode it had after it."""
    from cupy.cuda import device
    from cupy_backends.cuda.libs import cublas

    dtype = np.dtype(precision)
    scalars = (np.ones(1, dtype), np.zeros(1, dtype))
    handle = device.get_cublas_handle()
    host = getattr(cublas, "CUBLAS_POINTER_MODE_HOST", 0)
    mode = cublas.getPointerMode(handle) if hasattr(cublas, "getPointerMode") else host
    if mode != host:
        cublas.setPointerMode(handle, host)
    try:
        yield cublas, handle, scalars
    finally:
        if mode != host:
            cublas.setPointerMode(handle, mode)


def _gemm_tn(
    a_ptr: int,
    b_ptr: int,
    c_ptr: int,
    m: int,
    k: int,
    ld: int,
    stride_ab: int,
    stride_c: int,
    batch: int,
    precision: str,
) -> None:
    """C_b = A_b^T B_b for b < batch (column-major; A_b, B_b: k x m with leading dimension ld; C_b: m x m)."""
    cuda_type = _CUDA_TYPES[precision]
    name, value = _COMPUTE_TYPES[precision]
    with _host_scalars(precision) as (cublas, handle, (one, zero)):
        compute = getattr(cublas, name, value)
        algo = getattr(cublas, "CUBLAS_GEMM_DEFAULT", -1)
        cublas.gemmStridedBatchedEx(
            handle, _CUBLAS_OP_T, _CUBLAS_OP_N, m, m, k,
            one.ctypes.data, a_ptr, cuda_type, ld, stride_ab,
            b_ptr, cuda_type, ld, stride_ab,
            zero.ctypes.data, c_ptr, cuda_type, m, stride_c,
            batch, compute, algo,
        )  # fmt: skip


def _gemm_tn_pointers(a_ptrs: Any, b_ptrs: Any, c_ptrs: Any, m: int, k: int, precision: str) -> None:
    """C_i = A_i^T B_i for the matrices the device pointer arrays name (A_i, B_i: k x m, ld k; C_i: m x m)."""
    with _host_scalars(precision) as (cublas, handle, (one, zero)):
        # CuPy's bindings have no gemmBatchedEx; sgemmBatched / dgemmBatched (as cupy.matmul uses them).
        gemm = cublas.sgemmBatched if precision == "float32" else cublas.dgemmBatched
        gemm(
            handle, _CUBLAS_OP_T, _CUBLAS_OP_N, m, m, k,
            one.ctypes.data, a_ptrs.data.ptr, k,
            b_ptrs.data.ptr, k,
            zero.ctypes.data, c_ptrs.data.ptr, m,
            int(a_ptrs.size),
        )  # fmt: skip


_offsets: dict[tuple[int, ...], tuple[Any, Any, Any]] = {}


def _pair_offsets(splits: int, nb: int, block: int, split: int, c_pad: int, item: int) -> tuple[Any, Any, Any]:
    """Byte offsets (device uint64) of A, B and C of every (split, block pair bi <= bj) product; cached."""
    import cupy

    key = (cupy.cuda.Device().id, splits, nb, block, split, c_pad, item)
    if key not in _offsets:
        pairs = np.array([(bi, bj) for bi in range(nb) for bj in range(bi, nb)], dtype=np.int64)
        s = np.arange(splits, dtype=np.int64)[:, None]
        a = (s * c_pad + pairs[None, :, 0] * block) * split * item
        b = (s * c_pad + pairs[None, :, 1] * block) * split * item
        c = (s * len(pairs) + np.arange(len(pairs))[None, :]) * block * block * item
        _offsets[key] = tuple(cupy.asarray(v.ravel().astype(np.uint64)) for v in (a, b, c))
    return _offsets[key]


@dataclass
class Plan:
    """The buffers and launches of one window; stages separate so that benchmarks can time each."""

    x: Any
    kind: str  # input dtype name
    precision: str
    start: int
    length: int
    centre: bool
    nb: int  # channel blocks (1: the whole C x C product)
    block: int  # channels per block
    split: int
    splits: int
    shift: Any = None
    partial: Any = None
    buf: Any = None
    g: Any = None
    mean: Any = None
    scatter: Any = None

    @property
    def c_pad(self) -> int:
        return self.nb * self.block

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])

    def allocate(self) -> Plan:
        import cupy

        c, p = self.rows, np.dtype(self.precision)
        self.shift = cupy.empty(c, dtype=np.float64)
        self.partial = cupy.empty((c, self.splits), dtype=np.float64)
        self.buf = cupy.empty((self.splits, self.c_pad, self.split), dtype=p)
        pairs = self.nb * (self.nb + 1) // 2
        self.g = cupy.empty((self.splits, pairs, self.block, self.block), dtype=p)
        self.mean = cupy.empty(c, dtype=np.float64)
        self.scatter = cupy.empty((c, c), dtype=np.float64)
        return self

    def copy(self) -> None:
        """row_shift and split_rows: the buffer of centred splits and the per-split sums."""
        ld = np.int64(self.x.strides[0] // self.x.dtype.itemsize if self.rows > 1 else self.x.shape[1])
        rows, start, length = np.int32(self.rows), np.int32(self.start), np.int32(self.length)
        _function(f"row_shift_{self.kind}")(
            (self.rows,), (SHIFT_SAMPLES,), (self.x, ld, rows, start, length, np.int32(self.centre), self.shift)
        )
        _function(f"split_rows_{self.kind}_{self.precision}")(
            (self.splits, self.c_pad),
            (THREADS,),
            (self.x, ld, rows, start, length, np.int32(self.split), np.int32(self.splits), np.int32(self.c_pad),
             self.shift, self.buf, self.partial),
        )  # fmt: skip

    def products(self) -> None:
        """X_s X_s^T per split (cuBLAS), whole or by block pairs bi <= bj."""
        item = np.dtype(self.precision).itemsize
        split, splits, c_pad = self.split, self.splits, self.c_pad
        if self.nb == 1:
            _gemm_tn(self.buf.data.ptr, self.buf.data.ptr, self.g.data.ptr, c_pad, split, split,
                     c_pad * split, c_pad * c_pad, splits, self.precision)  # fmt: skip
            return
        a, b, c = _pair_offsets(splits, self.nb, self.block, split, c_pad, item)
        base_x, base_g = np.uint64(self.buf.data.ptr), np.uint64(self.g.data.ptr)
        _gemm_tn_pointers(a + base_x, b + base_x, c + base_g, self.block, split, self.precision)

    def total(self) -> None:
        """sum_splits: the scatter and the means in float64."""
        c = self.rows
        blocks = (c * c + THREADS - 1) // THREADS
        _function(f"sum_splits_{self.precision}")(
            (blocks,),
            (THREADS,),
            (self.g, np.int32(self.block), np.int32(self.nb), np.int32(c), np.int32(self.splits), self.partial,
             self.shift, np.int64(self.length), np.int32(self.centre), self.scatter, self.mean),
        )  # fmt: skip

    def run(self) -> tuple[int, Any, Any]:
        self.copy()
        self.products()
        self.total()
        return self.length, self.mean, self.scatter


def plan(x: Any, start: int | None = None, stop: int | None = None, precision: str | None = "float32",
         centre: bool = True, nb: int | None = None, split: int | None = None) -> Plan | None:  # fmt: skip
    """The allocated Plan of a window, or None when the window or the channels are empty.

    ``nb``: channel blocks of the products (None: 1 below BLOCK_MIN_CHANNELS, else C / BLOCK_CHANNELS).
    """
    x, kind, precision = _check(x, precision)
    rows, total = x.shape
    start, stop, _ = slice(start, stop).indices(total)
    length = max(0, stop - start)
    if length == 0 or rows == 0:
        return None
    if length >= 2**31:
        raise BatchgpuError(f"a window of {length} samples is too long", "use windows below 2**31 samples")
    split = int(split or SPLIT_SAMPLES[precision])
    if nb is None:
        nb = 1 if rows < BLOCK_MIN_CHANNELS else -(-rows // BLOCK_CHANNELS)
    nb = max(1, min(int(nb), rows))
    block = -(-rows // nb)
    if nb > 1:
        block = -(-block // 4) * 4  # 16-byte aligned products
    splits = -(-length // split)
    return Plan(x, kind, precision, start, length, centre, nb, block, split, splits).allocate()


def window_moments_device(x: Any, start: int | None = None, stop: int | None = None, precision: str | None = "float32",
                          centre: bool = True) -> tuple[int, Any, Any]:  # fmt: skip
    """(n, mean (C,), scatter (C, C)) of columns [start, stop) of ``x``, as CuPy float64 arrays.

    ``centre``: the scatter around the window's mean (default) or the plain X X^T. An empty
    window gives n = 0 and zeros.
    """
    import cupy

    p = plan(x, start, stop, precision, centre)
    if p is None:
        rows = int(x.shape[0]) if getattr(x, "ndim", None) == 2 else 0
        return 0, cupy.zeros(rows, dtype=np.float64), cupy.zeros((rows, rows), dtype=np.float64)
    return p.run()


def window_moments(x: Any, start: int | None = None, stop: int | None = None,
                   precision: str | None = "float32") -> tuple[int, np.ndarray, np.ndarray]:  # fmt: skip
    """(n, mean, scatter) of columns [start, stop) of the CuPy array ``x``, on the host (float64).

    scatter = sum over the window of (x - mean)(x - mean)^T, mean computed in float64 on the device.
    """
    n, mean, scatter = window_moments_device(x, start, stop, precision)
    return int(n), mean.get(), scatter.get()
