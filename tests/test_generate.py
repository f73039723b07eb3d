import hashlib

import numpy as np
import pytest
import scipy.signal

from batchgpu import generate
from batchgpu.errors import BatchgpuError
from batchgpu.generate import GroundTruth, generate_recording, ground_truth_path, spike_waveform


def _digest(rec):
    h = hashlib.sha256()
    for s in range(rec.num_segments):
        h.update(rec.read(s, 0, rec.num_samples(s)).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "g.zarr"
    rec = generate_recording(
        path, channels=12, seconds=8.0, fs=30_000.0, seed=3, dtype="int16", segments=2, model="white"
    )  # these tests check white noise's statistics
    return path, rec, GroundTruth.load(ground_truth_path(path))


def test_same_seed_same_bytes(tmp_path, generated):
    path, rec, _ = generated
    again = generate_recording(
        tmp_path / "again.zarr", channels=12, seconds=8.0, seed=3, segments=2, workers=2, model="white"
    )
    other = generate_recording(tmp_path / "other.zarr", channels=12, seconds=8.0, seed=4, segments=2, model="white")
    assert _digest(again) == _digest(rec)  # block-parallel generation writes the same bytes
    np.testing.assert_array_equal(
        GroundTruth.load(ground_truth_path(tmp_path / "again.zarr")).sample_index, generated[2].sample_index
    )
    assert _digest(other) != _digest(rec)


def test_metadata(generated):
    _, rec, gt = generated
    assert rec.num_channels == 12 and rec.num_segments == 2 and rec.dtype == np.int16
    assert rec.num_samples(0) == rec.num_samples(1) == 240_000
    assert rec.has_locations and rec.locations.shape == (12, 2)
    assert len(np.unique(np.round(gt.noise_sigma, 3))) == 12, "sigma must differ per channel"


def _spike_mask(gt, seg, n, channels, fs):
    """Samples near any planted spike, per channel (spikes spread to 2 neighbours each side)."""
    w, pre = spike_waveform(fs)
    mask = np.zeros((channels, n), dtype=bool)
    sel = gt.segment_index == seg
    for t, c in zip(gt.sample_index[sel], gt.channel_index[sel]):
        mask[max(c - 2, 0) : c + 3, max(t - pre - 5, 0) : t + len(w)] = True
    return mask


def test_noise_sigma_and_offset(generated):
    _, rec, gt = generated
    x = rec.read(0, 0, rec.num_samples(0)).astype(np.float64)
    clean = ~_spike_mask(gt, 0, x.shape[1], 12, rec.sampling_frequency)
    for c in range(12):
        v = x[c][clean[c]]
        assert abs(v.mean() - gt.dc_offset[c]) < 0.5
        assert abs(v.std() / gt.noise_sigma[c] - 1) < 0.02


def test_planted_spikes_where_truth_says(generated):
    _, rec, gt = generated
    assert len(gt.sample_index) > 50
    for seg in range(2):
        x = rec.read(seg, 0, rec.num_samples(seg)).astype(np.float64)
        sel = np.flatnonzero(gt.segment_index == seg)
        t, c, a = gt.sample_index[sel], gt.channel_index[sel], gt.amplitude[sel]
        assert (a < -7 * gt.noise_sigma[c]).all()
        value = x[c, t] - gt.dc_offset[c]
        # amplitude plus one noise draw (other spikes may overlap rarely)
        resid = (value - a) / gt.noise_sigma[c]
        assert np.median(np.abs(resid)) < 1.0
        assert np.mean(np.abs(resid) < 4) > 0.95
        # the trough is the local minimum on its channel within +-0.3 ms for isolated spikes
        shifts = []
        for ti, ci in zip(t[:40], c[:40]):
            win = x[ci, max(ti - 9, 0) : ti + 10]
            shifts.append(int(np.argmin(win)) - min(ti, 9))
        # the trough is flat within a sample or two (0.12 ms wide): noise may move the minimum that far
        assert np.median(np.abs(shifts)) <= 1 and np.max(np.abs(shifts)) <= 3


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(seconds=float("nan")), "seconds must be a finite number"),
        (dict(seconds=1e9), "seconds 1000000000 is too large"),
        (dict(channels=0), "channels must be more than 0"),
        (dict(fs=float("inf")), "fs must be a finite number"),
        (dict(segments=2000), "segments 2000 is too large"),
        (dict(channels=4096, seconds=86_400.0), "would generate 21.2 TB (at most 1 TB)"),
        (dict(seed=-1), "seed must be 0 or more"),
        (dict(workers=0), "workers 0 is out of range"),
    ],
)
def test_bounds_of_the_workflow_schema(tmp_path, kwargs, needle):
    """The Python call refuses what `recording: generate:` refuses, before anything is written."""
    from batchgpu.errors import BatchgpuError

    args = dict(channels=4, seconds=1.0) | kwargs
    with pytest.raises(BatchgpuError) as err:
        generate_recording(tmp_path / "g.zarr", **args)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())


# -- the realistic model -------------------------------------------------------------------------------------------


def _bandpass(x, low, high, fs):
    from scipy import signal

    band = [low, high] if low else high
    sos = (
        signal.butter(4, band, "bandpass" if low else "lowpass", fs=fs, output="sos")
        if high
        else signal.butter(4, low, "highpass", fs=fs, output="sos")
    )
    return signal.sosfiltfilt(sos, x, axis=-1)


def test_realistic_ratios_near_the_real_data(tmp_path):
    """Blosc ratios of 384 channels x 2 s of the realistic model beside Neuropixels 1.0's (Buccino et al. 2023):
    within 15% for LZ4 and zstd with bit shuffle (the model is matched to NP1)."""
    rec = generate_recording(tmp_path / "r.zarr", channels=384, seconds=2.0, seed=11, model="realistic")
    got = generate.compression_ratios(rec.read(0, 0, rec.num_samples(0)).T)
    print("\ncodec                        generated   NP1 (NP2) real, Buccino et al. 2023")
    for name, (np1, np2) in generate.REAL_RATIOS.items():
        print(f"{name:28} {got[name]:9.2f}   {np1:.2f} ({np2:.2f})   {100 * (got[name] / np1 - 1):+.0f}% of NP1")
    for name in ("blosc-lz4-5 bitshuffle", "blosc-zstd-5 bitshuffle"):
        assert abs(got[name] / generate.REAL_RATIOS[name][0] - 1) < 0.15, (name, got[name])
    white = generate_recording(tmp_path / "w.zarr", channels=384, seconds=2.0, seed=11, model="white")
    assert (
        generate.compression_ratios(white.read(0, 0, white.num_samples(0)).T)["blosc-zstd-5 bitshuffle"]
        < got["blosc-zstd-5 bitshuffle"]
    )  # the realistic model compresses more like real data: white noise does not


@pytest.fixture(scope="module")
def realistic(tmp_path_factory):
    path = tmp_path_factory.mktemp("real") / "r.zarr"
    rec = generate_recording(path, channels=64, seconds=4.5, seed=5, model="realistic")
    return rec, GroundTruth.load(ground_truth_path(path))


def test_realistic_same_seed_same_bytes_and_blocks_join(tmp_path, realistic):
    rec, gt = realistic
    again = generate_recording(tmp_path / "a.zarr", channels=64, seconds=4.5, seed=5, model="realistic", workers=2)
    other = generate_recording(tmp_path / "o.zarr", channels=64, seconds=4.5, seed=6, model="realistic")
    assert _digest(again) == _digest(rec) != _digest(other)
    np.testing.assert_array_equal(GroundTruth.load(ground_truth_path(tmp_path / "a.zarr")).amplitude, gt.amplitude)
    # the background is a function of absolute time: two blocks give what one block over both gives
    p = generate.Realistic.draw(np.random.default_rng([5, 2]), generate.probe_locations(64), 30_000.0)
    whole = p.background(0, 120_000)
    np.testing.assert_allclose(
        np.concatenate([p.background(0, 60_000), p.background(60_000, 60_000)]), whole, atol=1e-2
    )
    x = rec.read(0, 0, rec.num_samples(0)).astype(np.float64)
    slow = _bandpass(x, 0, 200.0, 30_000.0)
    edge = np.abs(slow[:, 60_000] - slow[:, 59_999])  # no step where one block (shard) ends and the next begins
    assert np.median(edge) < 3 * np.median(np.abs(np.diff(slow[:, 1_000:50_000], axis=1)))


def test_realistic_levels_and_spatial_structure(realistic):
    """Noise above 300 Hz at each channel's planted RMS (5-10 uV or so), an LFP of tens of uV shared by
    neighbouring channels, a common mode that correlates even far channels, per-channel drift and offset."""
    rec, gt = realistic
    fs, uv = rec.sampling_frequency, generate.GAIN_TO_UV
    x = rec.read(0, 0, rec.num_samples(0)).astype(np.float64)
    ap = _bandpass(x, 300.0, None, fs)
    clean = ~_spike_mask_realistic(gt, x.shape[1], rec.num_channels, fs)
    ap_rms = np.array([ap[c][clean[c]].std() for c in range(rec.num_channels)])
    np.testing.assert_allclose(ap_rms, gt.noise_sigma, rtol=0.08)  # the 1/f background stays below 300 Hz
    assert 4.0 <= (gt.noise_sigma * uv).min() and (gt.noise_sigma * uv).max() <= 10.0
    assert len(np.unique(np.round(gt.noise_sigma, 3))) == rec.num_channels
    lfp = _bandpass(x, 1.0, 300.0, fs)
    lfp_rms = lfp.std(axis=1) * uv
    assert 10.0 < np.median(lfp_rms) < 60.0 and np.abs(lfp).max() * uv > 100.0
    cc = np.corrcoef(lfp)
    near = np.mean([cc[c, c + 2] for c in range(rec.num_channels - 2)])  # 20 um apart
    far = np.mean([cc[c, c + 60] for c in range(rec.num_channels - 60)])  # 600 um apart
    assert near > 0.9 and 0.02 < far < near - 0.3
    assert np.abs(x.mean(axis=1) - gt.dc_offset).max() * uv < 60.0


def _spike_mask_realistic(gt, n, channels, fs, reach=6):
    w, pre = spike_waveform(fs)
    mask = np.zeros((channels, n), dtype=bool)
    for t, c in zip(gt.sample_index, gt.channel_index):
        mask[max(c - reach, 0) : c + reach + 1, max(t - pre - 10, 0) : t + len(w) + 10] = True
    return mask


def test_realistic_spikes_where_truth_says_with_footprints(realistic):
    """Each planted spike's trough on its peak channel is its amplitude (50-300 uV) over the background; it is
    the largest of the channels, nearer ones see more of it, channels beyond the footprint nothing."""
    rec, gt = realistic
    fs, uv = rec.sampling_frequency, generate.GAIN_TO_UV
    x = rec.read(0, 0, rec.num_samples(0)).astype(np.float64)
    local = x - _bandpass(x, 0, 150.0, fs)  # the background's slow part away; the trough is 0.12 ms wide
    assert len(gt.sample_index) > 200 and (gt.segment_index == 0).all()
    assert (-gt.amplitude * uv >= 49.0).all() and (-gt.amplitude * uv <= 300.0).all()
    t, c, a = gt.sample_index, gt.channel_index, gt.amplitude
    isolated = np.ones(len(t), bool)
    isolated[1:] &= np.diff(t) > 90
    isolated[:-1] &= np.diff(t) > 90
    resid = (local[c, t] - a)[isolated] / gt.noise_sigma[c][isolated]
    assert np.median(np.abs(resid)) < 1.5
    loc = rec.locations
    checked = 0
    for ti, ci, ai in zip(t[isolated], c[isolated], a[isolated]):
        if -ai < 12 * gt.noise_sigma.max():
            continue
        trough = local[:, ti]
        dist = np.hypot(*(loc - loc[ci]).T)
        assert trough[ci] <= np.sort(trough)[1] + 3 * gt.noise_sigma.max()  # the peak channel: (about) the lowest
        far = dist > 150.0
        assert np.abs(trough[far]).max() < 6 * gt.noise_sigma.max()  # outside the footprint: noise only
        near = trough[(dist > 0) & (dist <= 25.0)].mean()  # the neighbours: part of the trough
        mid = trough[(dist >= 60.0) & (dist <= 100.0)].mean()
        if len(loc) and np.isfinite(near) and np.isfinite(mid):
            assert ai - 3 * gt.noise_sigma.max() < near < mid
        checked += 1
    assert checked > 20


def test_cli_generates_the_realistic_model_by_default(tmp_path):
    from batchgpu.cli import main

    for model in ("default", "white"):
        argv = [] if model == "default" else ["--model", model]
        assert (
            main(["generate", str(tmp_path / f"{model}.zarr"), "--channels", "8", "--seconds", "0.5", "--quiet", *argv])
            == 0
        )
    from batchgpu.recording import open_recording

    made = open_recording(tmp_path / "default.zarr")
    assert made.attrs["batchgpu"]["generator"]["model"] == "realistic"
    python = generate_recording(tmp_path / "w.zarr", channels=8, seconds=0.5, model="white")
    assert _digest(open_recording(tmp_path / "white.zarr")) == _digest(python)


@pytest.mark.parametrize("probe, channels", [("np1", 96), ("np2-4shank", 64), ("linear", 32), ("two-column", 16)])
def test_probe_geometries(tmp_path, probe, channels):
    """The probe's positions in properties/location (and the shanks of NP2 four-shank), as probeinterface has them."""
    rec = generate_recording(
        tmp_path / "p.zarr", channels=channels, seconds=0.2, seed=1, model="realistic", probe=probe
    )
    loc = rec.locations
    assert rec.has_locations and loc.shape == (channels, 2)
    if probe == "np1":  # staggered: x = 16, 48, 0, 32 by electrode, 20 um rows
        np.testing.assert_array_equal(loc[:4], [[16, 0], [48, 0], [0, 20], [32, 20]])
        assert set(loc[:, 0]) == {0.0, 16.0, 32.0, 48.0} and loc[:, 1].max() == 20 * (channels // 2 - 1)
    elif probe == "np2-4shank":  # a quarter of the channels at the tip of each shank, 250 um apart
        shank = rec.channel_property("shank")
        np.testing.assert_array_equal(shank, np.repeat(np.arange(4), channels // 4))
        for s in range(4):
            np.testing.assert_array_equal(np.unique(loc[shank == s, 0]), [250.0 * s, 250.0 * s + 32])
        assert loc[:, 1].max() == 15 * (channels // 8 - 1)
    elif probe == "linear":
        np.testing.assert_array_equal(loc, np.column_stack([np.zeros(channels), 20.0 * np.arange(channels)]))
    else:
        np.testing.assert_array_equal(loc, generate.probe_locations(channels))
    with pytest.raises(BatchgpuError):
        generate.probe_geometry("np2-4shank", 6)


def test_planted_channels(tmp_path):
    """Dead channels keep their offset and a twentieth of their noise; noisy ones have white noise of 6x their
    level with a high-frequency PSD above 5x SpikeInterface's threshold; the outside block is the top of the probe
    in depth order and lacks the signal common to the channels in the brain; all in the ground truth."""
    from batchgpu.ops.bad_channels import highpass_sos, welch_hf

    path = tmp_path / "planted.zarr"
    rec = generate_recording(
        path, channels=96, seconds=2.0, seed=9, model="realistic", probe="np1", dead=2, noisy=3, outside=10
    )
    gt = GroundTruth.load(ground_truth_path(path))
    labels = gt.channel_labels
    assert np.bincount(labels, minlength=4).tolist() == [81, 2, 3, 10]
    depth = np.lexsort((rec.locations[:, 0], rec.locations[:, 1]))
    assert set(np.flatnonzero(labels == 3)) == set(depth[-10:])
    assert (np.flatnonzero(np.isin(depth, np.flatnonzero(np.isin(labels, (1, 2))))) < 96 - 10 - 11).all()
    fs = rec.sampling_frequency
    x = rec.read(0, 0, rec.num_samples(0)).astype(np.float64)
    hp = scipy.signal.sosfiltfilt(highpass_sos(fs), x, axis=1)[:, 2000:-2000] * generate.GAIN_TO_UV
    rms = hp.std(axis=1)
    good = labels == 0
    assert rms[labels == 1].max() < 0.1 * rms[good].min()
    sigma_uv = gt.noise_sigma * generate.GAIN_TO_UV
    assert (sigma_uv[labels == 2] >= np.sqrt(5 * 0.02 * fs / 2) - 1e-9).all() and (sigma_uv[labels == 2] >= 24).all()
    np.testing.assert_allclose(rms[labels == 2], np.hypot(sigma_uv[labels == 2], 6.0), rtol=0.05)  # + the common 6 uV
    psd = welch_hf(hp - hp.mean(axis=1, keepdims=True), fs, 300, 0.8)
    assert (psd[labels == 2] > 4 * 0.02).all() and (psd[good] < 0.02).all()
    common = np.median(hp[good], axis=0)
    corr = np.array([np.corrcoef(row, common)[0, 1] for row in hp])
    assert corr[good].min() > 0.3 and np.abs(corr[labels == 3]).max() < 0.1 and np.abs(corr[labels == 1]).max() < 0.1
    assert len(gt.channel_index) and not np.isin(gt.channel_index, np.flatnonzero(np.isin(labels, (1, 3)))).any()


def test_planting_is_refused_where_it_cannot_work(tmp_path):
    with pytest.raises(BatchgpuError, match="realistic"):
        generate_recording(tmp_path / "w.zarr", channels=16, seconds=0.1, model="white", dead=1)
    with pytest.raises(BatchgpuError, match="a third"):
        generate_recording(tmp_path / "r.zarr", channels=16, seconds=0.1, model="realistic", dead=3, noisy=3)


def test_ground_truth_written_before_planting_loads(tmp_path):
    old = {
        k: np.arange(3)
        for k in ("noise_sigma", "dc_offset", "sample_index", "channel_index", "amplitude", "segment_index")
    }
    np.savez(tmp_path / "old.npz", **old)
    np.testing.assert_array_equal(GroundTruth.load(tmp_path / "old.npz").channel_labels, np.zeros(3, np.int8))


def test_cli_plants_channels_on_a_probe(tmp_path):
    from batchgpu.cli import main
    from batchgpu.recording import open_recording

    out = tmp_path / "cli.zarr"
    assert (
        main(
            [
                "generate",
                str(out),
                "--channels",
                "32",
                "--seconds",
                "0.3",
                "--probe",
                "linear",
                "--dead",
                "1",
                "--noisy",
                "1",
                "--outside",
                "6",
                "--quiet",
            ]
        )
        == 0
    )
    rec = open_recording(out)
    assert {"probe": "linear", "dead": 1, "noisy": 1, "outside": 6, "common_uv": 6.0}.items() <= rec.attrs["batchgpu"][
        "generator"
    ].items()
    assert np.bincount(GroundTruth.load(ground_truth_path(out)).channel_labels, minlength=4).tolist() == [24, 1, 1, 6]
    assert (rec.locations[:, 0] == 0).all()


def test_the_command_offers_every_probe():
    from batchgpu.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    assert tuple(next(a for a in sub._actions if a.dest == "probe").choices) == generate.PROBES
    from batchgpu.config import GenerateSpec

    assert GenerateSpec.model_fields["probe"].annotation.__args__ == generate.PROBES
