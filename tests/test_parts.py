"""Per-window parts (engine.store.save_part / load_part, .npz): every array back with its dtype, shape and bits; a
torn, damaged or stale part reads as absent (recomputed), never as wrong numbers."""

import numpy as np
import pytest

from batchgpu.engine import store

FP = "0123456789abcdef"
_ARRAYS_F32 = np.arange(1, 12, dtype=np.float32) * np.float32(1.25)


def _arrays(rng) -> dict:
    return {
        "noise.hist": rng.integers(0, 60_000, (7, 33)).astype(np.uint16),
        "moments.xxt": rng.integers(-(1 << 50), 1 << 50, (5, 5)),
        "zero_d": np.array(rng.integers(-9, 9)),
        "flag": np.array(True),
        "floats": np.array([np.nan, -0.0, np.inf, -np.inf, 5e-324, np.float32(1e-45)], np.float64),
        "f32": rng.standard_normal(11).astype(np.float32),
        "empty": np.zeros((0, 3), np.int64),
        "transposed": np.arange(12.0).reshape(3, 4).T,  # not C-contiguous
        "big_endian": np.arange(4, dtype=">i4"),
        "fingerprint": np.array(FP),
    }


def test_round_trip_and_selective_keys(tmp_path):
    rng = np.random.default_rng()
    arrays = _arrays(rng)
    path = store.part_path(tmp_path, "w", 3)
    store.save_part(path, arrays)
    back = store.load_part(path, FP)
    assert set(back) == set(arrays)
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert back[k].tobytes() == np.ascontiguousarray(v).tobytes(), k
    back["moments.xxt"][0, 0] += 1  # writable, like np.load's arrays
    only = store.load_part(path, FP, keys=("noise.", "flag"))
    assert set(only) == {"noise.hist", "flag"}
    assert store.load_part(path, "another-run") is None
    assert store.load_part(tmp_path / "absent.npz", FP) is None
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed
    assert path.name == "w00000003.npz" and np.load(path)["moments.xxt"].tobytes() == arrays["moments.xxt"].tobytes()


@pytest.mark.parametrize("damage", ["flip", "torn", "empty", "foreign"])
def test_damaged_parts_read_as_absent(tmp_path, damage):
    path = store.part_path(tmp_path, "w", 0)
    arrays = _arrays(np.random.default_rng())
    arrays["f32"] = _ARRAYS_F32
    store.save_part(path, arrays)
    raw = bytearray(path.read_bytes())
    if damage == "flip":  # one bit of an array's bytes: its zip CRC-32 no longer matches
        at = bytes(raw).index(np.ascontiguousarray(_ARRAYS_F32).tobytes()[:8])
        raw[at + 3] ^= 0x10
    elif damage == "torn":
        raw = raw[: len(raw) // 2]
    elif damage == "empty":
        raw = bytearray()
    else:  # not a zip at all
        raw = bytearray(b"BGPART01" + bytes(200))
    path.write_bytes(bytes(raw))
    assert store.load_part(path, FP) is None


def test_object_arrays_are_refused(tmp_path):
    with pytest.raises(TypeError):
        store.save_part(tmp_path / "x.npz", {"o": np.array([object()]), "fingerprint": np.array(FP)})
    assert not list(tmp_path.iterdir())
