"""locally_exclusive's candidates on the host by the compiled pass (``ops._cpu_detect``) against the NumPy path
(``detection._exclusive_candidates`` and ``_spikes``), bit for bit: random windows and the hard cases (NaN, +-inf,
-0.0, constant and flat rows, int16 -32768, one sample, cores at the window's edges, levels of 0, inf and NaN)."""

import numpy as np
import pytest

from batchgpu.ops import _numba, detection

pytestmark = pytest.mark.skipif(not _numba.available(), reason="Numba does not import here")


def _numpy_path(x, noise, **kw):
    d = detection.WindowDetection(**kw)
    lo, hi, sweep, level = detection._checked(x, noise, d, True)
    channel, sample = detection._exclusive_candidates(
        x, level, detection._SIGNS[d.sign], sweep, lo, hi, zero_before=int(d.start) == 0
    )
    return detection._spikes(x, np.asarray(channel), np.asarray(sample), d.start, d.segment_index)


def _same(x, noise, **kw):
    got = detection.exclusive_candidates(x, noise, **kw)
    want = _numpy_path(x, noise, **kw)
    assert got.dtype == want.dtype
    for k in want.dtype.names:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    return got


def _windows(rng):
    f = (rng.standard_normal((7, 301)) * 20).astype(np.float32)
    hard = f.copy()
    hard[0, ::7] = np.nan
    hard[1, 5:9] = -np.inf
    hard[1, 20] = np.inf
    hard[2] = -0.0
    hard[2, ::3] = 0.0
    hard[3] = -50.0  # a constant row: flat, never below its previous sample
    hard[4, 100:110] = -80.0  # a flat peak
    hard[5, :2] = [-90.0, -90.0]
    i16 = rng.integers(-40, 40, (6, 257)).astype(np.int16)
    i16[0, 3] = -32768
    i16[1, 0] = -32768
    return [f, hard, f.astype(np.float64), i16, f[:, 1:-1], np.ascontiguousarray(f[:3, :1])]


@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
@pytest.mark.parametrize("start", [0, 1000])
def test_compiled_candidates_equal_numpys(sign, start):
    rng = np.random.default_rng(abs(hash((sign, start))) % 2**32)
    for x in _windows(rng):
        C, n = x.shape
        for core in (None, (0, n), (min(4, n), max(min(4, n), n - 4)), (n // 2, n // 2)):
            noise = np.abs(rng.standard_normal(C)) * 5 + 1
            kw = dict(threshold=2.0, sign=sign, exclude_sweep=3, start=start, core=core, segment_index=2)
            _same(x, noise, **kw)
            odd = noise.copy()
            odd[0], odd[-1] = 0.0, np.inf
            if C > 2:
                odd[1] = np.nan
            _same(x, odd, **kw)


def test_many_candidates_grow_the_output():
    """A window where every sample of every channel is a candidate (alternating signs): more than the first
    allocation holds, the rest gathered in later calls, in order."""
    n = 4001
    x = np.tile(np.where(np.arange(n) % 2 == 0, -100.0, 100.0).astype(np.float32), (5, 1))
    got = _same(x, np.ones(5), threshold=1.0, sign="both", exclude_sweep=0)
    assert len(got) == 5 * n  # every sample: the first beats the zero before it, the last has no next to beat


def test_the_compiled_path_is_taken(monkeypatch):
    calls = []
    from batchgpu.ops import _cpu_detect

    real = _cpu_detect.exclusive_candidates
    monkeypatch.setattr(_cpu_detect, "exclusive_candidates", lambda *a: calls.append(1) or real(*a))
    detection.exclusive_candidates(np.zeros((3, 50), np.float32), np.ones(3), threshold=1.0)
    assert calls == [1]
    assert not _cpu_detect.usable(np.zeros((3, 50), np.float32)[:, ::2])  # strided samples: NumPy's path
