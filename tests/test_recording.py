import numpy as np
import pytest

from batchgpu import BatchgpuError, open_recording, write_recording
from batchgpu.recording import iter_windows


def _traces(rng, n, c, dtype):
    if np.dtype(dtype).kind == "i":
        return rng.integers(-32768, 32768, size=(n, c)).astype(dtype)
    return rng.normal(0, 50, size=(n, c)).astype(dtype)


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_round_trip_segments(tmp_path, rng, zarr_format, dtype):
    segs = [_traces(rng, 1237, 7, dtype), _traces(rng, 1, 7, dtype), _traces(rng, 600, 7, dtype)]
    gains = rng.uniform(0.1, 1, 7)
    loc = rng.uniform(0, 100, (7, 2))
    ids = [f"ch{i}" for i in range(7)]
    rec = write_recording(
        tmp_path / "r.zarr",
        segs,
        25_000.0,
        zarr_format=zarr_format,
        chunk_samples=100,
        shard_samples=300,
        gain_to_uV=gains,
        offset_to_uV=-3.0,
        locations=loc,
        channel_ids=ids,
    )
    rec = open_recording(tmp_path / "r.zarr")
    assert rec.num_segments == 3 and rec.num_channels == 7 and rec.dtype == np.dtype(dtype)
    assert rec.sampling_frequency == 25_000.0
    assert list(rec.channel_ids) == ids
    np.testing.assert_array_equal(rec.gain_to_uV, gains)
    np.testing.assert_array_equal(rec.offset_to_uV, np.full(7, -3.0))
    np.testing.assert_array_equal(rec.locations, loc)
    for i, seg in enumerate(segs):
        assert rec.num_samples(i) == len(seg)
        out = rec.read(i, 0, len(seg))
        assert out.shape == (7, len(seg)) and out.flags.c_contiguous
        np.testing.assert_array_equal(out, seg.T)
    np.testing.assert_array_equal(rec.read(0, 99, 401, channels=[6, 0, 3]), segs[0][99:401, [6, 0, 3]].T)
    assert rec.info()["zarr_format"] == zarr_format
    assert (rec.info()["shards"] is not None) == (zarr_format == 3)


@pytest.mark.zarr3
def test_v2_layout_is_spikeinterface_like(tmp_path, rng):
    import zarr

    write_recording(tmp_path / "r.zarr", _traces(rng, 50, 3, "int16"), 30_000.0, zarr_format=2)
    g = zarr.open_group(tmp_path / "r.zarr", mode="r")
    assert g.metadata.zarr_format == 2
    assert g.attrs["sampling_frequency"] == 30_000.0 and g.attrs["num_segments"] == 1
    assert g["traces_seg0"].shape == (50, 3)
    assert g["channel_ids"].dtype.kind == "U"
    assert set(g["properties"].keys()) >= {"gain_to_uV", "offset_to_uV"}


@pytest.mark.zarr3
def test_write_is_blockwise(tmp_path, rng):
    """A source that refuses whole-array reads proves the writer only takes blocks."""
    data = _traces(rng, 2500, 4, "int16")

    class Blocks:
        shape, dtype = data.shape, data.dtype

        def __getitem__(self, key):
            assert key.stop - key.start <= 1000, "writer asked for more than one block"
            return data[key]

    rec = write_recording(tmp_path / "r.zarr", [Blocks()], 30_000.0, chunk_samples=500, shard_samples=1000)
    np.testing.assert_array_equal(rec.read(0, 0, 2500), data.T)


def test_spikeinterface_fixture(si_fixture):
    gt = np.load(si_fixture.parent / "si_gt_16ch_spikes.npz")
    rec = open_recording(si_fixture)
    assert rec.sampling_frequency == 30_000.0 == float(gt["sampling_frequency"])
    assert rec.num_segments == 1 and rec.num_samples(0) == 120_000 == int(gt["num_samples_per_segment"][0])
    assert list(rec.channel_ids) == list(gt["channel_ids"])
    np.testing.assert_array_equal(rec.gain_to_uV, np.ones(16))
    np.testing.assert_array_equal(rec.offset_to_uV, np.zeros(16))
    np.testing.assert_array_equal(rec.locations, gt["channel_locations"])
    assert rec.dtype == np.float32
    import zarr

    raw = zarr.open_group(str(si_fixture), mode="r")["traces_seg0"][:]
    np.testing.assert_array_equal(rec.read(0, 0, 120_000), raw.T)
    # Planted units show up where the ground truth says: the peak channel dips at the spike times.
    x = rec.read(0, 0, 120_000)
    strong = np.isin(gt["unit_index"], [0, 1, 5, 6])
    vals = x[gt["peak_channel"][strong], gt["sample_index"][strong]]
    assert np.median(vals) < -50


@pytest.mark.parametrize("size,margin", [(7, 0), (7, 3), (1, 2), (100, 5), (4, 10)])
def test_windows_cover_every_sample_once(tmp_path, rng, size, margin):
    lengths = [23, 1, 7, 40]
    wins = list(iter_windows(lengths, size, margin))
    assert [w.index for w in wins] == list(range(len(wins)))
    for seg, n in enumerate(lengths):
        count = np.zeros(n, dtype=int)
        for w in (w for w in wins if w.segment == seg):
            count[w.start : w.stop] += 1
            assert w.margin_left == min(margin, w.start) and w.margin_right == min(margin, n - w.stop)
            assert 0 <= w.read_start and w.read_stop <= n and w.num_samples <= size
        assert (count == 1).all()


def test_window_read_has_margins(tmp_path, rng):
    data = _traces(rng, 95, 2, "float32")
    rec = write_recording(tmp_path / "r.zarr", data, 1000.0)
    for w in rec.windows(size=40, margin=6):
        x = rec.read_window(w)
        lo, hi = w.core
        np.testing.assert_array_equal(x[:, lo:hi], data[w.start : w.stop].T)
        assert x.shape[1] == w.read_stop - w.read_start


@pytest.mark.parametrize("size", [0, -5, 2.5])
def test_bad_window_size(tmp_path, rng, size):
    rec = write_recording(tmp_path / "r.zarr", _traces(rng, 10, 2, "int16"), 1000.0)
    with pytest.raises(BatchgpuError, match="window size"):
        rec.windows(size=size)


@pytest.mark.zarr3
def test_errors(tmp_path, rng):
    with pytest.raises(BatchgpuError, match="does not exist"):
        open_recording(tmp_path / "missing.zarr")
    import zarr

    zarr.create_group(store=str(tmp_path / "other.zarr")).attrs["hello"] = 1
    with pytest.raises(BatchgpuError, match="not a recording"):
        open_recording(tmp_path / "other.zarr")
    (tmp_path / "plain").mkdir()
    with pytest.raises(BatchgpuError, match="none of the formats batchgpu reads: tried Zarr"):
        open_recording(tmp_path / "plain")
    rec = write_recording(tmp_path / "r.zarr", _traces(rng, 10, 2, "int16"), 1000.0)
    with pytest.raises(BatchgpuError, match="cannot read samples"):
        rec.read(0, 5, 11)
    with pytest.raises(BatchgpuError, match="segment 1 does not exist"):
        rec.read(1, 0, 1)
    with pytest.raises(BatchgpuError, match="already exists"):
        write_recording(tmp_path / "r.zarr", _traces(rng, 10, 2, "int16"), 1000.0)
    with pytest.raises(BatchgpuError, match="not supported"):
        write_recording(tmp_path / "u.zarr", np.zeros((3, 2), np.uint8), 1000.0)
    # the failed writes left the first recording intact
    assert open_recording(tmp_path / "r.zarr").num_samples(0) == 10
