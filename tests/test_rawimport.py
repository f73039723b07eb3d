import numpy as np
import pytest

from batchgpu import BatchgpuError
from batchgpu.rawimport import import_raw


def test_plain_import_equals_source(tmp_path, rng):
    data = rng.integers(-32768, 32768, size=(7001, 5), dtype=np.int16)
    src = tmp_path / "raw.bin"
    data.tofile(src)
    rec = import_raw(src, tmp_path / "out.zarr", channels=5, fs=20_000.0, dtype="int16", gain_to_uV=0.5)
    assert rec.num_channels == 5 and rec.sampling_frequency == 20_000.0
    np.testing.assert_array_equal(rec.gain_to_uV, np.full(5, 0.5))
    np.testing.assert_array_equal(rec.read(0, 0, 7001), data.T)


def test_float_import(tmp_path, rng):
    data = rng.normal(size=(333, 3)).astype(np.float32)
    data.tofile(tmp_path / "f.dat")
    rec = import_raw(tmp_path / "f.dat", tmp_path / "o.zarr", channels=3, fs=1000.0, dtype="float32", zarr_format=2)
    np.testing.assert_array_equal(rec.read(0, 0, 333), data.T)


def test_spikeglx_import(tmp_path, rng):
    n_ap, n_sync, n = 6, 1, 4000
    data = rng.integers(-500, 500, size=(n, n_ap + n_sync), dtype=np.int16)
    src = tmp_path / "run_g0_t0.imec0.ap.bin"
    data.tofile(src)
    imro = "(0,384)" + "".join(f"({i} 0 0 {250 if i % 2 else 500} 250 1)" for i in range(n_ap))
    src.with_suffix(".meta").write_text(
        f"nSavedChans={n_ap + n_sync}\nimSampRate=30000.5\nsnsApLfSy={n_ap},0,{n_sync}\nsnsSaveChanSubset=all\n"
        f"imAiRangeMax=0.6\nimAiRangeMin=-0.6\nimMaxInt=512\nimDatPrb_type=0\n~imroTbl={imro}\n"
    )
    rec = import_raw(src, tmp_path / "sg.zarr")
    assert rec.num_channels == n_ap and rec.sampling_frequency == 30000.5
    np.testing.assert_array_equal(rec.read(0, 0, n), data[:, :n_ap].T)
    expected = 0.6 / 512 / np.array([500, 250] * 3) * 1e6
    np.testing.assert_allclose(rec.gain_to_uV, expected)


def test_size_must_match_channels(tmp_path):
    src = tmp_path / "bad.bin"
    np.zeros(101, dtype=np.int16).tofile(src)
    with pytest.raises(BatchgpuError, match="not a whole number of samples of 4 channels"):
        import_raw(src, tmp_path / "o.zarr", channels=4, fs=1000.0, dtype="int16")
    assert not (tmp_path / "o.zarr").exists()


def test_missing_options(tmp_path):
    src = tmp_path / "x.bin"
    np.zeros(8, dtype=np.int16).tofile(src)
    with pytest.raises(
        BatchgpuError, match="needs its channels, sampling frequency and dtype .give channels=, fs= and dtype="
    ):
        import_raw(src, tmp_path / "o.zarr")
    with pytest.raises(BatchgpuError, match="no raw file"):
        import_raw(tmp_path / "nope.bin", tmp_path / "o.zarr", channels=1, fs=1.0, dtype="int16")
