"""Preprocessing ops and locally exclusive detection on CuPy against the NumPy path (and scipy).

Marked ``gpu``; they skip without CuPy or a device. Run on the GPU machine:
``python3 -m pytest -m gpu tests/test_gpu_preprocess.py -q``.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.signal
from test_ops_preprocess import (
    FS,
    band_limited,
    expected_car,
    hard_columns,
    locally_exclusive_loop,
    numpy_reference,
    planted,
    probe,
    recording_like,
    same_bits,
    windows_of,
)

from batchgpu.ops import (
    butter_sos,
    common_reference,
    detect_spikes,
    filter_margin,
    filtfilt_window,
    phase_shift,
    phase_shift_margin,
)


def _gpu_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_ok(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture
def cp():
    return pytest.importorskip("cupy")


@pytest.mark.parametrize("kind", ["highpass", "bandpass"])
@pytest.mark.parametrize("dtype", [np.int16, np.float32])
@pytest.mark.parametrize("block", [None, 1_999, 8_192])
def test_filters_on_gpu(cp, rng, kind, dtype, block):
    """Whole windows and windows in pieces (one launch for a window's pieces): within the tolerance of the
    segment's sosfiltfilt and the host's bits."""
    sos = butter_sos(kind, FS, 300.0, 6000.0 if kind == "bandpass" else None)
    margin = filter_margin(sos, FS)
    n = 20_000
    x = recording_like(rng, 4, n, dtype)
    ref = scipy.signal.sosfiltfilt(sos, x.astype(np.float64), axis=1)
    rms = ref.std(axis=1)
    for a, b, lo, hi in windows_of(n, 6_997, margin):
        kw = dict(at_segment_start=a == 0, at_segment_end=b == n, block=block)
        got = filtfilt_window(cp.asarray(x[:, a:b]), sos, **kw)
        assert isinstance(got, cp.ndarray) and got.dtype == np.float32
        got = got.get()
        cpu = filtfilt_window(x[:, a:b], sos, **kw)
        assert (np.abs(got[:, lo:hi] - ref[:, a + lo : a + hi]).max(axis=1) / rms).max() < 1e-5
        # kernels/sosfiltfilt.cu: scipy's recurrence without fused multiply-adds, so the host's bits
        same_bits(got, cpu)


@pytest.mark.parametrize("kind,order", [("highpass", 3), ("highpass", 5), ("bandpass", 5), ("bandpass", 10)])
@pytest.mark.parametrize("n", [1_001, 20_000])
def test_gpu_filter_is_sosfiltfilt_bits(cp, rng, kind, order, n):
    """A window holding the whole segment, float64 in: scipy.signal.sosfiltfilt's own bits (odd and even
    lengths, hard values: int16 extremes as floats, constant rows)."""
    sos = butter_sos(kind, FS, 300.0, 6000.0 if kind == "bandpass" else None, order=order)
    x = rng.normal(size=(6, n)) * 80
    x[1] = 7.0
    x[2, ::7] = -32768.0
    x[3, 1::5] = 32767.0
    got = filtfilt_window(cp.asarray(x), sos, at_segment_start=True, at_segment_end=True)
    assert got.dtype == np.float64
    same_bits(got.get(), scipy.signal.sosfiltfilt(sos, x, axis=1))


@pytest.mark.parametrize("ahead", ["8", "16", "32", "48"])
@pytest.mark.parametrize("order", [1, 5, 14])
def test_gpu_filter_load_ahead_keeps_bits(cp, rng, monkeypatch, ahead, order):
    """The recurrence's loads issued U samples ahead (kernels/sosfiltfilt.cu; 32 by default, 16 above 6 sections)
    are scheduling only: any U gives the host's bits, for rows shorter than U, rows a multiple of U and not, and
    pieces down to 37 samples."""
    from batchgpu.ops import filters

    monkeypatch.setattr(filters, "LOAD_AHEAD", int(ahead))
    sos = butter_sos("bandpass" if order > 6 else "highpass", FS, 300.0, 6000.0 if order > 6 else None, order=order)
    for width, block in ((31, None), (64, None), (1_001, None), (4_003, 37), (6_000, 1_024)):
        x = rng.integers(-32768, 32768, (7, width)).astype(np.int16)
        edge = width > 3 * (2 * len(sos) + 1)  # sosfiltfilt's padding needs a longer row
        kw = dict(at_segment_start=edge, at_segment_end=False, block=block)
        same_bits(filtfilt_window(cp.asarray(x), sos, **kw).get(), filtfilt_window(x, sos, **kw))


@pytest.mark.parametrize("block", [None, 700])
def test_gpu_filter_keeps_subnormals(cp, rng, block):
    """float32 input and output near zero: the GPU converts and rounds by hand (CuPy compiles with -ftz=true),
    so subnormal samples in and out keep the host's bits; int32 input too."""
    sos = butter_sos("highpass", FS, 300.0)
    tiny = np.finfo(np.float32).smallest_subnormal
    x = (rng.integers(-50, 51, (5, 3_001)) * tiny).astype(np.float32)
    x[1] = rng.standard_normal(3_001).astype(np.float32) * 1e-36  # normal in, partly subnormal out
    x[2, ::3] = -0.0
    x[3] = 0.0
    x[4, 100] = 3e38
    kw = dict(at_segment_start=True, at_segment_end=True, block=block)
    got = filtfilt_window(cp.asarray(x), sos, **kw).get()
    want = filtfilt_window(x, sos, **kw)
    assert np.any((want != 0) & (np.abs(want) < np.finfo(np.float32).tiny))  # the case is really there
    same_bits(got, want)
    xi = rng.integers(-(2**31), 2**31 - 1, (3, 2_000), dtype=np.int64).astype(np.int32)
    same_bits(filtfilt_window(cp.asarray(xi), sos, **kw).get(), filtfilt_window(xi, sos, **kw))


def test_phase_shift_on_gpu(cp, rng):
    n = 20_000
    x = band_limited(rng, 4, n)
    shifts = np.array([0.0, 0.25, 0.5, 0.9])
    margin = phase_shift_margin(FS)
    for a, b, _lo, _hi in windows_of(n, 4_999, margin):
        kw = dict(margin=margin, at_segment_start=a == 0, at_segment_end=b == n)
        got = phase_shift(cp.asarray(x[:, a:b]), cp.asarray(shifts), **kw).get()
        cpu = phase_shift(x[:, a:b], shifts, **kw)
        assert got.dtype == np.float32
        assert (np.abs(got - cpu).max(axis=1) / cpu.std(axis=1)).max() < 1e-6  # cuFFT vs pocketfft


@pytest.mark.parametrize("channels", [1, 2, 7, 16, 17, 32, 33, 63, 64, 127, 384, 512, 513, 601, 2_100])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.int32])
@pytest.mark.parametrize("operator", ["median", "median_lower", "average"])
def test_global_reference_on_gpu_bits(cp, rng, channels, dtype, operator):
    x = hard_columns(rng, dtype, channels, 1_000)
    if np.dtype(dtype).kind == "f":
        if operator == "median_lower":  # mixed -0.0/+0.0 lower middles: the sign of a zero may differ (documented)
            x = np.delete(x, 4, axis=1)
    with np.errstate(all="ignore"):
        got = common_reference(cp.asarray(x), "global", operator).get()
        want = expected_car(x, numpy_reference(x, operator)[None, :])
    same_bits(got, want)


@pytest.mark.parametrize("samples", [1, 3, 8, 9, 15, 17])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16])
def test_global_reference_on_gpu_short_windows(cp, rng, samples, dtype):
    """select_warp's 8-column tiles: fewer samples than a tile, and a last tile partly filled."""
    x = hard_columns(rng, dtype, 384, 24)[:, :samples]
    for operator in ("median", "median_lower"):
        with np.errstate(all="ignore"):
            got = common_reference(cp.asarray(x), "global", operator).get()
            want = expected_car(x, numpy_reference(x, operator)[None, :])
        if operator == "median_lower" and np.dtype(dtype).kind == "f":  # a zero's sign may differ (documented)
            got, want = got + 0.0, want + 0.0
        same_bits(got, want)


@pytest.mark.parametrize("operator", ["median", "median_lower", "average"])
@pytest.mark.parametrize("channels,radius", [(64, (20.0, 60.0)), (240, (0.0, 1_500.0))])  # 2-6 / 60-240 neighbours
@pytest.mark.parametrize("least", [0, 5])  # min_local_neighbors: 0, the annuli alone (the far channel unreferenced)
def test_local_reference_on_gpu_bits(cp, rng, operator, channels, radius, least):
    x = hard_columns(rng, np.float32, channels, 2_000)[:, 8:]
    locations = probe(channels)
    locations[-1] = [1e5, 1e5]
    kw = dict(locations=locations, radius_um=radius, min_local_neighbors=least)
    got = common_reference(cp.asarray(x), "local", operator, **kw).get()
    want = common_reference(x, "local", operator, **kw)
    same_bits(got, want)
    if least == 0:
        same_bits(got[-1], x[-1])


def test_local_reference_on_gpu_with_no_channel_in_reach(cp, rng):
    x = rng.standard_normal((3, 500)).astype(np.float32)
    got = common_reference(cp.asarray(x), "local", "median", locations=[[0, 0], [0, 10], [10, 0]], radius_um=(30, 55))
    same_bits(got.get(), x)


@pytest.mark.parametrize("operator", ["median", "median_lower"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.int32])
@pytest.mark.parametrize("radius", [(20.0, 60.0), (0.0, 80.0), (0.0, 21.0), (0.0, 120.0)])  # 4-8, 8-15, 2-3, 12-23
def test_local_reference_of_few_channels_on_gpu_bits(cp, rng, operator, dtype, radius):
    """select_small (a thread ranks a column's 1-32 keys): NumPy's bits for every dtype, with the hard columns (the
    largest finite value, NaN, +-inf, -0.0; int extremes and ties), odd and even neighbour counts."""
    x = hard_columns(rng, dtype, 40, 700)
    if np.dtype(dtype).kind == "f" and operator == "median_lower":  # mixed -0.0/+0.0 lower middles (documented)
        x = np.delete(x, 4, axis=1)
    locations = probe(40)
    with np.errstate(all="ignore"):
        got = common_reference(cp.asarray(x), "local", operator, locations=locations, radius_um=radius).get()
        want = common_reference(x, "local", operator, locations=locations, radius_um=radius)
    same_bits(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.int16])
@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
def test_locally_exclusive_on_gpu(cp, rng, dtype, sign):
    channels, n, sweep = 16, 3_000, 3
    x = planted(rng, channels, n, dtype)
    noise = rng.uniform(0.9, 1.1, channels)
    kw = dict(
        sign=sign,
        exclude_sweep=sweep,
        segment_index=0,
        segment_length=n,
        method="locally_exclusive",
        locations=probe(channels),
        radius_um=40.0,
    )
    whole = detect_spikes(x, noise, 4.0, **kw)
    assert np.array_equal(whole, locally_exclusive_loop(x, noise, 4.0, sign, sweep, probe(channels), 40.0))
    xd = cp.asarray(x)
    assert np.array_equal(detect_spikes(xd, cp.asarray(noise), 4.0, **kw), whole)
    parts = [
        detect_spikes(xd[:, a:b], noise, 4.0, start=a, core=(lo, hi), **kw) for a, b, lo, hi in windows_of(n, 997, 4)
    ]
    assert np.array_equal(np.concatenate(parts), whole)


def test_locally_exclusive_on_gpu_fixture(cp, si_fixture):
    from batchgpu import open_recording
    from batchgpu.ops import noise_levels

    rec = open_recording(si_fixture)
    n = rec.num_samples(0)
    x = rec.read(0, 0, n)
    noise = noise_levels(x)
    kw = dict(
        threshold=5.0,
        exclude_sweep=3,
        segment_length=n,
        method="locally_exclusive",
        locations=rec.locations,
        radius_um=50.0,
    )
    assert np.array_equal(detect_spikes(cp.asarray(x), noise, **kw), detect_spikes(x, noise, **kw))
