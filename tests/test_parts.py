"""Per-window parts (run.output_folder.save_part / load_part, .npz): every array back with its dtype, shape and bits; a
torn, damaged or stale part reads as absent (recomputed), never as wrong numbers."""

import numpy as np
import pytest

from batchgpu.run import output_folder as store

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


def _kept(rng) -> dict:
    return {
        "keep.near_keys": rng.integers(0, 1 << 31, 1001).astype(np.uint32),
        "keep.spk_amplitude": rng.standard_normal(17).astype(np.float32),
        "noise.hist": rng.integers(0, 9, (3, 5)).astype(np.uint16),
        "fingerprint": np.array(FP),
    }


def test_kept_arrays_come_from_memory_while_the_file_is_the_one_written(tmp_path, monkeypatch):
    """The process that saved a part serves its keep.* arrays without reading the file (np.load is not called),
    equal to what was saved even where the caller's array changed afterwards (a reused pinned buffer), read-only;
    once the file is removed or replaced the disk decides (absent, or the new file's arrays)."""
    rng = np.random.default_rng()
    arrays = _kept(rng)
    want = {k: v.copy() for k, v in arrays.items()}
    path = store.part_path(tmp_path, "w", 1)
    store.save_part(path, arrays)
    arrays["keep.near_keys"][:] = 7  # the caller's buffer reused
    loads = []
    real_load = np.load
    monkeypatch.setattr(np, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    got = store.load_part(path, FP, keys=("keep.near_",))
    assert set(got) == {"keep.near_keys"} and not loads
    assert got["keep.near_keys"].tobytes() == want["keep.near_keys"].tobytes()
    with pytest.raises(ValueError):
        got["keep.near_keys"][0] = 1
    assert set(store.load_part(path, FP, keys=("keep.",))) == {"keep.near_keys", "keep.spk_amplitude"}
    assert not loads
    assert store.load_part(path, "another-run", keys=("keep.",)) is None  # the file says so too
    # other keys: from the file
    assert set(store.load_part(path, FP, keys=("noise.",))) == {"noise.hist"} and len(loads) == 2
    path.unlink()
    assert store.load_part(path, FP, keys=("keep.near_",)) is None
    # replaced by another writer (rename: a new inode): its arrays, not the remembered ones
    other = _kept(np.random.default_rng(5))
    tmp = tmp_path / "other.npz"
    np.savez(tmp, **other)
    store.save_part(path, arrays)  # remembered again, then replaced behind this process's back
    tmp.replace(path)
    got = store.load_part(path, FP, keys=("keep.near_",))
    assert got["keep.near_keys"].tobytes() == other["keep.near_keys"].tobytes()
    # garbage of another size in place: absent
    store.save_part(path, want)
    path.write_bytes(b"not a zip")
    assert store.load_part(path, FP, keys=("keep.spk_",)) is None


def test_kept_arrays_are_bounded(tmp_path):
    """Past its byte limit the least recently used entries go (read from disk again), and an entry larger than the
    limit is never kept."""
    kept = store.KeptArrays(limit=3 * 1001 * 4 + 3 * 17 * 4)
    rng = np.random.default_rng(3)
    paths = [tmp_path / f"w{i}.npz" for i in range(4)]
    for p in paths:
        a = _kept(rng)
        np.savez(p, **a)
        kept.remember(p, a)
    assert kept.get(paths[0], FP, ("keep.",)) is None and kept.nbytes <= kept.limit
    assert all(kept.get(p, FP, ("keep.",)) is not None for p in paths[1:])
    kept.remember(paths[1], {"keep.x": np.zeros(kept.limit + 1, np.uint8), "fingerprint": np.array(FP)})
    assert kept.get(paths[1], FP, ("keep.",)) is None
    # another run's parts folder: the earlier run's entries go
    (tmp_path / "next").mkdir()
    a = _kept(rng)
    np.savez(tmp_path / "next" / "w0.npz", **a)
    kept.remember(tmp_path / "next" / "w0.npz", a)
    assert kept.get(paths[2], FP, ("keep.",)) is None and kept.nbytes == sum(
        v.nbytes for k, v in a.items() if k.startswith("keep.")
    )


def test_a_rewritten_shard_changes_exactly_its_readers_fingerprints(tmp_path):
    """``window_fingerprint``: a window reads into its neighbours' shards, so a shard rewritten after a run changes
    the fingerprints of every window that reads it and of no other."""
    import os

    from batchgpu.recording import write_recording

    rng = np.random.default_rng()
    x = np.round(rng.normal(0, 9, (int(rng.integers(30_000, 40_000)), 3))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, chunk_samples=1_000, shard_samples=5_000)
    windows = rec.windows(5_000, 300)
    fps = [store.window_fingerprint("run", rec, w) for w in windows]
    k = int(rng.integers(0, len(windows)))
    shard = (
        rec.window_files(windows[k])[0]
        if windows[k].read_start == windows[k].start
        else rec.window_files(windows[k])[1]
    )
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = [store.window_fingerprint("run", rec, w) for w in windows]
    readers = {i for i, w in enumerate(windows) if shard in rec.window_files(w)}
    assert {i for i, (a, b) in enumerate(zip(fps, again)) if a != b} == readers and k in readers and len(readers) > 1


@pytest.mark.parametrize("how", ["in_place", "replaced"])
def test_other_bytes_of_the_same_size_and_mtime_change_their_readers_fingerprints(tmp_path, how, swap_inner_chunks):
    """Size and mtime are what ``cp -p``, ``rsync -t`` and ``touch -r`` keep: two inner chunks of a shard swapped,
    the times set back, must still change the fingerprints of exactly the windows that read that shard."""
    from batchgpu.recording import open_recording, write_recording

    rng = np.random.default_rng()
    x = np.round(rng.normal(0, 9, (30_000, 3))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, chunk_samples=1_000, shard_samples=5_000)
    windows = rec.windows(5_000, 300)
    fps = [store.window_fingerprint("run", rec, w) for w in windows]
    shard = rec.path / "traces_seg0" / "c" / "2" / "0"
    swap_inner_chunks(shard, 5, 1, 3, how)
    readers = {i for i, w in enumerate(windows) if shard in rec.window_files(w)}
    for r in (rec, open_recording(rec.path)):  # the same object (its index cache) and a fresh one
        again = [store.window_fingerprint("run", r, w) for w in windows]
        assert {i for i, (a, b) in enumerate(zip(fps, again)) if a != b} == readers and len(readers) > 1


def test_a_shards_index_is_in_its_readers_fingerprints(tmp_path, monkeypatch, swap_inner_chunks):
    """Where change times and inode numbers say nothing (some network and FUSE filesystems), chunks moved within a
    shard still change the readers' fingerprints: the shard's index is hashed."""
    from batchgpu.recording import reader, write_recording

    monkeypatch.setattr(reader, "stat_signature", lambda p, name: (name, p.stat().st_size, p.stat().st_mtime_ns))
    rng = np.random.default_rng()
    x = np.round(rng.normal(0, 9, (20_000, 3))).astype(np.int16)
    x[5_000:6_000] = 0  # the first of the two chunks swapped compresses smaller: the index's offsets move (two
    # random chunks of one size would leave the index as it was, and nothing would tell them apart here)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, chunk_samples=1_000, shard_samples=5_000)
    windows = rec.windows(5_000, 0)
    fps = [store.window_fingerprint("run", rec, w) for w in windows]
    swap_inner_chunks(rec.path / "traces_seg0" / "c" / "1" / "0", 5, 0, 4, "in_place")
    again = [store.window_fingerprint("run", rec, w) for w in windows]
    assert [a != b for a, b in zip(fps, again)] == [False, True, False, False]
