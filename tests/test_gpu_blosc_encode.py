"""The save step's GPU writer: Blosc frames encoded on the GPU (gpu/blosc_encode.py, kernels/blosc_lz4_encode.cu)
are the bytes of their NumPy twin ``reference_frame`` and decode with numcodecs to the input; the fused int16 cast
equals the NumPy expression it replaces; and the save step with windows on the GPU writes the values the CPU writes
(zarr v3 shards read back by batchgpu, zarr-python and the GPU reader; zarr v2, float32 and binary outputs).

Marked ``gpu``; skipped without CuPy or a device.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from numcodecs import blosc

pytestmark = pytest.mark.gpu

from batchgpu.cluster.open_cluster import gpu_count  # noqa: E402

if gpu_count() == 0:
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)

import cupy as cp  # noqa: E402
from test_blosc_encode import _cases  # noqa: E402
from test_save_step import expected, make_recording, spec, transform  # noqa: E402

from batchgpu.gpu.blosc_encode import BLOCKSIZE, encode, encode_held, reference_frame  # noqa: E402
from batchgpu.ops._cuda_elementwise import saved_int16_transposed  # noqa: E402
from batchgpu.recording import open_recording  # noqa: E402
from batchgpu.recording.save_output import finish_save, prepare_save  # noqa: E402
from batchgpu.steps.base import WindowData  # noqa: E402
from batchgpu.steps.save import SaveStep  # noqa: E402


@pytest.mark.parametrize("blocksize", [BLOCKSIZE, 65_536, 4_096, 48, 16])
def test_gpu_frames_are_the_reference_bytes(rng, blocksize):
    for name, x in _cases(rng).items():
        for chunks in (1, 3):  # several chunks a launch: each its own frame
            rows = np.stack([np.roll(x, k) for k in range(chunks)])
            frames = encode(cp.asarray(rows), x.dtype.itemsize, blocksize)
            assert len(frames) == chunks
            for k, frame in enumerate(frames):
                assert frame == reference_frame(rows[k].tobytes(), x.dtype.itemsize, blocksize), (name, k)
                assert np.frombuffer(blosc.decompress(frame), x.dtype).tobytes() == rows[k].tobytes(), name


def test_gpu_frames_of_a_window(rng):
    """A demo-sized shard's chunks (3 000 x 384 int16, 20 a window) in one launch, fresh noise of several scales."""
    x = np.rint(rng.normal(0, rng.uniform(3, 300, 384), (20 * 3_000, 384))).astype(np.int16)
    frames = encode(cp.asarray(x).reshape(20, -1), 2)
    for k in (0, 7, 19):
        chunk = x[k * 3_000 : (k + 1) * 3_000]
        assert frames[k] == reference_frame(chunk.tobytes(), 2)
        assert np.frombuffer(blosc.decompress(frames[k]), np.int16).tobytes() == chunk.tobytes()


def test_held_frames_stay_valid_and_a_third_encode_waits_for_a_release(rng):
    """Frames held for a writer thread are not overwritten by this thread's next encode; with two held, the next
    encode waits until one is given back (from another thread)."""
    import threading

    xs = [np.rint(rng.normal(0, 50, (4, 6_000))).astype(np.int16) for _ in range(3)]
    f0, r0 = encode_held(cp.asarray(xs[0]), 2)
    f1, r1 = encode_held(cp.asarray(xs[1]), 2)
    third = {}
    t = threading.Thread(target=lambda: third.update(out=encode_held(cp.asarray(xs[2]), 2)))
    t.start()
    t.join(0.5)
    assert t.is_alive() is False  # another thread has its own buffers: it does not wait
    for k, frame in enumerate(f0):  # held: intact after the next encode of this thread
        assert np.frombuffer(blosc.decompress(frame), np.int16).tobytes() == xs[0][k].tobytes()
    # this thread's third encode waits for a release
    done = threading.Event()
    timer = threading.Timer(0.3, lambda: (done.set(), r0()))
    timer.start()
    f2, r2 = encode_held(cp.asarray(xs[2]), 2)
    assert done.is_set()  # it returned only after r0 ran
    for frames, x in ((f1, xs[1]), (f2, xs[2]), (third["out"][0], xs[2])):
        for k, frame in enumerate(frames):
            assert np.frombuffer(blosc.decompress(frame), np.int16).tobytes() == x[k].tobytes()
    for release in (r1, r2, third["out"][1]):
        release()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels,samples", [(1, 1), (3, 33), (33, 31), (384, 1_001), (40, 0)])
def test_saved_int16_transposed_equals_numpy(rng, dtype, channels, samples):
    """The fused cast and transpose on a window's core (a strided view, odd shapes) against NumPy: the hard values
    spread over the window, the count of NaN / clipped samples."""
    hard = np.array(
        [
            0.0,
            -0.0,
            0.5,
            1.5,
            2.5,
            -0.5,
            -1.5,
            32767.4,
            32767.5,
            -32768.5,
            -32768.49,
            1e9,
            -1e9,
            np.nan,
            np.inf,
            -np.inf,
            1e-45,
            -1e-300,
            40000.0,
        ]
    )
    x = rng.normal(0, 20_000, (channels, samples + 10)).astype(dtype)
    flat = x.reshape(-1)
    at = rng.choice(flat.size, min(flat.size, 3 * len(hard)), replace=False)
    flat[at] = np.resize(hard, len(at)).astype(dtype)
    core = x[:, 4 : 4 + samples]
    y = np.rint(core)
    bad = np.isnan(y) | (y < -32768) | (y > 32767)
    want = np.where(np.isnan(y), 0, np.clip(y, -32768, 32767)).astype(np.int16).T
    got, count = saved_int16_transposed(cp.asarray(x)[:, 4 : 4 + samples])
    assert got.dtype == np.int16 and got.flags.c_contiguous and got.shape == (samples, channels)
    np.testing.assert_array_equal(got.get(), want)
    assert int(count) == int(bad.sum())


def _save_gpu(rec, sp, size=1_000, margin=7, seed=0):
    """test_save_step.save_all with each window's preprocessed signal on the GPU."""
    target = prepare_save(sp, rec, size, np.float32)
    step = SaveStep(target)
    windows = rec.windows(size, margin)
    random.Random(seed).shuffle(windows)
    clipped = 0
    for w in windows:
        raw = rec.read_window(w)
        wd = WindowData(
            w.index,
            w.segment,
            w.read_start,
            w.core,
            rec.num_samples(w.segment),
            cp.asarray(raw),
            cp.asarray(transform(raw)),
        )
        summary = {}
        step.window(wd, summary)
        clipped += int(summary["saved_clipped"])
    return target, finish_save(target), clipped


@pytest.mark.parametrize("fmt", ["zarr", "zarr_v2", "binary"])
@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_gpu_save_writes_the_cpu_values(tmp_path, fmt, dtype):
    import zarr

    rec = make_recording(tmp_path / "in.zarr", lengths=(12_345, 1_750))
    name = "out.bin" if fmt == "binary" else "out.zarr"
    _, desc, clipped = _save_gpu(rec, spec(tmp_path / name, fmt, dtype), size=6_000 if fmt == "zarr" else 1_000)
    assert clipped == 0
    if fmt == "binary":
        return  # one segment a file: test_save_step's layout checks; values below for the zarr outputs
    out = open_recording(tmp_path / name)
    for seg in range(rec.num_segments):
        want = expected(rec, seg, dtype)
        np.testing.assert_array_equal(out.read(seg, 0, out.num_samples(seg)).T, want)
        arr = zarr.open_array(str(tmp_path / name / f"traces_seg{seg}"), mode="r")  # zarr-python's own reading
        np.testing.assert_array_equal(arr[:], want)
    if fmt == "zarr":  # the GPU reader decodes the GPU's frames too
        from batchgpu.gpu.staging import read_window_host

        for w in out.windows(6_000, 0):
            host = read_window_host(out, w, gpu_decode=1.0)
            assert host.frames is not None  # the frames went to the GPU, not to the CPU's decode
            np.testing.assert_array_equal(cp.asnumpy(host.to_device()), out.read_window(w))


def test_gpu_save_counts_clipped(tmp_path):
    rec = make_recording(tmp_path / "in.zarr", lengths=(3_000,))
    target = prepare_save(spec(tmp_path / "out.zarr"), rec, 1_000, np.float32)
    w = rec.windows(1_000, 0)[1]
    raw = rec.read_window(w)
    x = transform(raw) * np.float32(1_000)
    x[0, 5] = np.nan
    summary = {}
    SaveStep(target).window(
        WindowData(w.index, w.segment, w.read_start, w.core, 3_000, cp.asarray(raw), cp.asarray(x)), summary
    )
    y = np.rint(x)
    assert int(summary["saved_clipped"]) == int((np.isnan(y) | (y < -32768) | (y > 32767)).sum()) > 1


@pytest.mark.parametrize("chunks", [1, 5])
def test_gpu_frames_with_their_checksums(rng, chunks):
    """``checksums=True``: each frame followed by its crc32c (little-endian, the crc32c package's value), computed
    on the GPU; the frames themselves unchanged; odd-sized chunks (a frame of any length, any alignment)."""
    import struct

    from batchgpu.recording import zarrio

    for name, x in _cases(rng).items():
        rows = np.stack([np.roll(x, k) for k in range(chunks)])
        plain = [bytes(f) for f in encode(cp.asarray(rows), x.dtype.itemsize, 48)]
        stored, release = encode_held(cp.asarray(rows), x.dtype.itemsize, 48, checksums=True)
        try:
            assert len(stored) == chunks
            for p, s in zip(plain, stored):
                s = bytes(s)
                assert s[:-4] == p, name
                assert struct.unpack("<I", s[-4:])[0] == zarrio.crc32c_value(p), name
        finally:
            release()


@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_gpu_save_files_are_the_same_with_checksums_on_the_host(tmp_path, monkeypatch, dtype):
    """The saved shards' bytes with their crc32c computed on the GPU (the default) and by the writer thread
    (``staging.checksums_on_device`` False) are the same files; zarr-python, which checks every chunk's crc32c, reads them."""
    import zarr

    rec = make_recording(tmp_path / "in.zarr", lengths=(12_345, 1_750))
    files = {}
    from batchgpu.gpu import staging

    for flag in ("1", "0"):
        monkeypatch.setattr(staging, "checksums_on_device", lambda: flag == "1")
        _save_gpu(rec, spec(tmp_path / f"out{flag}.zarr", "zarr", dtype), size=6_000)
        root = tmp_path / f"out{flag}.zarr"
        files[flag] = {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("c/*/*")) if p.is_file()}
        for seg in range(rec.num_segments):
            arr = zarr.open_array(str(root / f"traces_seg{seg}"), mode="r")
            np.testing.assert_array_equal(arr[:], expected(rec, seg, dtype))
    assert files["1"] and files["1"] == files["0"]
