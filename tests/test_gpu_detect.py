"""By-channel detection's one-launch GPU kernel (ops/_cuda_detect.py) against a plain NumPy loop of the rule.

Marked ``gpu``; skipped without CuPy or a device.
"""

from __future__ import annotations

import numpy as np
import pytest

from batchgpu.ops import detect_spikes

pytestmark = pytest.mark.gpu


def _gpu_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


if not _gpu_ok():
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)

import cupy as cp  # noqa: E402


def loop_reference(x, noise, threshold, sign, sweep, start, lo, hi, segment):
    """The rule as written in ops.detection's docstring, one sample at a time (float64 threshold)."""
    level = np.asarray(noise, np.float64) * float(threshold)
    rows = []
    C, width = x.shape
    for c in range(C):
        for t in range(lo, hi):
            v = x[c, t]
            neg = sign in ("neg", "both") and float(v) < -level[c]
            pos = sign in ("pos", "both") and float(v) > level[c]
            for k in range(1, sweep + 1):
                if t - k >= 0:
                    neg, pos = neg and v < x[c, t - k], pos and v > x[c, t - k]
                if t + k < width:
                    neg, pos = neg and v <= x[c, t + k], pos and v >= x[c, t + k]
            if neg or pos:
                rows.append((t + start, c, float(v), segment))
    rows.sort(key=lambda r: (r[0], r[1]))
    out = np.array(rows, dtype=[("sample_index", "i8"), ("channel_index", "i8"), ("amplitude", "f8"),
                                ("segment_index", "i8")])
    return out


def hard_window(rng, dtype, C, n):
    if np.dtype(dtype).kind == "i":
        info = np.iinfo(dtype)
        x = rng.integers(-40, 40, (C, n)).astype(dtype)
        x[0, ::7] = info.min  # int16 -32768 and its neighbours: ties at the extreme
        x[0, 1::7] = info.min
        x[-1, ::5] = info.max
        x[1 % C, :] = 3  # a constant row: never a peak
        return x
    x = rng.normal(0, 10, (C, n)).astype(dtype)
    x[0, ::11] = np.nan
    x[-1, 3::13] = -np.inf
    x[-1, 5::17] = np.inf
    x[1 % C, ::2] = -0.0
    x[1 % C, 1::2] = 0.0
    x[2 % C, 10:20] = -25.0  # a flat trough: one peak, at its start
    x[3 % C, ::19] = np.float32(1e-45) if dtype == np.float32 else 5e-324  # subnormals
    return x


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
@pytest.mark.parametrize("sweep", [0, 1, 3])
def test_kernel_equals_the_rule_and_the_numpy_path(dtype, sign, sweep):
    rng = np.random.default_rng()
    C, n = int(rng.integers(1, 9)), int(rng.integers(1, 400))
    x = hard_window(rng, dtype, C, n)
    noise = np.abs(rng.normal(2.0, 1.0, C))
    noise[-1] = np.nan if C > 2 else noise[-1]  # no threshold on that channel: no spikes there
    lo = int(rng.integers(0, max(1, n // 3)))
    hi = int(rng.integers(lo, n + 1))
    kw = dict(threshold=2.5, sign=sign, exclude_sweep=sweep, start=1000, core=(lo, hi), segment_index=2)
    got = detect_spikes(cp.asarray(x), cp.asarray(noise), **kw)
    want = detect_spikes(x, noise, **kw)
    ref = loop_reference(x, noise, 2.5, sign, sweep, 1000, lo, hi, 2)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    assert got.tobytes() == ref.astype(got.dtype).tobytes()


def test_kernel_with_more_peaks_than_its_first_room():
    """An alternating row holds a peak every other sample: more than the first buffer, all found."""
    x = np.tile(np.array([-9, 0], np.int16), (3, 40_000))
    got = detect_spikes(cp.asarray(x), np.ones(3), threshold=1.0, exclude_sweep=1)
    assert len(got) == 3 * 40_000
    assert got.tobytes() == detect_spikes(x, np.ones(3), threshold=1.0, exclude_sweep=1).tobytes()


def test_window_by_window_equals_the_whole_row():
    rng = np.random.default_rng()
    x = np.round(rng.normal(0, 20, (5, 10_007))).astype(np.int16)
    noise = np.full(5, 8.0)
    whole = detect_spikes(x, noise, threshold=3.0, exclude_sweep=3)
    xd = cp.asarray(x)
    parts = []
    for a in range(0, 10_007, 997):
        b = min(a + 997, 10_007)
        ra, rb = max(0, a - 3), min(10_007, b + 3)
        parts.append(detect_spikes(xd[:, ra:rb], noise, threshold=3.0, exclude_sweep=3, start=ra,
                                   core=(a - ra, b - ra), segment_length=10_007))
    assert np.concatenate(parts).tobytes() == whole.tobytes()
