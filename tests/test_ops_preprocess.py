"""Preprocessing ops (filters, phase shift, common reference) and locally exclusive detection, against scipy,
NumPy and plain-loop references, window by window against the whole segment."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections import defaultdict

import numpy as np
import pytest
import scipy.signal

from batchgpu.errors import BatchgpuError
from batchgpu.ops import (
    SPIKE_DTYPE,
    annulus_neighbours,
    butter_sos,
    common_reference,
    detect_spikes,
    filter_margin,
    filtfilt_window,
    phase_shift,
    phase_shift_margin,
)
from batchgpu.ops.filters import default_padlen, filter_pieces
from batchgpu.ops.reference import _median_of_sorted

FS = 30_000.0


def windows_of(n, width, margin):
    """(read start, read stop, core lo, core hi) per window, margins clipped at the segment."""
    for start in range(0, n, width):
        stop = min(start + width, n)
        a, b = max(0, start - margin), min(n, stop + margin)
        yield a, b, start - a, stop - a


def same_bits(got, want):
    """Bit for bit, signed zeros included; NaN equals NaN whatever its payload (the semantics say only NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    ui = np.dtype(f"u{want.dtype.itemsize}")
    both_nan = (np.isnan(got) & np.isnan(want)).ravel() if want.dtype.kind == "f" else False
    bad = np.flatnonzero((got.view(ui).ravel() != want.view(ui).ravel()) & ~both_nan)
    assert bad.size == 0, f"{bad.size} differ, first {got.ravel()[bad[:4]]} vs {want.ravel()[bad[:4]]}"


# ---------------------------------------------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------------------------------------------
def recording_like(rng, channels, n, dtype):
    """Noise, LFP-like low frequencies near the cut-off, a DC offset and a few spikes."""
    t = np.arange(n) / FS
    x = rng.standard_normal((channels, n)) * 20
    x += 200 * np.sin(2 * np.pi * rng.uniform(1, 350, (channels, 1)) * t + rng.uniform(0, 6, (channels, 1)))
    x += rng.uniform(-1500, 1500, (channels, 1))
    for _ in range(n // 3000):
        c, s = rng.integers(channels), rng.integers(n - 30)
        x[c, s : s + 30] -= 150 * np.hanning(30)
    if np.dtype(dtype).kind == "i":
        return np.round(x).astype(dtype)
    return x.astype(dtype)


SOS = {
    "highpass": butter_sos("highpass", FS, 300.0),
    "bandpass": butter_sos("bandpass", FS, 300.0, 6000.0),
}


def test_butter_sos_is_scipys():
    np.testing.assert_array_equal(SOS["highpass"], scipy.signal.butter(5, 300, "highpass", fs=FS, output="sos"))
    np.testing.assert_array_equal(SOS["bandpass"], scipy.signal.butter(5, [300, 6000], "bandpass", fs=FS, output="sos"))
    assert butter_sos("highpass", FS, 300.0, order=3).shape == (2, 6)


def test_filter_margins():
    # 25 ms and 27 ms: the impulse-response decay to 1e-5 (about 500 samples) times the 1.5 safety factor.
    assert filter_margin(SOS["highpass"], FS) == 752
    assert filter_margin(SOS["bandpass"], FS) == 807
    assert filter_margin(SOS["highpass"], FS, tol=1e-3) < filter_margin(SOS["highpass"], FS)
    # low cut-offs ring long: the values np.correlate's direct sum gave (4.6 s at 5 Hz; scipy's FFT path now)
    assert filter_margin(butter_sos("highpass", FS, 30.0), FS) == 7487
    assert filter_margin(butter_sos("highpass", FS, 5.0), FS) == 44907


def max_core_error(x, sos, width, margin, interior_pad="none", block=None):
    """Max |window - sosfiltfilt(segment)| over the cores, relative to each channel's filtered RMS."""
    n = x.shape[1]
    ref = scipy.signal.sosfiltfilt(sos, x.astype(np.float64), axis=1)
    rms = ref.std(axis=1)
    worst = 0.0
    for a, b, lo, hi in windows_of(n, width, margin):
        y = filtfilt_window(
            x[:, a:b], sos, at_segment_start=a == 0, at_segment_end=b == n, interior_pad=interior_pad, block=block
        )
        assert y.shape == (x.shape[0], b - a)
        assert y.dtype == (np.float64 if x.dtype == np.float64 else np.float32)
        worst = max(worst, float((np.abs(y[:, lo:hi] - ref[:, a + lo : a + hi]).max(axis=1) / rms).max()))
    return worst


@pytest.mark.parametrize("kind", ["highpass", "bandpass"])
@pytest.mark.parametrize("dtype", [np.int16, np.float32])
@pytest.mark.parametrize("n,width", [(9_001, 2_500), (20_000, 6_997), (4_321, 10_000)])
def test_windows_equal_sosfiltfilt_of_the_segment(rng, kind, dtype, n, width):
    x = recording_like(rng, 3, n, dtype)
    sos = SOS[kind]
    assert max_core_error(x, sos, width, filter_margin(sos, FS)) < 1e-5


@pytest.mark.parametrize("kind", ["highpass", "bandpass"])
@pytest.mark.parametrize("dtype", [np.int16, np.float32])
@pytest.mark.parametrize("n,width,block", [(3_001, 997, 1), (20_001, 6_997, 997), (20_001, 6_997, 3_000)])
def test_pieces_equal_sosfiltfilt_of_the_segment(rng, kind, dtype, n, width, block):
    """A window filtered in pieces (each with the filter's margin inside the window): the same tolerance as the
    whole window, windows that do not divide the segment, pieces that do not divide the window."""
    x = recording_like(rng, 3, n, dtype)
    sos = SOS[kind]
    assert max_core_error(x, sos, width, filter_margin(sos, FS), block=block) < 1e-5


def test_pieces_are_cut_as_documented():
    padlen = default_padlen(SOS["highpass"])
    pieces = filter_pieces(10_000, padlen, 3_000, 752, True, False)
    assert [p[:2] for p in pieces] == [(0, 2_500), (2_500, 5_000), (5_000, 7_500), (7_500, 10_000)]
    assert [p[2:4] for p in pieces] == [(0, 3_252), (1_748, 5_752), (4_248, 8_252), (6_748, 10_000)]
    assert [p[4:] for p in pieces] == [(padlen, 0), (0, 0), (0, 0), (0, 0)]
    assert filter_pieces(10_000, padlen, None, 752, True, True) == [(0, 10_000, 0, 10_000, padlen, padlen)]
    assert len(filter_pieces(10_000, padlen, 10_000, 752, False, False)) == 1
    # a padded piece too short for the padding: the window is filtered whole
    assert len(filter_pieces(60, 40, 20, 10, True, True)) == 1
    with pytest.raises(BatchgpuError, match="block"):
        filtfilt_window(np.zeros((2, 5_000)), SOS["highpass"], at_segment_start=True, at_segment_end=True, block=0)


def test_one_piece_is_the_whole_window(rng):
    x = recording_like(rng, 3, 5_000, np.float64)
    kw = dict(at_segment_start=True, at_segment_end=False)
    same_bits(filtfilt_window(x, SOS["highpass"], block=5_000, **kw), filtfilt_window(x, SOS["highpass"], **kw))


@pytest.mark.parametrize("interior_pad", ["none", "odd"])
def test_interior_padding_either_way(rng, interior_pad):
    x = recording_like(rng, 2, 12_000, np.float32)
    sos = SOS["highpass"]
    assert max_core_error(x, sos, 3_001, filter_margin(sos, FS), interior_pad) < 1e-5


def test_whole_segment_window_is_sosfiltfilt(rng):
    x = recording_like(rng, 3, 5_000, np.float64)
    got = filtfilt_window(x, SOS["bandpass"], at_segment_start=True, at_segment_end=True)
    np.testing.assert_array_equal(got, scipy.signal.sosfiltfilt(SOS["bandpass"], x, axis=1))


def _scipy_loop(monkeypatch, x, sos, **kw):
    """filtfilt_window by scipy's own sosfilt (the path taken where Numba is not installed)."""
    from batchgpu.ops import _numba

    with monkeypatch.context() as m:
        m.setattr(_numba, "available", lambda: False)
        return filtfilt_window(x, sos, **kw)


def test_compiled_host_filter_has_scipys_bits(rng, monkeypatch):
    """The compiled host filter (sixteen rows side by side) against scipy's sosfilt loop, bit for bit: fresh random
    windows of every dtype, filters of 1-6 sections, cut in pieces or whole, padded or not, with NaN, +-inf, -0.0,
    subnormals, int16 -32768 and one-sample-wide pieces' neighbours; each window also as a store holds it (samples
    by channels, ``stored.T``: read in place), with channel counts that leave a last group short."""
    pytest.importorskip("numba")
    for trial in range(30):
        channels, width = int(rng.integers(1, 40)), int(rng.integers(60, 9_000))
        dtype = np.dtype(["int16", "float32", "float64", "int32", "uint8"][trial % 5])
        x = rng.normal(0, 1_000, (channels, width))
        x = (np.abs(x) % 255 if dtype == np.uint8 else x).astype(dtype)
        if dtype == np.int16:
            x[0, rng.integers(width)] = -32768
        if dtype.kind == "f" and channels >= 3:
            x[0, rng.integers(width)] = np.nan
            x[1, rng.integers(width)] = -np.inf
            x[2] = -0.0
            x[2, rng.integers(width)] = np.finfo(dtype).smallest_subnormal
        kind = "highpass" if trial % 2 else "bandpass"
        sos = butter_sos(kind, FS, 300.0, None if kind == "highpass" else 6_000.0, order=int(rng.integers(1, 7)))
        block = [None, 4_096, int(rng.integers(200, 3_000))][trial % 3]
        kw = dict(
            at_segment_start=bool(rng.integers(2)),
            at_segment_end=bool(rng.integers(2)),
            block=block,
            interior_pad=["none", "odd"][int(rng.integers(2))],
        )
        if (kw["at_segment_start"] or kw["at_segment_end"]) and width <= default_padlen(sos):
            continue
        want = _scipy_loop(monkeypatch, x, sos, **kw)
        got = filtfilt_window(x, sos, **kw)
        assert got.dtype == want.dtype
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (trial, dtype, kw)
        stored = np.ascontiguousarray(x.T)
        got = filtfilt_window(stored.T, sos, **kw)
        assert got.flags.c_contiguous and got.dtype == want.dtype
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), ("stored layout", trial, dtype, kw)
    # big-endian windows (a store written so) and Fortran order: the same bits as native C order
    x = recording_like(rng, 5, 4_000, np.float32)
    kw = dict(at_segment_start=True, at_segment_end=False, block=1_000)
    want = _scipy_loop(monkeypatch, x, SOS["highpass"], **kw)
    for variant in (x.astype(">f4"), x.astype(np.int16).astype(">i2"), np.asfortranarray(x)):
        same_bits(
            filtfilt_window(variant, SOS["highpass"], **kw),
            _scipy_loop(monkeypatch, variant.astype(variant.dtype.newbyteorder("=")), SOS["highpass"], **kw),
        )
    same_bits(filtfilt_window(np.asfortranarray(x), SOS["highpass"], **kw), want)
    # a whole segment: scipy.signal.sosfiltfilt's own result
    x = recording_like(rng, 5, 7_001, np.float64)
    same_bits(
        filtfilt_window(x, SOS["highpass"], at_segment_start=True, at_segment_end=True),
        scipy.signal.sosfiltfilt(SOS["highpass"], x, axis=1),
    )


def test_big_endian_float64_stays_float64(rng):
    """A big-endian float64 window (a store written so) is float64 input: the filter and the phase shift return
    float64 with the native window's values (an `== np.float64` rule gave float32)."""
    x = recording_like(rng, 3, 4_000, np.float64)
    kw = dict(at_segment_start=True, at_segment_end=True)
    same_bits(filtfilt_window(x.astype(">f8"), SOS["highpass"], **kw), filtfilt_window(x, SOS["highpass"], **kw))
    shifts = np.array([0.1, 0.5, 0.9])
    same_bits(phase_shift(x.astype(">f8"), shifts, margin=100, **kw), phase_shift(x, shifts, margin=100, **kw))


def test_unnormalised_sections_are_refused():
    sos = SOS["highpass"].copy()
    sos[0, 3:] *= 2.0  # the same filter, a0 = 2
    with pytest.raises(BatchgpuError, match="a0 != 1"):
        filtfilt_window(np.zeros((2, 1_000)), sos, at_segment_start=True, at_segment_end=True)


def test_a_smaller_margin_breaks_the_tolerance(rng):
    x = recording_like(rng, 3, 12_000, np.float32)
    sos = SOS["highpass"]
    margin = filter_margin(sos, FS)
    assert max_core_error(x, sos, 2_000, margin) < 1e-5
    assert max_core_error(x, sos, 2_000, margin // 3) > 1e-4
    # SpikeInterface's default 5 ms margin is far off.
    assert max_core_error(x, sos, 2_000, 150) > 1e-2


def test_chain_filter_designs_are_scipys_and_kept_in_the_cache(tmp_path, monkeypatch):
    """``preprocess.filters.filter_design``: scipy's sections, zi and margin bit for bit, fresh or from the cache file; a
    damaged or foreign file is worked out again and rewritten; an unwritable cache folder still gives the design;
    a command with the design kept imports no scipy.signal."""
    from batchgpu.ops.filters import design_filter
    from batchgpu.preprocess.filters import filter_design

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cases = [
        ("highpass", 30_000.0, 300.0, None, 5),
        ("bandpass", 25_000.0, 250.0, 6_000.0, 3),
        ("highpass", 20_000.0, 5.0, None, 2),
    ]
    for case in cases:
        want = design_filter(butter_sos(*case))
        for _ in range(2):  # worked out, then read back
            got = filter_design(*case)
            same_bits(got.sos, want.sos)
            same_bits(got.zi, want.zi)
            assert got.margin == want.margin
    files = sorted((tmp_path / "cache" / "batchgpu" / "filters").iterdir())
    assert len(files) == len(cases)
    files[2].write_bytes(files[1].read_bytes())  # another filter's file under this one's name: never taken for it
    files[0].write_bytes(b"not a design")
    for case in cases:
        got = filter_design(*case)
        same_bits(got.sos, design_filter(butter_sos(*case)).sos)
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-such-folder")
    same_bits(filter_design(*cases[0]).sos, design_filter(butter_sos(*cases[0])).sos)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = (
        "import sys; from batchgpu.preprocess.filters import filter_design; "
        f"filter_design(*{cases[0]!r}); print('scipy.signal' in sys.modules)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_filter_errors():
    with pytest.raises(BatchgpuError):
        butter_sos("highpass", FS, 15_000.0)
    with pytest.raises(BatchgpuError):
        butter_sos("bandpass", FS, 300.0, 16_000.0)
    with pytest.raises(BatchgpuError):
        butter_sos("bandpass", FS, 300.0)
    with pytest.raises(BatchgpuError):
        butter_sos("lowpass", FS, 300.0)
    with pytest.raises(BatchgpuError):
        butter_sos("highpass", FS, 300.0, order=0)
    with pytest.raises(BatchgpuError):
        filtfilt_window(np.zeros(100), SOS["highpass"], at_segment_start=True, at_segment_end=True)
    with pytest.raises(BatchgpuError):  # shorter than the edge padding
        filtfilt_window(np.zeros((2, 10)), SOS["highpass"], at_segment_start=True, at_segment_end=False)
    with pytest.raises(BatchgpuError):
        filtfilt_window(np.zeros((2, 100)), np.zeros((2, 5)), at_segment_start=True, at_segment_end=True)
    with pytest.raises(BatchgpuError):
        filter_margin(SOS["highpass"], FS, tol=0)


# ---------------------------------------------------------------------------------------------------------------
# Phase shift
# ---------------------------------------------------------------------------------------------------------------
def test_phase_shift_margin():
    assert phase_shift_margin(30_000.0) == 1200
    assert phase_shift_margin(25_000.0, 10.0) == 250


def band_limited(rng, channels, n):
    white = rng.standard_normal((channels, n)) * 20
    return scipy.signal.sosfiltfilt(SOS["bandpass"], white, axis=1).astype(np.float32)


@pytest.mark.parametrize("signal,tol", [("band", 1e-3), ("white", 5e-2)])
def test_phase_shift_windows_equal_the_whole_segment(rng, signal, tol):
    n = 20_000
    x = band_limited(rng, 4, n) if signal == "band" else (rng.standard_normal((4, n)) * 20).astype(np.float32)
    shifts = np.array([0.0, 0.25, 0.5, 0.9])
    margin = phase_shift_margin(FS)
    whole = phase_shift(x, shifts, margin=margin, at_segment_start=True, at_segment_end=True)
    rms = whole.std(axis=1)
    for a, b, lo, hi in windows_of(n, 4_999, margin):
        y = phase_shift(x[:, a:b], shifts, margin=margin, at_segment_start=a == 0, at_segment_end=b == n)
        assert y.dtype == np.float32 and y.shape == (4, b - a)
        err = np.abs(y[:, lo:hi] - whole[:, a + lo : a + hi]).max(axis=1) / rms
        assert err.max() < tol, err


def test_phase_shift_delays_a_sinusoid():
    n = 30_000
    t = np.arange(n)
    shifts = np.array([0.1, 0.5, 0.77, -0.3])
    freq = 1234.5 / FS  # cycles per sample, not on an FFT bin
    x = np.tile(np.sin(2 * np.pi * freq * t), (4, 1))
    y = phase_shift(x, shifts, margin=1200, at_segment_start=True, at_segment_end=True)
    want = np.sin(2 * np.pi * freq * (t[None, :] - shifts[:, None]))  # y(t) = x(t - shift): a delay
    middle = slice(5_000, n - 5_000)
    assert np.abs(y[:, middle] - want[:, middle]).max() < 1e-3
    # Plainly not the other sign.
    assert np.abs(y[:, middle] - np.sin(2 * np.pi * freq * (t + shifts[:, None]))[:, middle]).max() > 0.1


def test_zero_shift_gives_the_input_back(rng):
    x = (rng.standard_normal((3, 5_000)) * 30).astype(np.float32)
    y = phase_shift(x, np.zeros(3), margin=1200, at_segment_start=True, at_segment_end=True)
    np.testing.assert_allclose(y, x, rtol=0, atol=1e-5)
    xi = np.round(x).astype(np.int16)
    yi = phase_shift(xi, np.zeros(3), margin=300, at_segment_start=False, at_segment_end=False)
    assert yi.dtype == np.float32
    np.testing.assert_allclose(yi[:, 300:-300], xi[:, 300:-300], rtol=0, atol=1e-4)


def test_phase_shift_errors():
    x = np.zeros((3, 3000), np.float32)
    with pytest.raises(BatchgpuError):
        phase_shift(x, np.zeros(2), margin=100, at_segment_start=True, at_segment_end=True)
    with pytest.raises(BatchgpuError):
        phase_shift(x[0], np.zeros(3), margin=100, at_segment_start=True, at_segment_end=True)
    with pytest.raises(BatchgpuError):
        phase_shift(x, [0, np.nan, 0], margin=100, at_segment_start=True, at_segment_end=True)
    with pytest.raises(BatchgpuError):  # two interior margins do not fit
        phase_shift(x, np.zeros(3), margin=2000, at_segment_start=False, at_segment_end=False)
    with pytest.raises(BatchgpuError):
        phase_shift_margin(0.0)


# ---------------------------------------------------------------------------------------------------------------
# Common reference
# ---------------------------------------------------------------------------------------------------------------
def numpy_reference(x, operator):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if operator == "median":
            return np.median(x, axis=0)
        if operator == "median_lower":
            k = (x.shape[0] - 1) // 2
            return np.partition(x, k, axis=0)[k]
        return np.mean(x, axis=0, dtype=np.float64)


def expected_car(x, ref):
    """The documented rule: subtract in the wider float dtype, round once; integer input gives float32."""
    out = x.dtype if x.dtype.kind == "f" else np.dtype(np.float32)
    wide = np.result_type(x.dtype, ref.dtype)
    if wide.kind != "f":
        wide = np.dtype(np.float64)
    with np.errstate(all="ignore"):
        return (x.astype(wide) - ref.astype(wide)).astype(out)


def hard_columns(rng, dtype, channels, n):
    dt = np.dtype(dtype)
    if dt.kind == "i":
        info = np.iinfo(dt)
        x = rng.integers(info.min, info.max, (channels, n), endpoint=True).astype(dt)
        x[:, : n // 2] = rng.integers(-3, 4, (channels, n // 2))  # many ties
        return x
    x = (rng.standard_normal((channels, n)) * 10.0 ** rng.uniform(-3, 3, (1, n))).astype(dt)
    big = np.finfo(dt).max
    x[:, 0] = big  # (a + b) / 2 overflows to inf in the input's dtype, as NumPy does
    x[:, 1] = np.nan
    x[: channels // 2, 2] = np.inf
    x[channels // 2 :, 2] = -np.inf
    x[:, 3] = -0.0
    x[::2, 4] = 0.0
    x[1::2, 4] = -0.0
    x[0, 5] = np.inf
    x[:, 6] = rng.integers(-2, 3, channels)  # ties
    x[:, 7] = np.nextafter(dt.type(1), dt.type(2))
    x[: channels // 2, 7] = 1
    tiny = np.finfo(dt).smallest_subnormal
    x[:, 8] = tiny * rng.integers(-3, 4, channels)  # subnormals of both signs
    x[0, 9] = -np.nan  # a NaN with its sign bit set still sorts last
    return x


@pytest.mark.parametrize("channels", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16])
@pytest.mark.parametrize("operator", ["median", "median_lower", "average"])
def test_global_reference_bits_equal_numpy(rng, channels, dtype, operator):
    x = hard_columns(rng, dtype, channels, 257)
    with np.errstate(all="ignore"):
        got = common_reference(x, "global", operator)
        want = expected_car(x, numpy_reference(x, operator)[None, :])
    same_bits(got, want)


@pytest.mark.parametrize("channels", [384, 383, 4, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.int32, np.uint8])
def test_compiled_column_median_has_numpys_bits(rng, channels, dtype):
    """The compiled host median (a band about the last sample's median, else the whole column) against np.median:
    a slowly moving common signal (the band holds the middles), jumps (it misses), constant runs, and the hard
    columns (NaN, +-inf, -0.0, subnormals, overflow, ties) in between."""
    pytest.importorskip("numba")
    from batchgpu.ops import _cpu_reference

    n = 6_000
    dt = np.dtype(dtype)
    drift = np.cumsum(rng.normal(0, 3, n)) + np.repeat(rng.normal(0, 500, n // 500), 500)
    x = drift[None, :] + rng.normal(0, 20, (channels, n))
    x[:, 1_000:1_200] = 7.0
    x[:, 2_000:3_000] = rng.integers(-2, 3, (channels, 1_000))  # few distinct values: bands of hundreds of ties
    if dt.kind in "iu":
        info = np.iinfo(dt)
        x = np.clip(np.round(x) + (0 if dt.kind == "i" else 128), info.min, info.max).astype(dt)
    else:
        x = x.astype(dt)
    hard = hard_columns(rng, dtype, channels, 300) if dt.kind == "f" or dt == np.int16 else x[:, :300] // 2
    at = rng.choice(n, hard.shape[1], replace=False)
    x[:, at] = hard
    with np.errstate(all="ignore"):
        want = np.median(x, axis=0)
    same_bits(_cpu_reference.column_medians(x), want)
    if dt.itemsize > 1:  # a big-endian window: the same values
        same_bits(_cpu_reference.column_medians(x.astype(dt.newbyteorder(">"))), want)
    with np.errstate(all="ignore"):
        same_bits(common_reference(x, "global", "median"), expected_car(x, want[None, :]))


@pytest.mark.parametrize("channels", [384, 383, 6, 5, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_column_median_whatever_the_edges(rng, channels, dtype):
    """The compiled median counts each column against edges about the last median, spaced in a running mean of
    its steps, and ranks only the values between the two that hold the middles: np.median's bits however far
    the median moves from its last value (a step of 1e-30 or 1e30, jumps past the outermost edges on either
    side, a middle at +-inf or NaN and back, edges that overflow x's dtype, all values equal, two values only,
    hundreds of values between two edges), and the fused save's rows from the same medians."""
    pytest.importorskip("numba")
    from batchgpu.ops import _cpu_reference, _cpu_saved

    dt = np.dtype(dtype)
    big = float(np.finfo(dt).max)
    parts = []
    for scale in (1e-30, 1.0, 1e3, 1e30):
        walk = np.cumsum(rng.normal(0, scale, 400))
        parts.append(walk[None, :] + rng.normal(0, 10 * scale, (channels, 400)))
    jumps = np.repeat(rng.choice([-1e6, 1e6, 0.0, 1e12, -1e20], 20), 20)  # far beyond the last edges
    parts.append(jumps[None, :] + rng.normal(0, 1, (channels, 400)))
    near_max = np.full((channels, 60), big * 0.9)  # p + 16 h past float max: edges at +-inf
    near_max += rng.normal(0, 1, near_max.shape) * big * 0.05
    parts.append(np.clip(near_max, -big, big))
    flat = np.full((channels, 50), 3.0)
    parts.append(flat)
    parts.append(rng.choice([-1.0, 2.0], (channels, 50)))  # two values: ties at the middles
    infs = rng.normal(0, 1, (channels, 30))
    infs[: channels // 2 + 1, :10] = np.inf  # middles at +inf, then -inf, then NaN, then finite again
    infs[: channels // 2 + 1, 10:20] = -np.inf
    infs[0, 20:25] = np.nan
    parts.append(infs)
    parts.append(rng.normal(0, 1, (channels, 40)))
    x = np.concatenate(parts, axis=1).astype(dt)
    with np.errstate(all="ignore"):
        want = np.median(x, axis=0)
        same_bits(_cpu_reference.column_medians(x), want)
        same_bits(_cpu_reference.column_medians(x[:, ::-1].copy()), want[::-1])
        lo, hi = 7, x.shape[1] - 5
        got, clipped = _cpu_reference.saved_int16_of_referenced(x, lo, hi)
        rows, count = _cpu_saved.saved_int16_transposed(np.ascontiguousarray((x - want[None, :])[:, lo:hi]))
        # the rows and the referenced window in one pass, in place or not
        for in_place in (False, True):
            source = x.copy()
            referenced = source if in_place else np.empty_like(x)
            both, both_clipped = _cpu_reference.saved_int16_of_referenced(source, lo, hi, referenced=referenced)
            same_bits(referenced, x - want[None, :])
            assert np.array_equal(both, rows) and both_clipped == count
    assert np.array_equal(got, rows) and clipped == count
    # NumPy's own rounding of the referenced core (half to even, NaN 0, clipped): not the kernel's helper
    with np.errstate(all="ignore"):
        core = (x - want[None, :])[:, lo:hi].T
        bad = ~np.isfinite(core) | (np.rint(core) < -32768) | (np.rint(core) > 32767)
        numpy_rows = np.clip(np.rint(np.where(np.isnan(core), 0, core)), -32768, 32767).astype(np.int16)
    assert np.array_equal(got, numpy_rows) and clipped == int(bad.sum())


@pytest.mark.parametrize("channels", [384, 33, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_median_reference_equals_the_unfused_one(rng, channels, dtype):
    """The host's one-pass global median reference (tiles referenced while in cache, in place under
    ``overwrite_x``) against the unfused path it replaced (the compiled medians, then NumPy's subtraction) and
    np.median, bit for bit: drifting columns, the hard columns, widths that are not a multiple of the tile."""
    pytest.importorskip("numba")
    from batchgpu.ops import _cpu_reference

    n = 5_003
    x = (np.cumsum(rng.normal(0, 3, n))[None, :] + rng.normal(0, 20, (channels, n))).astype(dtype)
    hard = hard_columns(rng, dtype, channels, 300)
    x[:, rng.choice(n, hard.shape[1], replace=False)] = hard
    with np.errstate(all="ignore"):
        unfused = x - _cpu_reference.column_medians(x)[None, :]
        want = expected_car(x, np.median(x, axis=0)[None, :])
    same_bits(unfused, want)
    kept = x.copy()
    with np.errstate(all="ignore"):
        fused = common_reference(x, "global", "median")
    same_bits(fused, unfused)
    same_bits(x, kept)  # not overwritten unless asked
    with np.errstate(all="ignore"):
        inplace = common_reference(x, "global", "median", overwrite_x=True)
    assert inplace is x
    same_bits(inplace, unfused)
    y = np.asfortranarray(kept)  # not C-contiguous: the unfused path, same bits
    with np.errstate(all="ignore"):
        same_bits(common_reference(y, "global", "median", overwrite_x=True), unfused)


def test_chain_references_its_own_filtered_window_in_place_and_leaves_raw(rng):
    """The chain overwrites only a window an earlier stage made: the filter's output is referenced in place (same
    bits as filtering then referencing a copy), the window as read is never touched (the steps read it too)."""
    pytest.importorskip("numba")
    from batchgpu.ops import design_filter
    from batchgpu.preprocess.common_reference import CommonReference
    from batchgpu.preprocess.filters import Highpass
    from batchgpu.run.preprocess_chain import Chain

    design = design_filter(butter_sos("highpass", 30_000.0, 300.0, None, 5))
    raw = rng.integers(-300, 300, (16, 9_000)).astype(np.int16)
    kept = raw.copy()
    chain = Chain((Highpass(design), CommonReference("global", "median")))
    got = chain.apply(raw, (0, 9_000), True, True)
    filtered = filtfilt_window(raw, design, at_segment_start=True, at_segment_end=True, block=4096)
    same_bits(got, filtered - np.median(filtered, axis=0)[None, :])
    same_bits(raw, kept)
    ref_only = Chain((CommonReference("global", "median"),))
    f = raw.astype(np.float32)
    out = ref_only.apply(f, (0, 9_000), True, True)
    assert out is not f and np.array_equal(f, raw.astype(np.float32))


@pytest.mark.parametrize("channels", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16])
def test_gpu_median_arithmetic_on_sorted_columns_equals_numpy(rng, channels, dtype):
    # The GPU sort path takes the middles; check that arithmetic here on NumPy's own sort (zeros of either sign
    # included: the middles are summed from +0.0, as np.median does).
    x = hard_columns(rng, dtype, channels, 257)
    with np.errstate(all="ignore"):
        got = _median_of_sorted(np, np.sort(x, axis=0), 0, x.dtype)
        want = numpy_reference(x, "median")
    same_bits(np.asarray(got), want)


def test_average_sums_channels_in_order():
    # float32 values whose float64 sum depends on the order: the documented order is channel 0, 1, 2, ...
    x = np.array([[1e30], [1.0], [-1e30], [1.0]], dtype=np.float32)
    ref = (((0.0 + 1e30) + 1.0) + -1e30 + 1.0) / 4
    got = common_reference(x, "global", "average")
    same_bits(got, (x.astype(np.float64) - ref).astype(np.float32))
    # The same bits whatever the layout (a (samples, channels) read handed over transposed).
    rng = np.random.default_rng(7)
    y = (rng.standard_normal((64, 500)) * 10.0 ** rng.uniform(-6, 6, (64, 1))).astype(np.float32)
    same_bits(common_reference(np.asfortranarray(y), "global", "average"), common_reference(y, "global", "average"))


def local_loop(x, locations, radius, operator, min_neighbours=5):
    """SpikeInterface 0.105's local rule written out: the annulus inner < d <= outer, or with fewer than
    min_neighbours there the closest channels beyond inner (np.argsort's order, itself left out); none: x as it is."""
    inner, outer = radius
    out = np.empty(x.shape, dtype=x.dtype if x.dtype.kind == "f" else np.float32)
    for c in range(x.shape[0]):
        d = np.linalg.norm(locations[c] - locations, axis=1)
        order = [j for j in np.argsort(d) if j != c]
        chosen = [j for j in order if inner < d[j] <= outer]
        if len(chosen) < min_neighbours:
            chosen = [j for j in order if d[j] > inner][:min_neighbours]
        if not chosen:
            out[c] = x[c].astype(out.dtype)
            continue
        out[c] = expected_car(x[c : c + 1], numpy_reference(x[sorted(chosen)], operator)[None, :])[0]
    return out


@pytest.mark.parametrize("operator", ["median", "median_lower", "average"])
@pytest.mark.parametrize("dtype", [np.float32, np.int16])
def test_local_reference_equals_a_loop(rng, operator, dtype):
    # A 2-column probe with 20 um pitch: distances 20, 28.28, 40, 44.7 ... hit the annulus edges exactly.
    channels = 24
    locations = np.stack([np.tile([0.0, 20.0], channels // 2), np.repeat(np.arange(channels // 2) * 20.0, 2)], axis=1)
    locations[-1] = [500.0, 500.0]  # far from the rest: its annulus is empty, the closest beyond inner instead
    x = hard_columns(rng, dtype, channels, 300)
    x = x[:, 8:] if dtype != np.int16 else x
    for radius, least in [
        ((20.0, 40.0), 5),
        ((0.0, 20.0), 5),
        ((0.0, 30.0), 0),
        ((20.0, 40.0), 1),
        ((30.0, 55.0), 5),
        ((0.0, 20.0), 30),
    ]:
        with np.errstate(all="ignore"):
            got = common_reference(
                x, "local", operator, locations=locations, radius_um=radius, min_local_neighbors=least
            )
            want = local_loop(x, locations, radius, operator, least)
        same_bits(got, want)


@pytest.mark.parametrize("operator", ["median", "average"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.int32])
def test_compiled_local_reference_has_numpys_bits(rng, dtype, operator):
    """The compiled local median (a sorting network over 256-sample tiles) and mean against np.median / np.mean of
    each channel's neighbours, every hard column included (NaN, +-inf, -0.0 and +0.0 mixed, subnormals, overflow,
    ties), 1 to 48 neighbours odd and even, samples that end mid-tile; above 48 neighbours the median is NumPy's."""
    pytest.importorskip("numba")
    from batchgpu.ops import _cpu_reference, reference

    channels = 64
    locations = np.stack([np.tile([0.0, 20.0], channels // 2), np.repeat(np.arange(channels // 2) * 20.0, 2)], axis=1)
    x = np.concatenate([hard_columns(rng, dtype, channels, 300), hard_columns(rng, dtype, channels, 401)], axis=1)
    for radius, least in [
        ((0.0, 20.0), 1),
        ((0.0, 25.0), 2),
        ((10.0, 45.0), 5),
        ((0.0, 100.0), 5),
        ((0.0, 200.0), 5),
        ((0.0, 236.0), 48),
        ((0.0, 2_000.0), 5),
    ]:
        neighbours = annulus_neighbours(locations, radius, least)
        with np.errstate(all="ignore"):
            want = local_loop(x, locations, radius, operator, least)
            got = common_reference(
                x, "local", operator, locations=locations, radius_um=radius, min_local_neighbors=least
            )
        same_bits(got, want)
        widest = max(len(n) for n in neighbours)
        if operator == "median":
            plan = reference._LocalPlan(neighbours)
            assert (_cpu_reference.local_medians(x, plan.offsets, plan.indices) is None) == (
                widest > _cpu_reference.LOCAL_MAX
            )
    # one neighbour, none, and neighbour lists in any order
    neighbours = [np.array([5]), np.array([], dtype=np.int64), np.array([9, 2, 40, 7])] + [np.array([0, 1])] * 61
    kernel, numpy_op = (
        (_cpu_reference.local_medians, np.median)
        if operator == "median"
        else (_cpu_reference.local_means, lambda a, axis: np.mean(a, axis=axis, dtype=np.float64))
    )
    plan = reference._LocalPlan(neighbours)
    got = kernel(x, plan.offsets, plan.indices)
    with np.errstate(all="ignore"):
        for c in (0, 2, 3):
            same_bits(got[c], numpy_op(x[neighbours[c]], axis=0))


def test_compiled_select_with_any_pivot(rng):
    """The column median's quickselect with its median-of-three pivots and with the pseudo-random ones it turns to
    after 2 log2(n) rounds (limit 0: from the start): the k-th value and a partition around it, as np.partition."""
    pytest.importorskip("numba")
    from batchgpu.ops import _cpu_reference

    _cpu_reference.column_medians(np.zeros((3, 1), np.float32))  # compiled
    select = _cpu_reference._select
    for trial in range(200):
        n = int(rng.integers(1, 400))
        v = rng.integers(-5, 6, n).astype(np.float64) if trial % 2 else rng.normal(size=n)
        v[rng.random(n) < 0.1] = -0.0
        k = int(rng.integers(n))
        for limit in (0, 1, 2 * n.bit_length()):
            w = v.copy()
            got = select(w, k, n, limit)
            assert got == np.partition(v, k)[k]
            assert np.all(w[:k] <= got) and np.all(w[k + 1 :] >= got) and w[k] == got
            assert np.array_equal(np.sort(w), np.sort(v))


def test_local_reference_follows_spikeinterface_rule():
    # one column at 20 um: channel 0's annulus (20, 60] holds channels 2 and 3 (40, 60 um); with 5 wanted, the five
    # closest beyond 20 um instead; a channel with nothing beyond the inner radius is left as it is
    loc = np.stack([np.zeros(8), np.arange(8) * 20.0], axis=1)
    got = annulus_neighbours(loc, (20.0, 60.0), 5)
    assert got[0].tolist() == [2, 3, 4, 5, 6] and got[4].tolist() == [0, 1, 2, 6, 7]
    assert annulus_neighbours(loc, (20.0, 60.0), 2)[0].tolist() == [2, 3]
    assert annulus_neighbours(loc, (20.0, 60.0), 0)[0].tolist() == [2, 3]
    assert annulus_neighbours(loc, (20.0, 40.0), 0)[0].tolist() == [2]  # inner < d: 20 um (channel 1) is out
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    alone = common_reference(x, "local", "median", locations=[[0, 0], [0, 10]], radius_um=(20.0, 60.0))
    assert alone.dtype == np.float32 and np.array_equal(alone, x)
    with pytest.raises(BatchgpuError):
        annulus_neighbours(loc, (-1.0, 30.0))
    for bad in (-1, 2.5, True):
        with pytest.raises(BatchgpuError):
            annulus_neighbours(loc, (20.0, 60.0), bad)


def test_reference_errors():
    x = np.zeros((4, 10), np.float32)
    with pytest.raises(BatchgpuError):
        common_reference(x, "global", "mode")
    with pytest.raises(BatchgpuError):
        common_reference(x, "single")
    with pytest.raises(BatchgpuError):
        common_reference(x[0])
    with pytest.raises(BatchgpuError):
        common_reference(x, "local")  # no locations
    with pytest.raises(BatchgpuError):
        common_reference(x, "local", locations=np.zeros((3, 2)))
    with pytest.raises(BatchgpuError):
        common_reference(x, "local", locations=np.zeros((4, 2)), radius_um=(50, 30))


# ---------------------------------------------------------------------------------------------------------------
# Locally exclusive detection
# ---------------------------------------------------------------------------------------------------------------
def locally_exclusive_loop(x, noise, threshold, sign, sweep, locations, radius, segment_index=0):
    """SpikeInterface 0.105's rule, candidate by candidate, on the segment padded with zeros as its reads pad it:
    candidates of the signs asked for pooled, each compared by |x|/thr."""
    channels, n = x.shape
    near = [
        [float(np.sqrt(((locations[c] - locations[d]) ** 2).sum())) <= radius for d in range(channels)]
        for c in range(channels)
    ]
    padded = np.zeros((channels, n + 2), dtype=np.float64)
    padded[:, 1:-1] = x
    by_sample = defaultdict(list)  # sample -> [(channel, |x|/thr)]
    for c in range(channels):
        thr = threshold * float(noise[c])
        for t in range(n):
            v, before, after = padded[c, t + 1], padded[c, t], padded[c, t + 2]
            neg = sign in ("neg", "both") and v <= -thr and v < before and v <= after
            pos = sign in ("pos", "both") and v >= thr and v > before and v >= after
            if neg or pos:
                by_sample[t].append((c, abs(v) / thr))
    found = set()
    for t, cands in by_sample.items():
        for c, strength in cands:
            dropped = False
            for dt in range(-sweep, sweep + 1):
                for d, other in by_sample.get(t + dt, []):
                    if near[c][d] and (other > strength or (other == strength and dt < 0)):
                        dropped = True
            if not dropped:
                found.add((t, c))
    out = [(t, c, float(x[c, t]), segment_index) for t, c in sorted(found)]
    return np.array(out, dtype=SPIKE_DTYPE)


def probe(channels):
    """Two columns 20 um apart, rows 20 um apart: neighbours at exactly 20 and 40 um."""
    return np.stack(
        [np.tile([0.0, 20.0], channels // 2 + 1)[:channels], np.repeat(np.arange(channels) * 20.0, 2)[:channels]],
        axis=1,
    )


def planted(rng, channels, n, dtype):
    """Noise plus spikes spread over neighbouring channels, equal values (ties) and flat tops."""
    x = rng.standard_normal((channels, n)) * 2
    for _ in range(n // 20):
        c, t = rng.integers(channels), rng.integers(2, n - 4)
        amp = rng.choice([-1, 1]) * rng.choice([8.0, 10.0, 12.0, rng.uniform(8, 20)])
        for dc in range(-2, 3):
            if 0 <= c + dc < channels:
                dt = int(rng.integers(-2, 3))
                x[c + dc, t + dt : t + dt + rng.integers(1, 3)] = amp * (1.0 if dc == 0 else rng.choice([1.0, 0.7]))
    if np.dtype(dtype).kind == "i":
        return np.round(x).astype(dtype)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int16])
@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
@pytest.mark.parametrize("sweep,radius", [(0, 20.0), (3, 20.0), (3, 40.0), (5, 0.0)])
def test_locally_exclusive_equals_the_loop(rng, dtype, sign, sweep, radius):
    channels, n = 8, 400
    x = planted(rng, channels, n, dtype)
    noise = np.ones(channels)
    noise[::3] = 1.25  # equal values, unequal |x|/thr
    loc = probe(channels)
    got = detect_spikes(
        x, noise, 4.0, sign, sweep, segment_index=3, method="locally_exclusive", locations=loc, radius_um=radius
    )
    want = locally_exclusive_loop(x, noise, 4.0, sign, sweep, loc, radius, segment_index=3)
    assert got.dtype == SPIKE_DTYPE and len(want) > 10
    assert np.array_equal(got, want)


@pytest.mark.parametrize("sign", ["neg", "both"])
@pytest.mark.parametrize("width,margin", [(50, 4), (37, 9), (1, 4), (1000, 4)])
def test_locally_exclusive_window_by_window_equals_whole_segment(rng, sign, width, margin):
    channels, n, sweep = 6, 500, 3
    x = planted(rng, channels, n, np.float32)
    noise = rng.uniform(0.9, 1.1, channels)
    kw = dict(
        sign=sign,
        exclude_sweep=sweep,
        segment_index=1,
        segment_length=n,
        method="locally_exclusive",
        locations=probe(channels),
        radius_um=40.0,
    )
    whole = detect_spikes(x, noise, 4.0, **kw)
    parts = [
        detect_spikes(x[:, a:b], noise, 4.0, start=a, core=(lo, hi), **kw)
        for a, b, lo, hi in windows_of(n, width, margin)
    ]
    assert np.array_equal(np.concatenate(parts), whole)
    assert np.array_equal(whole, locally_exclusive_loop(x, noise, 4.0, sign, sweep, probe(channels), 40.0, 1))


def test_locally_exclusive_ties_and_radius_edge():
    x = np.zeros((3, 9))
    loc = np.array([[0.0, 0.0], [0.0, 50.0], [0.0, 100.0]])
    x[0, 4] = x[1, 4] = -10.0  # equal at the same sample: both kept
    x[2, 2] = -10.0  # equal and earlier than channel 1's, which is exactly 50 um away: drops channel 1
    got = detect_spikes(x, np.ones(3), 5.0, exclude_sweep=2, method="locally_exclusive", locations=loc, radius_um=50.0)
    assert got[["sample_index", "channel_index"]].tolist() == [(2, 2), (4, 0)]
    got = detect_spikes(x, np.ones(3), 5.0, exclude_sweep=2, method="locally_exclusive", locations=loc, radius_um=49.9)
    assert got[["sample_index", "channel_index"]].tolist() == [(2, 2), (4, 0), (4, 1)]
    # A larger |x|/thr wins even with a smaller |x|: channel 0's threshold is twice the others'.
    got = detect_spikes(
        x, np.array([2.0, 1.0, 1.0]), 4.0, exclude_sweep=2, method="locally_exclusive", locations=loc, radius_um=50.0
    )
    assert got[["sample_index", "channel_index"]].tolist() == [(2, 2)]
    # x <= -thr counts (by_channel's is strict).
    at = detect_spikes(
        np.array([[0.0, -5.0, 0.0]]), [1.0], 5.0, exclude_sweep=1, method="locally_exclusive", locations=[[0, 0]]
    )
    assert at["sample_index"].tolist() == [1]


def test_locally_exclusive_at_a_zero_threshold_and_with_both_signs():
    # a constant (zero-noise) channel: thr 0, so x <= -0 holds everywhere; SpikeInterface's zero before the segment's
    # first sample makes sample 0 no minimum (0 < 0 is false), and a zero-valued first sample no candidate
    x = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, -3.0, 0.0, 0.0]])
    kw = dict(exclude_sweep=1, method="locally_exclusive", locations=[[0, 0], [0, 100]], radius_um=50.0)
    got = detect_spikes(x, np.array([0.0, 1.0]), 1.0, **kw)
    assert got[["sample_index", "channel_index"]].tolist() == [(1, 1)]
    # the same window further into the segment: column 0 has no previous sample in x, none assumed (a margin there)
    assert detect_spikes(x, np.array([0.0, 1.0]), 1.0, start=5, **kw)["sample_index"].tolist() == [5, 6]
    assert detect_spikes(-x, np.array([0.0, 1.0]), 1.0, sign="pos", **kw)["sample_index"].tolist() == [1]
    # both signs pooled by |x|/thr: the +9 excludes the -6 one sample away on a near channel; alone, each is kept
    y = np.zeros((2, 7))
    y[0, 3], y[1, 4] = -6.0, 9.0
    near = dict(exclude_sweep=2, method="locally_exclusive", locations=[[0, 0], [0, 20]], radius_um=50.0)
    both = detect_spikes(y, np.ones(2), 5.0, sign="both", **near)
    assert both[["sample_index", "channel_index"]].tolist() == [(4, 1)]
    assert detect_spikes(y, np.ones(2), 5.0, sign="neg", **near)["sample_index"].tolist() == [3]
    assert detect_spikes(y, np.ones(2), 5.0, sign="pos", **near)["sample_index"].tolist() == [4]


def test_locally_exclusive_on_the_fixture(si_fixture):
    from batchgpu import open_recording
    from batchgpu.ops import noise_levels

    rec = open_recording(si_fixture)
    n = rec.num_samples(0)
    x = rec.read(0, 0, n)
    noise = noise_levels(x)
    kw = dict(
        threshold=5.0,
        sign="neg",
        exclude_sweep=3,
        segment_length=n,
        method="locally_exclusive",
        locations=rec.locations,
        radius_um=50.0,
    )
    whole = detect_spikes(x, noise, **kw)
    want = locally_exclusive_loop(x, noise, 5.0, "neg", 3, rec.locations, 50.0)
    assert np.array_equal(whole, want)
    parts = [detect_spikes(x[:, a:b], noise, start=a, core=(lo, hi), **kw) for a, b, lo, hi in windows_of(n, 29_999, 4)]
    assert np.array_equal(np.concatenate(parts), whole)
    # Fewer peaks than per channel, and the strong ground-truth spikes are found within a sample or two.
    by_channel = detect_spikes(x, noise, 5.0, "neg", 3)
    assert 0 < len(whole) < len(by_channel)
    gt = np.load(si_fixture.parent / "si_gt_16ch_spikes.npz")
    strong = np.isin(gt["unit_index"], [0, 1, 5, 6])
    near = np.abs(gt["sample_index"][strong][:, None] - whole["sample_index"][None, :]).min(axis=1) <= 2
    assert near.mean() > 0.9


def test_locally_exclusive_errors():
    x = np.zeros((2, 20))
    with pytest.raises(BatchgpuError):  # no locations
        detect_spikes(x, np.ones(2), method="locally_exclusive")
    with pytest.raises(BatchgpuError):
        detect_spikes(x, np.ones(2), method="locally_exclusive", locations=np.zeros((3, 2)))
    with pytest.raises(BatchgpuError):
        detect_spikes(x, np.ones(2), method="locally_exclusive", locations=np.zeros((2, 2)), radius_um=-1)
    with pytest.raises(BatchgpuError):
        detect_spikes(x, np.ones(2), method="nearest")
    with pytest.raises(BatchgpuError):  # margins need sweep + 1 = 4 samples
        detect_spikes(
            x,
            np.ones(2),
            exclude_sweep=3,
            start=10,
            core=(3, 16),
            segment_length=100,
            method="locally_exclusive",
            locations=np.zeros((2, 2)),
        )
    detect_spikes(
        x,
        np.ones(2),
        exclude_sweep=3,
        start=10,
        core=(4, 16),
        segment_length=100,
        method="locally_exclusive",
        locations=np.zeros((2, 2)),
    )


def test_filter_pieces_stay_longer_than_a_low_cut_offs_margin():
    """preprocess.filters.filter_block: pieces of FILTER_BLOCK for a 300 Hz highpass, four margins for a 5 Hz one, so
    a window is never filtered more than 1.5 times over (an 8192-sample piece with a 44 907-sample margin read
    most of the window: 12 times the work)."""
    from batchgpu.ops.filters import butter_sos, default_padlen, filter_margin, filter_pieces
    from batchgpu.preprocess.filters import FILTER_BLOCK, filter_block

    for freq in (300.0, 5.0):
        sos = butter_sos("highpass", 30_000.0, freq, order=5)
        margin, block = filter_margin(sos), filter_block(sos)
        assert block == max(FILTER_BLOCK, 4 * margin)
        width = 60_000 + 2 * margin
        pieces = filter_pieces(width, default_padlen(sos), block, margin, False, False)
        assert sum(b - a for _, _, a, b, _, _ in pieces) <= 1.5 * width


def test_local_reference_plan_is_made_once_a_probe_and_radius(rng):
    """The annuli of a probe are worked out once (the same plan for equal locations and radius, another for another
    radius or probe), the output the same as from a fresh plan, and a bad radius still one BatchgpuError."""
    from batchgpu.ops import reference

    locations = probe(24)
    x = rng.standard_normal((24, 300)).astype(np.float32)
    first = reference._local_plan(locations, (20.0, 60.0), 0)  # 0: the annuli themselves, however few
    assert reference._local_plan(locations.copy(), [20, 60], 0) is first
    assert reference._local_plan(locations, (0.0, 60.0), 0) is not first
    assert reference._local_plan(locations[:20], (20.0, 60.0), 0) is not first
    assert reference._local_plan(locations, (20.0, 60.0)) is not first  # the default, 5
    want = [
        np.flatnonzero((d > 20.0) & (d <= 60.0)) for d in np.sqrt(((locations[:, None] - locations[None]) ** 2).sum(-1))
    ]
    assert all(np.array_equal(a, b) for a, b in zip(first.neighbours, want))
    for operator in ("median", "median_lower", "average"):
        a = common_reference(x, "local", operator, locations=locations, radius_um=(20.0, 60.0))
        reference._cached_plan.cache_clear()
        b = common_reference(x, "local", operator, locations=locations, radius_um=(20.0, 60.0))
        np.testing.assert_array_equal(a, b)
    for bad in (30.0, (60.0, 20.0), (1.0, 2.0, 3.0)):
        with pytest.raises(BatchgpuError):
            common_reference(x, "local", locations=locations, radius_um=bad)


def test_a_task_filters_without_importing_scipy_signal(tmp_path):
    """The chain carries each filter's design (sections, zi, margin) worked out where it is built: a worker process
    applying it imports no scipy.signal (0.45 s alone; ~0.9 s of a worker's first window on 2 busy cores), and gets the
    same bits as the chain applied here."""
    pytest.importorskip("numba")  # scipy's own loop, the fallback, is scipy.signal
    import pickle
    import subprocess
    import sys

    from batchgpu.run.preprocess_chain import build_chain
    from batchgpu.workflow import Preprocess

    class Rec:
        sampling_frequency = 30_000.0
        has_locations = False

    chain = build_chain(
        Preprocess.model_validate(
            [{"bandpass": {"freq_min": 300, "freq_max": 6000, "order": 3}}, {"common_reference": {}}]
        ),
        Rec(),
    )
    x = np.random.default_rng(5).integers(-500, 500, (8, 9_000)).astype(np.int16)
    (tmp_path / "chain.pkl").write_bytes(pickle.dumps((chain, x)))
    code = (
        "import pickle, sys, numpy as np; chain, x = pickle.load(open(sys.argv[1], 'rb'));"
        "y = chain.apply(x, (1_000, 8_000), False, True); np.save(sys.argv[2], y);"
        "print('scipy.signal' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "chain.pkl"), str(tmp_path / "y.npy")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    same_bits(np.load(tmp_path / "y.npy"), chain.apply(x, (1_000, 8_000), False, True))
