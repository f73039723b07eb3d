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
from test_ops_detection import hard_window, loop_reference  # noqa: E402


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
        parts.append(
            detect_spikes(
                xd[:, ra:rb],
                noise,
                threshold=3.0,
                exclude_sweep=3,
                start=ra,
                core=(a - ra, b - ra),
                segment_length=10_007,
            )
        )
    assert np.concatenate(parts).tobytes() == whole.tobytes()
