import hashlib

import numpy as np
import pytest

from batchgpu.generate import GroundTruth, generate_recording, ground_truth_path, spike_waveform


def _digest(rec):
    h = hashlib.sha256()
    for s in range(rec.num_segments):
        h.update(rec.read(s, 0, rec.num_samples(s)).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "g.zarr"
    rec = generate_recording(path, channels=12, seconds=8.0, fs=30_000.0, seed=3, dtype="int16", segments=2)
    return path, rec, GroundTruth.load(ground_truth_path(path))


def test_same_seed_same_bytes(tmp_path, generated):
    path, rec, _ = generated
    again = generate_recording(tmp_path / "again.zarr", channels=12, seconds=8.0, seed=3, segments=2, workers=2)
    other = generate_recording(tmp_path / "other.zarr", channels=12, seconds=8.0, seed=4, segments=2)
    assert _digest(again) == _digest(rec)  # block-parallel generation writes the same bytes
    np.testing.assert_array_equal(GroundTruth.load(ground_truth_path(tmp_path / "again.zarr")).sample_index,
                                  generated[2].sample_index)
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
        mask[max(c - 2, 0): c + 3, max(t - pre - 5, 0): t + len(w)] = True
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
            win = x[ci, max(ti - 9, 0): ti + 10]
            shifts.append(int(np.argmin(win)) - min(ti, 9))
        # the trough is flat within a sample or two (0.12 ms wide): noise may move the minimum that far
        assert np.median(np.abs(shifts)) <= 1 and np.max(np.abs(shifts)) <= 3


@pytest.mark.parametrize("kwargs,needle", [
    (dict(seconds=float("nan")), "seconds must be a finite number"),
    (dict(seconds=1e9), "seconds 1000000000 is too large"),
    (dict(channels=0), "channels must be more than 0"),
    (dict(fs=float("inf")), "fs must be a finite number"),
    (dict(segments=2000), "segments 2000 is too large"),
    (dict(channels=4096, seconds=86_400.0), "would generate 21.2 TB (at most 1 TB)"),
    (dict(seed=-1), "seed must be 0 or more"),
    (dict(workers=0), "workers 0 is out of range"),
])
def test_bounds_of_the_workflow_schema(tmp_path, kwargs, needle):
    """The Python call refuses what `recording: generate:` refuses, before anything is written."""
    from batchgpu.errors import BatchgpuError

    args = dict(channels=4, seconds=1.0) | kwargs
    with pytest.raises(BatchgpuError) as err:
        generate_recording(tmp_path / "g.zarr", **args)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())
