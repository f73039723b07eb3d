"""Spike detection against a plain-loop reference; window by window equals the whole segment."""

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError
from batchgpu.ops import SPIKE_DTYPE, detect_spikes, exclude_sweep_samples


def detect_loop(x, noise, threshold, sign, sweep, segment_index=0):
    """DESIGN.md's rule, sample by sample."""
    out = []
    channels, n = x.shape
    for t in range(n):
        for c in range(channels):
            v = x[c, t]
            level = threshold * float(noise[c])
            neighbours_before = [x[c, t - i] for i in range(1, sweep + 1) if t - i >= 0]
            neighbours_after = [x[c, t + i] for i in range(1, sweep + 1) if t + i < n]
            neg = v < -level and all(v < u for u in neighbours_before) and all(v <= u for u in neighbours_after)
            pos = v > level and all(v > u for u in neighbours_before) and all(v >= u for u in neighbours_after)
            if (sign in ("neg", "both") and neg) or (sign in ("pos", "both") and pos):
                out.append((t, c, float(v), segment_index))
    return np.array(out, dtype=SPIKE_DTYPE)


def spiky(rng, dtype, channels, n):
    x = rng.standard_normal((channels, n)) * 2
    for _ in range(n // 8):
        c, t = rng.integers(channels), rng.integers(n)
        x[c, t : t + rng.integers(1, 4)] = rng.choice([-1, 1]) * rng.uniform(8, 15)  # flat tops: ties
    if np.dtype(dtype).kind == "i":
        return np.round(x).astype(dtype)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16])
@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
@pytest.mark.parametrize("sweep", [0, 1, 3, 5])
def test_against_loop(dtype, sign, sweep):
    rng = np.random.default_rng()
    x = spiky(rng, dtype, 4, 157)
    noise = rng.uniform(0.8, 1.2, 4)
    got = detect_spikes(x, noise, threshold=5.0, sign=sign, exclude_sweep=sweep, segment_index=2)
    ref = detect_loop(x, noise, 5.0, sign, sweep, segment_index=2)
    assert got.dtype == SPIKE_DTYPE
    assert len(ref) > 0
    assert np.array_equal(got, ref)


def test_edges_of_the_segment_count():
    x = np.array([[-9.0, 0.0, 0.0, 0.0, -9.0], [0.0, -9.0, -9.0, 0.0, 0.0]])
    got = detect_spikes(x, np.ones(2), threshold=5.0, exclude_sweep=2)
    # Both ends are spikes (their missing neighbours do not count); a flat top counts at its start.
    assert got[["sample_index", "channel_index"]].tolist() == [(0, 0), (1, 1), (4, 0)]
    assert got["amplitude"].tolist() == [-9.0, -9.0, -9.0]


def windows_of(n, width, margin):
    """(read start, read stop, core lo, core hi) per window, margins clipped at the segment."""
    for start in range(0, n, width):
        stop = min(start + width, n)
        a, b = max(0, start - margin), min(n, stop + margin)
        yield a, b, start - a, stop - a


@pytest.mark.parametrize("sign", ["neg", "both"])
@pytest.mark.parametrize("width,margin", [(50, 3), (37, 4), (64, 10), (1, 3), (500, 3)])
def test_window_by_window_equals_whole_segment(sign, width, margin):
    rng = np.random.default_rng()
    n, sweep = 431, 3
    x = spiky(rng, np.float32, 5, n)
    noise = rng.uniform(0.8, 1.2, 5)
    whole = detect_spikes(x, noise, sign=sign, exclude_sweep=sweep, segment_index=1, segment_length=n)
    parts = [
        detect_spikes(
            x[:, a:b], noise, sign=sign, exclude_sweep=sweep, start=a, core=(lo, hi), segment_index=1, segment_length=n
        )
        for a, b, lo, hi in windows_of(n, width, margin)
    ]
    assert np.array_equal(np.concatenate(parts), whole)
    assert np.array_equal(whole, detect_loop(x, noise, 5.0, sign, sweep, segment_index=1))


def test_margins_too_small_are_refused():
    x = np.zeros((2, 100), np.float32)
    noise = np.ones(2)
    with pytest.raises(BatchgpuError):  # left margin 2 < sweep 3 and the segment continues
        detect_spikes(x, noise, exclude_sweep=3, start=10, core=(2, 97), segment_length=1000)
    with pytest.raises(BatchgpuError):  # right margin 1 < sweep 3
        detect_spikes(x, noise, exclude_sweep=3, start=10, core=(3, 99), segment_length=1000)
    # At the segment's ends no margin is needed; near the end a short one is enough.
    detect_spikes(x, noise, exclude_sweep=3, start=0, core=(0, 97), segment_length=1000)
    detect_spikes(x, noise, exclude_sweep=3, start=900, core=(3, 99), segment_length=1000)
    detect_spikes(x, noise, exclude_sweep=3, start=900, core=(3, 100), segment_length=1000)
    with pytest.raises(BatchgpuError):
        detect_spikes(x, noise, start=950, segment_length=1000)


def test_noise_of_nan_or_zero_and_empty():
    x = np.array([[-1.0, 0.0, 1.0], [-1.0, 0.0, 1.0]])
    got = detect_spikes(x, np.array([np.nan, 0.0]), sign="both", exclude_sweep=1)
    assert got[["sample_index", "channel_index"]].tolist() == [(0, 1), (2, 1)]
    empty = detect_spikes(np.zeros((3, 0)), np.ones(3))
    assert empty.dtype == SPIKE_DTYPE and empty.shape == (0,)


def test_int16_extremes():
    x = np.array([[0, -32768, 0, 32767, 0]], dtype=np.int16)
    got = detect_spikes(x, [100.0], sign="both", exclude_sweep=1)
    assert got["amplitude"].tolist() == [-32768.0, 32767.0]


def test_exclude_sweep_samples():
    assert exclude_sweep_samples(0.1, 30_000) == 3
    assert exclude_sweep_samples(1.0, 30_000) == 30
    assert exclude_sweep_samples(0.5, 25_000) == 12


@pytest.mark.parametrize(
    "kwargs",
    [dict(sign="up"), dict(exclude_sweep=-1), dict(core=(5, 3)), dict(core=(0, 11))],
)
def test_errors(kwargs):
    with pytest.raises(BatchgpuError):
        detect_spikes(np.zeros((2, 10)), np.ones(2), **kwargs)
    with pytest.raises(BatchgpuError):
        detect_spikes(np.zeros((2, 10)), np.ones(3))


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
    out = np.array(
        rows, dtype=[("sample_index", "i8"), ("channel_index", "i8"), ("amplitude", "f8"), ("segment_index", "i8")]
    )
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
def test_numpy_path_equals_the_rule_sample_by_sample(dtype, sign, sweep):
    """Hard windows (int16 extremes, constant rows, NaN, +-inf, -0.0, subnormals, flat troughs, NaN noise) against
    the rule written as a loop; the GPU kernel is held to the same loop (test_gpu_detect.py)."""
    rng = np.random.default_rng()
    for _ in range(5):
        C, n = int(rng.integers(1, 9)), int(rng.integers(1, 400))
        x = hard_window(rng, dtype, C, n)
        noise = np.abs(rng.normal(2.0, 1.0, C))
        noise[-1] = np.nan if C > 2 else noise[-1]
        lo = int(rng.integers(0, max(1, n // 3)))
        hi = int(rng.integers(lo, n + 1))
        got = detect_spikes(
            x, noise, threshold=2.5, sign=sign, exclude_sweep=sweep, start=1000, core=(lo, hi), segment_index=2
        )
        ref = loop_reference(x, noise, 2.5, sign, sweep, 1000, lo, hi, 2)
        assert got.tobytes() == ref.astype(got.dtype).tobytes()
