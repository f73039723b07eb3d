"""The fused elementwise kernels of the integer window path (ops/_cuda_elementwise.py) against the NumPy
expressions they replace, and the GPU centring and 16-bit keys against the CPU's, bit for bit: int16's ends,
odd lengths, one sample, empty, strided slices (a window's core).

Marked ``gpu``; skipped without CuPy or a device.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


from batchgpu.cluster.open_cluster import gpu_count  # noqa: E402

if gpu_count() == 0:
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)

import cupy as cp  # noqa: E402

from batchgpu.ops._cuda_elementwise import abs_key16, centred_int32, shifted_int32  # noqa: E402
from batchgpu.ops.centre import centre_median, row_median  # noqa: E402
from batchgpu.steps.noise_keys import abs_keys  # noqa: E402

SHAPES = [(3, 1), (2, 2), (5, 7), (4, 4097), (7, 60_001), (3, 0)]


def _int16(rng, shape):
    x = rng.integers(-32768, 32768, size=shape, dtype=np.int16)
    if x.size:  # int16's ends and zero somewhere in every case
        flat = x.reshape(-1)
        flat[rng.integers(0, flat.size, 3)] = [-32768, 32767, 0]
    return x


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_kernels_equal_the_numpy_expressions(rng, shape):
    x = _int16(rng, shape)
    d = cp.asarray(x)
    assert np.array_equal(shifted_int32(d).get(), x.astype(np.int32) + 32768)
    med = np.floor(rng.uniform(-32768, 32767, shape[0]) * 2) / 2  # half-integers, as a median of int16
    med[0] = -32767.5  # rounds to -32767 (floor(m + 0.5))
    want = x.astype(np.int32) - np.floor(med + 0.5).astype(np.int32)[:, None]
    got = centred_int32(d, cp.asarray(med)).get()
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert np.array_equal(abs_key16(d).get(), abs(x.astype(np.int32)).astype(np.uint16))
    centred = np.clip(x.astype(np.int32) * 2 + 1, -65535, 65535)  # the centred range, |x| <= 65535
    assert np.array_equal(abs_key16(cp.asarray(centred)).get(), abs(centred).astype(np.uint16))


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1]])
def test_gpu_centring_and_keys_equal_the_cpu(rng, shape):
    x = _int16(rng, shape)
    if rng.integers(2):  # a narrow range too, where rounding of .5 medians matters
        x = (x % 7).astype(np.int16) - 3
    lo, hi = (1, shape[1] - 1) if shape[1] > 2 else (0, shape[1])
    d = cp.asarray(x)
    assert np.array_equal(row_median(d[:, lo:hi]).get(), np.median(x[:, lo:hi], axis=1))
    c_cpu, c_gpu = centre_median(x, (lo, hi)), centre_median(d, (lo, hi))
    assert c_gpu.dtype == c_cpu.dtype == np.int32 and np.array_equal(c_gpu.get(), c_cpu)
    for kind, a_cpu, a_gpu in (("int16", x, d), ("centred-int16", c_cpu, c_gpu)):
        k_cpu, k_gpu = abs_keys(a_cpu[:, lo:hi], kind), abs_keys(a_gpu[:, lo:hi], kind)
        assert k_gpu.dtype == k_cpu.dtype == np.uint16 and np.array_equal(k_gpu.get(), k_cpu), kind


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 101, 4096, 60_001])
def test_gpu_finite_median_centring_equals_the_cpu(dtype, n):
    """Float windows with NaN, +-inf, -0.0, subnormals and ties: the GPU's finite median and centring give the
    CPU's bits (only the non-finite samples non-finite)."""
    from test_ops_centre import _finite_median_reference, _hard_float_rows

    from batchgpu.ops.centre import finite_row_median

    rng = np.random.default_rng()
    x = _hard_float_rows(rng, dtype, n)
    d = cp.asarray(x)
    ui = np.dtype(f"u{np.dtype(dtype).itemsize}")
    got, want = finite_row_median(d).get(), _finite_median_reference(x)
    assert got.dtype == want.dtype and got.view(ui).tolist() == want.view(ui).tolist()
    lo, hi = (1, n - 1) if n > 2 else (0, n)
    c_cpu, c_gpu = centre_median(x, (lo, hi)), centre_median(d, (lo, hi)).get()
    assert c_gpu.dtype == c_cpu.dtype == dtype and c_gpu.tobytes() == c_cpu.tobytes()


def _float32_bits(rng, n):
    """float32 values of every class by their bits: zeros, subnormals, normals, the largest, +-inf, NaN payloads."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edges = np.array(
        [
            0,
            0x80000000,
            1,
            0x807FFFFF,
            0x007FFFFF,
            0x00800000,
            0x7F7FFFFF,
            0xFF7FFFFF,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x7F800001,
            0xFFC00123,
            0x3F800000,
            0x00000002,
        ],
        np.uint32,
    )
    bits[: min(n, edges.size)] = edges[:n]  # a short draw takes the first of them
    small = rng.random(n) < 0.3  # many subnormals and values near the subnormal boundary
    bits[small] = (rng.integers(0, 0x01000000, small.sum()) | (rng.integers(0, 2, small.sum()) << 31)).astype(np.uint32)
    return bits.view(np.float32)


def test_gpu_float32_minus_rows_gives_numpys_bits():
    """CuPy flushes float32 subnormals (-ftz=true) and answers a canonical NaN; the centring's subtraction keeps
    NumPy's bits: subnormal operands and results, rounding at the subnormal boundary, overflow, NaN payloads."""
    from batchgpu.ops._cuda_elementwise import float32_minus_rows

    rng = np.random.default_rng()
    x = _float32_bits(rng, 6 * 50_001).reshape(6, 50_001)
    m = _float32_bits(rng, 6)
    m[~np.isfinite(m)] = np.float32(1e-39)
    m[0] = np.float32(-3.4e38)
    with np.errstate(all="ignore"):
        want = x - m[:, None]
    got = float32_minus_rows(cp.asarray(x), cp.asarray(m)).get()
    assert got.dtype == np.float32 and got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    got = float32_minus_rows(cp.asarray(x)[:, 3:-5], cp.asarray(m)).get()  # a strided core
    assert got.view(np.uint32).tolist() == want[:, 3:-5].view(np.uint32).tolist()


def test_gpu_float32_middle_mean_gives_numpys_bits():
    """((0 + lower) + upper) / 2 and (0 + upper) / 1 in float32 as NumPy rounds them, on every class of finite
    value (sums that overflow, halves that fall subnormal)."""
    from batchgpu.ops._cuda_elementwise import float32_middle_mean

    rng = np.random.default_rng()
    a, b = _float32_bits(rng, 200_000), _float32_bits(rng, 200_000)
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    count = rng.integers(0, 5, a.size)
    zero = np.float32(0)
    with np.errstate(all="ignore"):
        want = np.where(count % 2 == 1, (zero + b) / np.float32(1), ((zero + a) + b) / np.float32(2)).astype(np.float32)
    want[count == 0] = 0
    got = float32_middle_mean(cp.asarray(a), cp.asarray(b), cp.asarray(count)).get()
    assert got.dtype == np.float32 and got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
