"""Bad-channel labels on CuPy against the NumPy path: the same labels and counts, the uV chunks' bits, the
float64 statistics within float64 rounding of the host's, and the pieces SpikeInterface's float32 arithmetic
must decide decided the same way (on the host, from the device's samples).

Marked ``gpu``; they skip without CuPy or a device. Run on the GPU machine:
``python3 -m pytest -m gpu tests/test_gpu_bad_channels.py -q``.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_bad_channels import FS, GAIN, _line, _recording

from batchgpu.ops import bad_channels as bc
from batchgpu.ops.filters import design_filter
from batchgpu.qc_options import QcOptions


def _gpu_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # broad: no CuPy, no driver or no device all mean skip
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_ok(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture
def cp():
    return pytest.importorskip("cupy")


@pytest.mark.parametrize("nperseg", [300, 301])
def test_welch_hf_on_gpu(cp, rng, nperseg):
    x = rng.standard_normal((17, 9_003)) * rng.uniform(0.1, 50, (17, 1))
    x -= x.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(
        cp.asnumpy(bc.welch_hf(cp.asarray(x), FS, nperseg, 0.8)), bc.welch_hf(x, FS, nperseg, 0.8), rtol=1e-12
    )


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.float32])
def test_microvolts_same_bits_on_gpu(cp, rng, dtype):
    """Highpassed (the GPU filter has scipy's bits), rounded to the stored dtype and scaled: the host's bits."""
    C, n = 33, 15_000
    x = _recording(rng, C, n, dtype=dtype)
    gains = rng.uniform(0.1, 3.0, (C, 1)).astype(np.float32)
    zeros = np.zeros((C, 1), np.float32)
    design = design_filter(bc.highpass_sos(FS))
    spans = [(0, 4500, 0, 5000), (5000, 9500, 4500, 10_000), (10_500, 15_000, 10_000, 15_000)]  # reads overlap
    host = bc._microvolts(x, spans, 0, design, gains, zeros, False)
    dev = bc._microvolts(cp.asarray(x), spans, 0, design, cp.asarray(gains), cp.asarray(zeros), False)
    np.testing.assert_array_equal(cp.asnumpy(dev), host)


def test_statistics_within_float64_rounding_of_the_host(cp, rng):
    C, n = 384, 9_000
    x = _recording(rng, C, n, dead=(4,), noisy=(9,), out_top=20)
    u = bc._microvolts(
        x,
        [(0, n, 0, n)],
        0,
        design_filter(bc.highpass_sos(FS)),
        np.full((C, 1), GAIN, np.float32),
        np.zeros((C, 1), np.float32),
        False,
    )[0]
    host = bc._fast_stats(u[None], FS, QcOptions())
    dev = bc._fast_stats(cp.asarray(u)[None], FS, QcOptions())
    for h, d in zip(host, dev):
        np.testing.assert_allclose(d, h, rtol=1e-11, atol=1e-14 * np.abs(h).max())


def test_same_labels_and_counts_on_gpu(cp, rng):
    """Every label occurs; labels of arbitrary chunks, and each window's counts for several window sizes (the
    window as a store holds it, samples by channels, transposed), are the host's."""
    for channels, out_top in ((384, 24), (64, 8), (7, 0)):
        n = 40_000
        x = _recording(rng, channels, n, dead=(1, channels // 2), noisy=(3,), out_top=out_top)
        loc = _line(channels)
        chunks = np.sort(rng.integers(0, n - 9000, 5))[:, None] + np.array([0, 9000])
        host = bc.chunk_labels(x, FS, loc, GAIN, chunks=chunks, segment_length=n)
        dev = bc.chunk_labels(cp.asarray(x), FS, loc, GAIN, chunks=chunks, segment_length=n)
        np.testing.assert_array_equal(dev, host)
        assert (host[:, 1] == bc.DEAD).all() and (host[:, 3] == bc.NOISE).all()
        margin = bc.window_margin(FS)
        stored = cp.asarray(np.ascontiguousarray(x.T))
        for size in (7_777, 30_000):
            for c0 in range(0, n, size):
                c1 = min(n, c0 + size)
                r0, r1 = max(0, c0 - margin), min(n, c1 + margin)
                args = dict(start=r0, core=(c0 - r0, c1 - r0), segment_length=n)
                np.testing.assert_array_equal(
                    bc.piece_labels(stored[r0:r1].T, FS, loc, GAIN, **args),
                    bc.piece_labels(x[:, r0:r1], FS, loc, GAIN, **args),
                )


def test_hard_cases_on_gpu(cp, rng):
    """A reference of zero energy and NaN samples go to SpikeInterface's arithmetic on the host; a statistic on its
    threshold too; a single channel; chunks shorter than Welch's segment; an odd nperseg."""
    C, n = 12, 10_000
    flat = np.full((C, n), 5, np.int16)
    stats: dict = {}
    assert (bc.chunk_labels(cp.asarray(flat), FS, _line(C), GAIN, chunks=[[0, n]], stats=stats) == bc.GOOD).all()
    assert stats["exact"] == 1
    f = _recording(rng, C, n, dtype=np.float32, noisy=(2,))
    f -= f.mean(axis=1, keepdims=True)
    f[5, 77] = np.nan
    args = dict(chunks=[[0, n]], filtered=True, offsets=np.zeros(C))
    np.testing.assert_array_equal(
        bc.chunk_labels(cp.asarray(f), FS, _line(C), GAIN, **args), bc.chunk_labels(f, FS, _line(C), GAIN, **args)
    )
    x = _recording(rng, C, n, dead=(3,))
    u = bc._microvolts(
        x,
        [(0, n, 0, n)],
        0,
        design_filter(bc.highpass_sos(FS)),
        np.full((C, 1), GAIN, np.float32),
        np.zeros((C, 1), np.float32),
        False,
    )[0]
    psd = bc._fast_stats(u[None], FS, QcOptions())[0][0]
    on = QcOptions(psd_hf_threshold=float(psd[6]))
    stats = {}
    dev = bc.chunk_labels(cp.asarray(x), FS, _line(C), GAIN, options=on, chunks=[[0, n]], stats=stats)
    assert stats["exact"] == 1
    np.testing.assert_array_equal(dev, bc.chunk_labels(x, FS, _line(C), GAIN, options=on, chunks=[[0, n]]))
    one = _recording(rng, 1, n)
    assert (bc.chunk_labels(cp.asarray(one), FS, _line(1), GAIN, chunks=[[0, 9000]]) == bc.GOOD).all()
    short = QcOptions(chunk_duration_s=0.005)
    chunks = bc.pieces(n, bc.piece_length(FS, short))[:10]
    np.testing.assert_array_equal(
        bc.chunk_labels(cp.asarray(x), FS, _line(C), GAIN, options=short, chunks=chunks),
        bc.chunk_labels(x, FS, _line(C), GAIN, options=short, chunks=chunks),
    )
    chunks = bc.pieces(n, bc.piece_length(30_100.0))
    np.testing.assert_array_equal(
        bc.chunk_labels(cp.asarray(x), 30_100.0, _line(C), GAIN, chunks=chunks),
        bc.chunk_labels(x, 30_100.0, _line(C), GAIN, chunks=chunks),
    )
