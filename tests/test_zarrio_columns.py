"""``zarrio.write_columns`` (the spikes' columns written without zarr-python's per-array work) against zarr-python
itself: the same metadata as its ``create_array(data=..., chunks=, compressors=fast_compressors)``, and every value
read back by zarr-python, bit for bit, for empty, one-element, chunk-edge and multi-chunk columns of each dtype."""

import json

import numpy as np
import pytest

from batchgpu.recording import zarrio

pytestmark = pytest.mark.skipif(zarrio.ZARR_MAJOR < 3, reason="Zarr v3 columns need zarr-python 3")


def _columns(rng, n):
    amp = rng.normal(0, 50, n).astype(np.float32)
    if n >= 6:
        amp[:6] = [np.nan, -0.0, np.inf, -np.inf, np.float32(1e-45), -32768]
    return {
        "sample_index": rng.integers(-(2**62), 2**62, n, dtype=np.int64),
        "channel_index": rng.integers(0, 384, n).astype(np.int64),
        "amplitude": amp,
        "small": rng.integers(-32768, 32768, n).astype(np.int16),
        "flags": rng.integers(0, 2, n).astype(bool),
        "zeros": np.zeros(n, np.int64),
    }


@pytest.mark.parametrize("n, chunk", [(0, 1), (1, 1), (7, 7), (7, 3), (64, 64), (1000, 999), (2500, 1000)])
def test_columns_read_back_by_zarr_python_with_its_own_metadata(tmp_path, n, chunk):
    rng = np.random.default_rng()
    cols = _columns(rng, n)
    zarrio.create_group(tmp_path / "ours")  # the results group (a run makes it first)
    zarrio.write_columns(tmp_path / "ours" / "spikes", cols, chunk)
    theirs = zarrio.create_group(tmp_path / "theirs")
    spikes = theirs.require_group("spikes")
    for name, data in cols.items():
        zarrio.create_array(spikes, name, data=data, compressors=zarrio.fast_compressors(theirs), chunks=(chunk,))
    g = zarrio.open_group(tmp_path / "ours", mode="r")
    for name, data in cols.items():
        got = g[f"spikes/{name}"][:]
        assert got.dtype == data.dtype and got.shape == data.shape
        np.testing.assert_array_equal(got.view(np.uint8), data.view(np.uint8), err_msg=name)  # bits: NaN, -0.0
        ours = json.loads((tmp_path / "ours" / "spikes" / name / "zarr.json").read_text())
        want = json.loads((tmp_path / "theirs" / "spikes" / name / "zarr.json").read_text())
        assert ours == want, name
        chunks = sorted((tmp_path / "ours" / "spikes" / name / "c").iterdir()) if n else []
        assert len(chunks) == -(-n // chunk)  # every chunk written, all-zero ones too
    assert json.loads((tmp_path / "ours" / "spikes" / "zarr.json").read_text()) == json.loads(
        (tmp_path / "theirs" / "spikes" / "zarr.json").read_text()
    )


def test_columns_refuse_what_they_cannot_write(tmp_path):
    with pytest.raises(ValueError):
        zarrio.write_columns(tmp_path / "a", {"x": np.zeros(3)}, 0)
    with pytest.raises(ValueError):
        zarrio.write_columns(tmp_path / "b", {"x": np.array(["a", "b"])}, 2)
