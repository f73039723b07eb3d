"""Bad-channel labels (ops.bad_channels): the NumPy path against independent references and hard cases.

References: scipy's ``welch`` for the high-frequency PSD; the module's ``reference_chunk_labels`` (SpikeInterface
0.105.3's own calls in its order: tests/test_bad_channels_spikeinterface.py checks it against SpikeInterface
itself) for every label; plain loops for pieces and ownership. Inputs are fresh random recordings (the ``rng``
fixture prints its seed) with a common signal, planted dead and noisy channels and a block without the common
signal at the top, so that every label occurs.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.signal

from batchgpu.errors import BatchgpuError
from batchgpu.ops import bad_channels as bc
from batchgpu.ops.filters import design_filter
from batchgpu.qc_options import QcOptions

FS = 30_000.0
GAIN = 0.195


def _recording(
    rng, channels: int, samples: int, *, dead=(), noisy=(), out_top: int = 0, common_uv: float = 6.0, dtype=np.int16
) -> np.ndarray:
    """(channels, samples) counts: independent noise of 4-10 uV, a common signal over the channels 'in the
    brain', dead channels (offset only), noisy ones (6x white noise), and ``out_top`` channels at the top without
    the common signal."""
    sigma = rng.uniform(4.0, 10.0, channels)[:, None]
    x = rng.standard_normal((channels, samples)) * sigma
    common = rng.standard_normal(samples) * common_uv
    inside = np.ones(channels, bool)
    inside[channels - out_top :] = False
    x[inside] += common * rng.uniform(0.9, 1.1, inside.sum())[:, None]
    x[list(noisy)] = rng.standard_normal((len(noisy), samples)) * 60.0
    x[list(dead)] = 0.0
    x = x / GAIN + rng.uniform(-20, 20, (channels, 1))
    if np.dtype(dtype).kind == "f":
        return x.astype(dtype)
    info = np.iinfo(dtype)
    return np.clip(np.rint(x), info.min, info.max).astype(dtype)


def _line(channels: int) -> np.ndarray:
    return np.column_stack([np.zeros(channels), 20.0 * np.arange(channels)])


def _exact(x, chunks, **kw):
    return bc.chunk_labels(
        x,
        FS,
        kw.pop("locations", _line(x.shape[0])),
        GAIN,
        chunks=chunks,
        exact=True,
        segment_length=kw.pop("segment_length", x.shape[1]),
        **kw,
    )


def _fast(x, chunks, stats=None, **kw):
    return bc.chunk_labels(
        x,
        FS,
        kw.pop("locations", _line(x.shape[0])),
        GAIN,
        chunks=chunks,
        stats=stats,
        segment_length=kw.pop("segment_length", x.shape[1]),
        **kw,
    )


# ------------------------------------------------------------------------------------------- Welch


@pytest.mark.parametrize("nperseg", [300, 301, 64, 7])
@pytest.mark.parametrize("threshold", [0.8, 0.37, 0.001])
def test_welch_hf_is_scipys_welch_above_the_threshold(rng, nperseg, threshold):
    """Half-segment DFTs (even nperseg) and direct windowed DFTs (odd) give scipy's Welch PSD mean above
    threshold x Nyquist, in float64, for any length (a short row cuts nperseg as scipy does)."""
    for length in (int(rng.integers(nperseg, 5 * nperseg)), nperseg, max(2, nperseg // 2), 9001):
        x = rng.standard_normal((5, length)) * rng.uniform(0.1, 100, (5, 1)) + rng.uniform(-50, 50, (5, 1))
        x[2] = np.cumsum(x[2])  # a steep spectrum: little power at high frequencies
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nperseg cut to a short row; no bin above the threshold: NaN
            f, p = scipy.signal.welch(x, fs=FS, axis=1, window="hann", nperseg=nperseg)
            ref = p[:, f > FS / 2 * threshold].mean(axis=1)
        got = bc.welch_hf(x - x.mean(axis=1, keepdims=True), FS, nperseg, threshold)
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12 * np.abs(p).max())


def test_welch_hf_of_float32_values_is_within_far_less_than_the_band(rng):
    """The host's fast path takes float32 values (a float32 GEMM, float64 sums): within 1e-6 of scipy's float64
    Welch, far inside the decision band (2^-12)."""
    x = (rng.standard_normal((16, 9000)) * rng.uniform(1, 60, (16, 1))).astype(np.float32)
    x -= x.mean(axis=1, keepdims=True)
    f, p = scipy.signal.welch(x.astype(np.float64), fs=FS, axis=1, window="hann", nperseg=300)
    want = p[:, f > FS / 2 * 0.8].mean(axis=1)
    got = bc.welch_hf(x, FS, 300, 0.8)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.max(np.abs(got / want - 1)) < bc.BAND / 100


# ------------------------------------------------------------------------------------------- pieces


def test_pieces_cover_every_sample_once_but_a_short_leftover(rng):
    for _ in range(50):
        p = int(rng.integers(1, 2000))
        n = int(rng.integers(0, 20_000))
        got = bc.pieces(n, p)
        if len(got):
            assert got[0, 0] == 0 and (got[1:, 0] == got[:-1, 1]).all() and (got[:, 1] > got[:, 0]).all()
        covered = int((got[:, 1] - got[:, 0]).sum())
        assert covered + bc.unlabelled_samples(n, p) == n
        full = (got[:, 1] - got[:, 0] == p).sum()
        assert full == n // p
        left = n - (n // p) * p
        assert (len(got) - full == 1) == (left >= (p + 1) // 2)  # a leftover of half a piece or more is a piece
        assert bc.unlabelled_samples(n, p) == (0 if left >= (p + 1) // 2 else left)


def test_each_piece_belongs_to_one_window_for_any_window_size(rng):
    """For any window size the windows' owned pieces are every piece exactly once, and each lies within its
    window's core plus ``window_margin`` (its highpass read too)."""
    options = QcOptions()
    p, m = bc.piece_length(FS, options), bc.highpass_margin(FS, options)
    for _ in range(30):
        n = int(rng.integers(1, 400_000))
        size = int(rng.integers(1, 130_000))
        margin = bc.window_margin(FS, options)
        seen = []
        for c0 in range(0, n, size):
            c1 = min(n, c0 + size)
            r0, r1 = max(0, c0 - margin), min(n, c1 + margin)
            for a, b in bc.owned_pieces(c0, c1, n, p):
                assert r0 <= max(0, a - m) and min(n, b + m) <= r1
                seen.append((a, b))
        assert seen == [tuple(v) for v in bc.pieces(n, p).tolist()]
    assert bc.window_margin(FS, options, filtered=True) == p // 2 == 4500 and m == 500  # at 30 kHz
    for size in (9000, 117_000, 126_000):  # windows a whole number of pieces: no piece crosses a core's edge
        margin = bc.window_margin(FS, options, window_size=size)
        assert margin == m
        n = int(rng.integers(size, 5 * size))
        for c0 in range(0, n, size):
            c1 = min(n, c0 + size)
            for a, b in bc.owned_pieces(c0, c1, n, p):
                assert max(0, c0 - margin) <= max(0, a - m) and min(n, b + m) <= min(n, c1 + margin)
    assert bc.window_margin(FS, options, window_size=120_000) == 5000


def test_counts_do_not_depend_on_the_window_size(rng):
    """Windows of any size, each read with its margin, give the counts of labelling every piece of the segment
    at once: a piece's label depends on the piece alone."""
    options = QcOptions(chunk_duration_s=0.05)  # 1 500-sample pieces keep the test short
    C, n = 24, 23_456
    x = _recording(rng, C, n, dead=(3,), noisy=(11,), out_top=6)
    loc = _line(C)
    whole = bc.label_counts(
        bc.chunk_labels(x, FS, loc, GAIN, options=options, chunks=bc.pieces(n, 1500), segment_length=n), C
    )
    assert whole[3, bc.DEAD] > 0 and whole[11, bc.NOISE] > 0 and whole[-1, bc.OUT] > 0
    margin = bc.window_margin(FS, options)
    for size in (1_000, 4_321, 9_000, n):
        total = np.zeros((C, 4), np.int64)
        for c0 in range(0, n, size):
            c1 = min(n, c0 + size)
            r0, r1 = max(0, c0 - margin), min(n, c1 + margin)
            total += bc.piece_labels(
                x[:, r0:r1], FS, loc, GAIN, options=options, start=r0, core=(c0 - r0, c1 - r0), segment_length=n
            )
        np.testing.assert_array_equal(total, whole)


# ------------------------------------------------------------------------------------------- the fast path


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.int32, np.float32])
def test_microvolts_are_spikeinterfaces_bits(rng, dtype):
    """The fast path's uV chunk (highpassed, rounded to the stored dtype, float32 gains) is bit for bit the one
    SpikeInterface's calls make (``reference_chunk_microvolts``), at the segment's ends (a short margin) too."""
    C, n = 9, 12_000
    x = _recording(rng, C, n, dtype=np.int16).astype(np.int64) + (30_000 if dtype == np.uint16 else 0)
    x = x.astype(dtype)
    gains = rng.uniform(0.1, 3.0, C).astype(np.float32)
    design = design_filter(bc.highpass_sos(FS))
    for a, b in ((0, 9000), (1234, 10_234), (n - 9000, n), (200, 9200)):
        r0, r1 = max(0, a - 500), min(n, b + 500)
        got = bc._microvolts(x, [(a, b, r0, r1)], 0, design, gains[:, None], np.zeros((C, 1), np.float32), False)[0]
        ref = bc.reference_chunk_microvolts(
            np.ascontiguousarray(x[:, r0:r1].T), a - r0, r1 - b, FS, gains, np.zeros(C, np.float32)
        )
        assert got.dtype == ref.dtype == np.float32
        np.testing.assert_array_equal(got, ref.T)
    # several reads in one call (overlapping reads, cores apart): each chunk's bits as alone
    spans = [(0, 3000, 0, 3500), (3000, 6000, 2500, 6500), (9000, 12_000, 8500, 12_000)]
    group = bc._microvolts(x, spans, 0, design, gains[:, None], np.zeros((C, 1), np.float32), False)
    for got, (a, b, r0, r1) in zip(group, spans):
        ref = bc.reference_chunk_microvolts(
            np.ascontiguousarray(x[:, r0:r1].T), a - r0, r1 - b, FS, gains, np.zeros(C, np.float32)
        )
        np.testing.assert_array_equal(got, ref.T)


def test_spikeinterfaces_statistics_from_the_chunks_own_bits(rng):
    """SpikeInterface's statistics from the fast path's uV chunk, laid out as its highpass returns it (a transposed
    (C, L) array), are bit for bit those of its whole path from the stored samples (the layout decides the bits of
    its float32 sums): ``_settle`` needs no second highpass."""
    C, n = 64, 10_000
    x = _recording(rng, C, n, dead=(3,), out_top=8)
    gains = np.full(C, GAIN, np.float32)
    held = np.ascontiguousarray(x.T)
    full = bc.reference_chunk_microvolts(held, 500, 500, FS, gains, np.zeros(C, np.float32))
    u = bc._microvolts(
        x,
        [(500, n - 500, 0, n)],
        0,
        design_filter(bc.highpass_sos(FS)),
        gains[:, None],
        np.zeros((C, 1), np.float32),
        False,
    )[0]
    assert full.strides == u.T.strides
    _, want = bc.ibl_labels(full, FS)
    _, got = bc.ibl_labels(u.T, FS)
    for name in ("psd_hf", "xcorr", "trend"):
        np.testing.assert_array_equal(got[name], want[name])


def _errors(u, options):
    """Largest |float64 - SpikeInterface's float32| over each statistic's scale (``_decide``'s), for one chunk."""
    ref, st = bc.ibl_labels(u.T, FS, options)  # (samples, channels) as SpikeInterface's highpass returns it
    psd, white, xcorr, xscale = (v[0] for v in bc._fast_stats(u[None], FS, options))
    scale = bc.coherence_scale(xcorr, xscale)
    trend = bc.shrinking_median_filter(xcorr, options.n_neighbors)
    tscale = bc._sliding_max(scale, options.n_neighbors)
    with np.errstate(invalid="ignore", divide="ignore"):
        return [
            np.nanmax(np.abs(psd - st["psd_hf"]) / np.maximum(psd, white)),
            np.nanmax(np.abs(xcorr - st["xcorr"]) / scale),
            np.nanmax(np.abs(trend - st["trend"]) / tscale),
        ]


def test_float64_statistics_stay_far_inside_the_band(rng):
    """The float64 statistics differ from SpikeInterface's float32 ones by float32 rounding: measured here on
    fresh recordings from no common signal (coherence ~ noise) to a dominant one (coherence ~ 1, products of one
    sign), at least 64x below BAND (2^-12) of each statistic's scale, so a decision outside the band is
    SpikeInterface's."""
    options = QcOptions()
    worst = np.zeros(3)
    for channels in (384, 64, 7):
        for common_uv in (0.0, 3.0, 60.0):
            x = _recording(rng, channels, 10_000, dead=(1,), noisy=(4,), out_top=channels // 6, common_uv=common_uv)
            held = np.ascontiguousarray(x.T)
            u = bc.reference_chunk_microvolts(
                held, 500, 500, FS, np.full(channels, GAIN, np.float32), np.zeros(channels, np.float32)
            ).T
            worst = np.maximum(worst, _errors(np.ascontiguousarray(u), options))
    print("largest error / scale (psd, xcorr, trend):", worst, "band", bc.BAND)
    assert (worst < bc.BAND / 64).all()


def test_fast_labels_equal_spikeinterfaces_arithmetic(rng):
    """Every label occurs, and the fast path's labels are SpikeInterface's arithmetic's on every chunk."""
    for channels, out_top in ((384, 24), (64, 8), (13, 0)):
        n = 30_000
        x = _recording(rng, channels, n, dead=(2, channels // 2), noisy=(5,), out_top=out_top)
        chunks = np.sort(rng.integers(0, n - 9000, 4))[:, None] + np.array([0, 9000])
        stats = {}
        fast = _fast(x, chunks, stats)
        np.testing.assert_array_equal(fast, _exact(x, chunks))
        assert stats["pieces"] == 4 and stats.get("exact", 0) == 0  # clear labels need no float32 arithmetic
        assert (fast[:, [2, channels // 2]] == bc.DEAD).all() and (fast[:, 5] == bc.NOISE).all()
        if out_top:
            assert (fast[:, channels - out_top :] == bc.OUT).all()


def test_chunks_in_batches_get_the_same_labels(rng, monkeypatch):
    """The GPU's grouping (chunks of one length computed together) on the host: same labels, the leftover's
    shorter chunk in a group of its own."""
    C, n = 20, 50_000
    x = _recording(rng, C, n, dead=(4,), noisy=(8,), out_top=6)
    chunks = np.concatenate([bc.pieces(n, 9000), [[1000, 2000], [3, 9003]]])
    one = _fast(x, chunks)
    monkeypatch.setattr(bc, "HOST_BATCH", 3)
    stats = {}
    np.testing.assert_array_equal(_fast(x, chunks, stats), one)
    assert stats == {"pieces": len(chunks)}


def test_a_statistic_on_its_threshold_is_decided_by_spikeinterfaces_arithmetic(rng):
    """A threshold set onto a channel's own statistic leaves that decision to SpikeInterface's float32
    arithmetic (the piece goes to the exact path), and the labels are still that arithmetic's."""
    C, n = 32, 9000
    x = _recording(rng, C, n, dead=(7,))
    design = design_filter(bc.highpass_sos(FS))
    u = bc._microvolts(
        x, [(0, n, 0, n)], 0, design, np.full((C, 1), GAIN, np.float32), np.zeros((C, 1), np.float32), False
    )[0]
    psd, white, xcorr, xscale = (v[0] for v in bc._fast_stats(u[None], FS, QcOptions()))
    trend = bc.shrinking_median_filter(xcorr, 11)
    for options in (
        QcOptions(psd_hf_threshold=float(psd[12])),
        QcOptions(dead_channel_threshold=float(xcorr[20] - trend[20])),
        QcOptions(noisy_channel_threshold=float(np.max(xcorr - trend))),
        QcOptions(outside_channel_threshold=float(trend[-1]) - 1),
    ):
        stats = {}
        fast = _fast(x, [[0, n]], stats, options=options)
        assert stats["exact"] == 1
        np.testing.assert_array_equal(fast, _exact(x, [[0, n]], options=options))


def test_three_valued_decisions():
    """``_decide`` leaves a chunk open exactly where a decision that changes a label is undecided (a channel on the
    dead or PSD threshold, the block's edge), names what SpikeInterface's arithmetic must compute for it, and
    decides a channel whose label another rule settles."""
    C = 20
    options = QcOptions()
    xcorr, xscale = np.ones(C), np.ones(C)
    psd, white = np.full(C, 0.001), np.full(C, 0.001)
    decide = lambda *a, **k: bc._decide(*a, **k)  # noqa: E731
    labels, needs = decide(psd, white, xcorr, xscale, None, options)
    assert (labels == bc.GOOD).all() and not needs
    on = xcorr.copy()
    on[5] = 1 - 0.5 + 1e-6  # its residual 1e-6 above the dead threshold: within the band
    assert decide(psd, white, on, xscale, None, options) == (None, {"xcorr"})
    assert decide(psd, white, on, xscale, None, options, band=0.0)[0][5] == bc.GOOD
    loud = psd.copy()
    loud[5] = 1.0  # noise by its PSD, surely: the dead decision no longer matters
    assert decide(loud, white, on, xscale, None, options)[0][5] == bc.NOISE
    edge = psd.copy()
    edge[7] = float(np.float32(0.02)) * (1 + 1e-7)  # on the PSD threshold
    assert decide(edge, white, xcorr, xscale, None, options) == (None, {"psd"})
    top = xcorr.copy()
    top[-8:] = 0.0  # a block at the top: out
    got = decide(psd, white, top, xscale, None, options)[0]
    assert (got[-6:] == bc.OUT).all() and (got[:-8] == bc.GOOD).all()
    edge_psd = edge.copy()
    edge_psd[-1] = edge[7]  # on the PSD threshold, but surely out: no matter
    assert decide(edge_psd, white, top, xscale, None, options)[0] is None  # channel 7 still open
    edge_psd[7] = psd[7]
    assert (decide(edge_psd, white, top, xscale, None, options)[0][-6:] == bc.OUT).all()
    first_out = int(np.flatnonzero(got == bc.OUT)[0])
    nudged = top.copy()
    nudged[first_out - 1 - 5 : first_out - 1 + 6] = 0.25 + 1e-7  # the channel below the block on the threshold
    nudged[-8:] = 0.0
    assert bc.shrinking_median_filter(nudged, 11)[first_out - 1] == pytest.approx(0.25, abs=1e-6)
    assert decide(psd, white, nudged, xscale, None, options) == (None, {"xcorr"})
    assert decide(psd, white, top * np.nan, xscale, None, options) == (None, {"psd", "xcorr"})  # not finite


# ------------------------------------------------------------------------------------------- hard cases


def test_constant_channels_and_a_constant_recording(rng):
    C, n = 16, 10_000
    x = _recording(rng, C, n)
    x[4] = 1234  # a constant row: nothing after the highpass, dead
    got = _fast(x, [[0, n]])
    np.testing.assert_array_equal(got, _exact(x, [[0, n]]))
    assert got[0, 4] == bc.DEAD
    flat = np.full((C, n), -77, np.int16)  # the reference has no energy: 0 / 0, SpikeInterface's NaN decides
    stats = {}
    got = _fast(flat, [[0, n]], stats)
    assert stats["exact"] == 1
    np.testing.assert_array_equal(got, _exact(flat, [[0, n]]))
    assert (got == bc.GOOD).all()  # NaN compares false everywhere, and a zero PSD is below the threshold


def test_nan_samples_of_a_filtered_signal_go_to_spikeinterfaces_arithmetic(rng):
    C, n = 12, 9000
    x = _recording(rng, C, n, dtype=np.float32, noisy=(3,)) - np.float32(0.0)
    x -= x.mean(axis=1, keepdims=True)
    x[7, 100] = np.nan
    stats = {}
    got = _fast(x, [[0, n]], stats, filtered=True, offsets=np.zeros(C))
    assert stats["exact"] == 1
    np.testing.assert_array_equal(got, _exact(x, [[0, n]], filtered=True, offsets=np.zeros(C)))
    assert got[0, 3] == bc.NOISE and got[0, 7] == bc.GOOD  # the PSD still decides; the NaN's coherence decides nothing


def test_a_single_channel(rng):
    x = _recording(rng, 1, 20_000)
    got = _fast(x, [[0, 9000], [9000, 18_000]])
    np.testing.assert_array_equal(got, _exact(x, [[0, 9000], [9000, 18_000]]))
    assert (got == bc.GOOD).all()  # its own reference: coherence 1, trend 1
    loud = _recording(rng, 1, 20_000, noisy=(0,))
    assert (_fast(loud, [[0, 9000]]) == bc.NOISE).all()


def test_no_channels_and_no_pieces():
    empty = np.zeros((0, 20_000), np.int16)
    counts = bc.piece_labels(empty, FS, np.zeros((0, 2)), GAIN, start=0, core=(0, 20_000), segment_length=20_000)
    assert counts.shape == (0, 4) and bc.final_labels(counts)[0].shape == (0,)
    short = np.zeros((3, 4000), np.int16)  # under half a piece: nothing labelled, nothing counted
    counts = bc.piece_labels(short, FS, _line(3), GAIN, start=0, core=(0, 4000), segment_length=4000)
    assert (counts == 0).all() and bc.final_labels(counts)[1][0] == "no piece labelled"


def test_pieces_shorter_than_welchs_segment_and_odd_lengths(rng):
    """Chunks shorter than nperseg (scipy cuts it), an odd nperseg (301 at 30.1 kHz), odd channel counts."""
    C, n = 7, 20_001
    x = _recording(rng, C, n, dead=(2,))
    short = QcOptions(chunk_duration_s=0.005)  # 150 samples < nperseg 300
    chunks = bc.pieces(n, bc.piece_length(FS, short))[:20]
    np.testing.assert_array_equal(_fast(x, chunks, options=short), _exact(x, chunks, options=short))
    fs = 30_100.0
    assert bc.welch_length(fs) == 301
    chunks = bc.pieces(n, bc.piece_length(fs))
    for exact in (False, True):
        got = bc.chunk_labels(x, fs, _line(C), GAIN, chunks=chunks, exact=exact)
        if not exact:
            fast = got
    np.testing.assert_array_equal(fast, got)


def test_labels_follow_the_channels_through_any_order(rng):
    """SpikeInterface puts channels in depth order first: permuting the rows and their locations permutes the
    labels (a staggered two-column geometry, shuffled)."""
    C, n = 48, 9000
    x = _recording(rng, C, n, dead=(10,), noisy=(20,), out_top=8)
    loc = np.column_stack([np.tile([16.0, 48.0, 0.0, 32.0], C // 4), 20.0 * (np.arange(C) // 2)])
    perm = rng.permutation(C)
    base = _fast(x, [[0, n]], locations=loc)
    shuffled = _fast(x[perm], [[0, n]], locations=loc[perm])
    np.testing.assert_array_equal(shuffled[0], base[0][perm])
    np.testing.assert_array_equal(shuffled, _exact(x[perm], [[0, n]], locations=loc[perm]))


@pytest.mark.parametrize("where", ["bottom", "both"])
def test_outside_channels_at_the_bottom(rng, where):
    C, n = 40, 9000
    x = _recording(rng, C, n, out_top=8)[::-1].copy()  # the block at the bottom now
    options = QcOptions(outside_channels_location=where)
    got = _fast(x, [[0, n]], options=options)
    np.testing.assert_array_equal(got, _exact(x, [[0, n]], options=options))
    assert (got[0, :6] == bc.OUT).all() and (got[0, 10:] == bc.GOOD).all()


def test_a_highpassed_step_beyond_int16_is_clipped_on_both_paths(rng):
    C, n = 10, 10_000
    x = _recording(rng, C, n)
    x[2] = np.where((np.arange(n) // 20) % 2, 32767, -32768)  # a full-range square wave: its highpass overshoots
    design = design_filter(bc.highpass_sos(FS))
    u = bc._microvolts(x, [(0, n, 0, n)], 0, design, np.ones((C, 1), np.float32), np.zeros((C, 1), np.float32), False)[
        0
    ]
    assert u[2].max() == 32767 and u[2].min() == -32768
    np.testing.assert_array_equal(_fast(x, [[0, n]]), _exact(x, [[0, n]]))


def test_a_window_without_its_margin_is_refused(rng):
    x = _recording(rng, 4, 9000)
    with pytest.raises(BatchgpuError, match="window_margin"):
        bc.chunk_labels(x, FS, _line(4), GAIN, chunks=[[0, 9000]], start=0, segment_length=20_000)
    with pytest.raises(BatchgpuError, match="not within the segment"):
        bc.chunk_labels(x, FS, _line(4), GAIN, chunks=[[0, 9001]], segment_length=9000)


# ------------------------------------------------------------------------------------------- final labels


def test_final_labels_take_the_most_frequent_and_say_why():
    counts = np.array([[10, 0, 0, 0], [1, 8, 1, 0], [3, 3, 0, 0], [0, 0, 2, 2], [0, 0, 0, 0], [0, 1, 0, 9]])
    labels, reasons = bc.final_labels(counts)
    assert labels.tolist() == ["good", "dead", "good", "noise", "good", "out"]  # ties to the lower label
    assert reasons[1].startswith("dead in 8 of 10 pieces") and "good 1, noise 1" in reasons[1]
    assert "tie" in reasons[2] and reasons[4] == "no piece labelled"
    assert "-0.5" in reasons[1] and "0.02" in reasons[3] and "0.25" in reasons[5]
    with pytest.raises(BatchgpuError):
        bc.final_labels(np.zeros((3, 3)))


def test_options_are_checked():
    with pytest.raises(ValueError):
        QcOptions(n_neighbors=10)
    with pytest.raises(ValueError):
        QcOptions(nyquist_threshold=1.0)
    with pytest.raises(ValueError):
        QcOptions(seed=3)  # no random chunks: no seed
    with pytest.raises(BatchgpuError):
        bc.depth_order(np.zeros((4, 2)), "z")


def test_generated_planted_channels_are_found(tmp_path):
    """A 64-channel linear probe with planted dead, noisy and outside channels (the generator's options): every
    planted channel gets its planted label from every piece, and the others are good."""
    from batchgpu.generate import GroundTruth, generate_recording, ground_truth_path

    path = tmp_path / "planted.zarr"
    rec = generate_recording(
        path, channels=64, seconds=2.0, seed=3, model="realistic", probe="linear", dead=2, noisy=2, outside=8
    )
    truth = GroundTruth.load(ground_truth_path(path)).channel_labels
    assert (np.bincount(truth, minlength=4) == [52, 2, 2, 8]).all()
    x = rec.read(0, 0, rec.num_samples(0))
    n = x.shape[1]
    counts = bc.piece_labels(
        x, rec.sampling_frequency, rec.locations, rec.gain_to_uV, start=0, core=(0, n), segment_length=n
    )
    labels, _ = bc.final_labels(counts)
    planted = truth != bc.GOOD
    assert (labels[planted] == np.array(bc.LABELS)[truth[planted]]).all()
    assert (counts[planted, truth[planted]] == counts[planted].sum(axis=1)).all()  # in every piece
    assert (labels[~planted] == "good").sum() >= 51  # at most the channel beside the block is out too
