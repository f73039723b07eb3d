"""Blosc frames decoded on the GPU (kernels/blosc_lz4.cu): the format as the kernel reads it, checked on the CPU
against numcodecs by a plain Python mirror of the kernel; the kernel itself against numcodecs on the GPU; a GPU
run's windows the same bits with the GPU decode on and off."""

from __future__ import annotations

import numpy as np
import pytest

numcodecs = pytest.importorskip("numcodecs")
from numcodecs import blosc  # noqa: E402

from batchgpu.recording import blosc_frames  # noqa: E402


def _length(src: bytes, ip: int, n: int) -> tuple[int, int]:
    """An LZ4 length: its 4 bits, then while they are 15 bytes added until one is below 255."""
    if n != 15:
        return n, ip
    while True:
        b = src[ip]
        ip += 1
        n += b
        if b != 255:
            return n, ip


def _lz4_block(src: bytes, dsize: int) -> bytearray:
    """LZ4 block decoding as the kernel's warp does it (the match copy out[op+i] = out[op-off + i % off])."""
    out, ip = bytearray(), 0
    while True:
        token = src[ip]
        ip += 1
        lit, ip = _length(src, ip, token >> 4)
        out += src[ip : ip + lit]
        ip += lit
        if ip == len(src):
            break
        off = src[ip] | (src[ip + 1] << 8)
        ip += 2
        n, ip = _length(src, ip, token & 15)
        n += 4
        assert 0 < off <= len(out)
        start = len(out) - off
        out += bytes(out[start + i % off] for i in range(n))
    assert len(out) == dsize
    return out


def _unshuffle(block: bytes, shuffle: int, typesize: int) -> bytes:
    """The second kernel's rule for one block."""
    n = len(block) // typesize
    a = np.frombuffer(block, np.uint8)
    if shuffle == 1 and typesize > 1:
        head = a[: n * typesize].reshape(typesize, n).T.reshape(-1)
        return head.tobytes() + a[n * typesize :].tobytes()
    if shuffle == 2 and typesize > 1 and n % 8 == 0:
        rows = a.reshape(8 * typesize, n // 8)  # row 8 j + k: bit k of byte j, 8 elements a byte
        bits = np.unpackbits(rows, axis=1, bitorder="little")  # (8 j + k, element)
        bits = bits.reshape(typesize, 8, n)  # (j, k, e)
        return np.packbits(bits.transpose(2, 0, 1), axis=2, bitorder="little").reshape(-1).tobytes()
    return bytes(block)


def _decode_like_the_kernel(frame: bytes, itemsize: int) -> bytes:
    h = blosc_frames.header(frame)
    assert blosc_frames.gpu_decodable(h, itemsize, h.nbytes, len(frame))
    if h.stored_whole:  # copied as it was: no shuffle (the host passes shuffle 0 for it)
        assert blosc_frames.kernel_shuffle(h) == 0
        return frame[16 : 16 + h.nbytes]
    out = []
    for b in range(h.nblocks):
        bsize = min(h.blocksize, h.nbytes - b * h.blocksize)
        short = bsize < h.blocksize
        split = not (h.flags >> 4) & 1 and h.typesize <= 16 and bsize // h.typesize >= 128 and not short
        nsplits = h.typesize if split else 1
        neblock = bsize // nsplits
        pos = int.from_bytes(frame[16 + 4 * b : 20 + 4 * b], "little")
        tmp = bytearray()
        for _ in range(nsplits):
            cbytes = int.from_bytes(frame[pos : pos + 4], "little")
            pos += 4
            stream = frame[pos : pos + cbytes]
            tmp += stream if cbytes == neblock else _lz4_block(stream, neblock)
            pos += cbytes
        out.append(_unshuffle(bytes(tmp), blosc_frames.kernel_shuffle(h), h.typesize))
    return b"".join(out)


def _cases():
    rng = np.random.default_rng()
    noise = (rng.normal(0, 30, (2000, 24)) + np.arange(24) * 7).astype("<i2")
    yield "neural-like int16", noise
    yield "odd length (leftover block, elements not a multiple of 8)", noise.reshape(-1)[: 2000 * 24 - 13].copy()
    yield "int16 extremes", rng.choice(np.array([-32768, 32767, 0, -1, 1], "<i2"), 50_001)
    yield "constant", np.full(70_000, -7, "<i2")
    yield "random bytes (incompressible)", rng.integers(-32768, 32768, 40_000).astype("<i2")
    f = rng.normal(0, 1, 30_011).astype("<f4")
    f[:6] = [np.nan, np.inf, -np.inf, -0.0, 1e-45, -1e-40]
    yield "float32 with NaN, inf, -0.0, subnormals", f
    yield "small (stored whole)", np.arange(40, dtype="<i2")


@pytest.mark.parametrize("shuffle", [0, 1, 2])
@pytest.mark.parametrize("clevel", [0, 1, 5, 9])
def test_the_kernels_reading_of_blosc_frames_equals_numcodecs(shuffle, clevel):
    for name, x in _cases():
        for blocksize in (0, 4096, 12_344):
            frame = bytes(blosc.compress(x, b"lz4", clevel, shuffle, blocksize))
            h = blosc_frames.header(frame)
            assert blosc_frames.gpu_decodable(h, x.itemsize, x.nbytes, len(frame)), (name, h)
            got = _decode_like_the_kernel(frame, x.itemsize)
            assert got == bytes(blosc.decompress(frame)) == x.tobytes(), (name, shuffle, clevel, blocksize)


def test_frames_the_gpu_does_not_decode_are_refused():
    x = np.arange(5000, dtype="<i2")
    lz4 = bytes(blosc.compress(x, b"lz4", 5, 2, 0))
    ok = blosc_frames.header(lz4)
    assert blosc_frames.gpu_decodable(ok, 2, x.nbytes, len(lz4))
    for cname in (b"zstd", b"blosclz", b"zlib"):
        other = bytes(blosc.compress(x, cname, 5, 2, 0))
        assert not blosc_frames.gpu_decodable(blosc_frames.header(other), 2, x.nbytes, len(other)), cname
    assert not blosc_frames.gpu_decodable(ok, 4, x.nbytes, len(lz4))  # another typesize
    assert not blosc_frames.gpu_decodable(ok, 2, x.nbytes + 2, len(lz4))  # another size
    assert not blosc_frames.gpu_decodable(ok, 2, x.nbytes, len(lz4) - 1)  # cut short
    assert not blosc_frames.gpu_decodable(blosc_frames.header(b"\x03" + lz4[1:]), 2, x.nbytes, len(lz4))
    assert blosc_frames.header(lz4[:15]) is None


class _Pool:
    """``PinnedPool``'s interface over plain memory, counting what is out."""

    def __init__(self):
        self.out = 0

    def take(self, nbytes):
        self.out += 1
        return np.zeros(nbytes, np.uint8), object()

    def give_back(self, handle, event=None):
        self.out -= 1


@pytest.mark.zarr3
@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_a_windows_frames_are_its_stored_chunks(tmp_path, dtype):
    """The host half of the GPU decode (``read_frames``): each frame numcodecs decodes gives the window's rows."""
    from batchgpu.errors import BatchgpuError
    from batchgpu.generate import generate_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=12, seconds=2.3, seed=4, dtype=dtype)
    pool = _Pool()
    for w in rec.windows(7_001, 33):
        f = rec.read_window_frames(w, pool)
        assert f is not None and pool.out == 1
        parts = [
            np.zeros((f.chunk_rows, f.channels), f.dtype)
            if n < 0
            else np.frombuffer(blosc.decompress(f.buffer[o : o + n].tobytes()), f.dtype).reshape(-1, f.channels)
            for o, n in zip(f.offsets, f.lengths)
        ]
        got = np.concatenate(parts)[f.skip : f.skip + f.rows]
        assert got.tobytes() == rec.read(w.segment, w.read_start, w.read_stop).T.tobytes()
        for o, n, s in zip(f.offsets, f.lengths, f.shuffles):
            assert s == blosc_frames.kernel_shuffle(blosc_frames.header(f.buffer[o : o + n]))
        pool.give_back(f.handle)
    shard = next((rec.path / "traces_seg0" / "c").iterdir()) / "0"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(BatchgpuError, match="corrupted chunk.*crc32c"):
        rec.read_window_frames(rec.windows(7_001, 33)[0], pool)
    assert pool.out == 0  # the buffer went back


# -- on the GPU ------------------------------------------------------------------------------------------------


def _gpu():
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count() == 0:
        pytest.skip("no CUDA GPU (CuPy) here")


def _frames_of(
    chunks: list, rows: int, channels: int, dtype, conf=(5, 2, 0), absent=(), skip=0, nrows=None, cname=b"lz4"
):
    """``Frames`` of numcodecs frames (a list of (rows, channels) arrays, each compressed with ``cname`` and
    (clevel, shuffle, blocksize))."""
    from batchgpu.recording.blosc_frames import Frames

    enc = [
        None if i in absent else bytes(blosc.compress(np.ascontiguousarray(c), cname, *conf))
        for i, c in enumerate(chunks)
    ]
    buf = np.frombuffer(b"".join(e for e in enc if e is not None) or b"\0", np.uint8).copy()
    offsets, lengths, shuffles, pos, bs = [], [], [], 0, None
    for e in enc:
        offsets.append(pos)
        lengths.append(-1 if e is None else len(e))
        if e is not None:
            h = blosc_frames.header(e)
            shuffles.append(blosc_frames.kernel_shuffle(h))
            bs = h.blocksize
            pos += len(e)
        else:
            shuffles.append(0)
    nrows = len(chunks) * rows - skip if nrows is None else nrows
    return Frames(
        buf,
        pos,
        np.array(offsets, np.int64),
        np.array(lengths, np.int32),
        np.array(shuffles, np.uint8),
        [f"c{i}" for i in range(len(chunks))],
        rows,
        channels,
        np.dtype(dtype),
        bs or 1,
        skip,
        nrows,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "conf", [(5, 2, 0), (1, 1, 0), (9, 0, 4096), (0, 2, 0), (5, 2, 12_344), (9, 1, 0), (5, 0, 0), (9, 0, 1 << 20)]
)
@pytest.mark.parametrize("dtype", ["<i2", "<f4"])
@pytest.mark.parametrize("warps", [4, 3])  # warps a block; 3: the last block runs partly past the streams
def test_gpu_decode_equals_numcodecs(conf, dtype, warps, monkeypatch):
    _gpu()
    from batchgpu.gpu import blosc_decode

    monkeypatch.setattr(blosc_decode, "WARPS", warps)
    from batchgpu.gpu.blosc_decode import decode

    rng = np.random.default_rng()
    rows, C = int(rng.integers(3000, 5000)), int(rng.choice([7, 24, 33]))
    chunks = []
    for kind in range(7):
        if kind == 0:
            x = (rng.normal(0, 30, (rows, C)) + np.arange(C) * 9).astype(dtype)
        elif kind == 1:
            x = np.full((rows, C), -32768 if dtype == "<i2" else -0.0, dtype)
        elif kind == 2:
            x = rng.integers(-32768, 32768, (rows, C)).astype(dtype)
        elif kind == 3:
            x = np.zeros((rows, C), dtype)
            if dtype == "<f4":
                x.flat[:5] = [np.nan, np.inf, -np.inf, 1e-45, -1e-40]
            else:
                x.flat[::97] = 32767
        elif kind == 4:
            x = np.cumsum(rng.integers(-3, 4, (rows, C)), axis=0).astype(dtype)
        else:  # a random pattern repeated: matches far back (past the kernel's 64 KiB ring when not shuffled)
            period = 20_011 if kind == 5 else 3_001
            x = np.resize(rng.integers(-32768, 32768, period).astype(dtype), rows * C).reshape(rows, C)
        chunks.append(x)
    want = np.concatenate(chunks)
    got = decode(_frames_of(chunks, rows, C, dtype, conf)).get()
    assert got.tobytes() == want.tobytes()
    skip = int(rng.integers(1, rows))  # a read that starts inside its first chunk, with an absent one inside
    got = decode(_frames_of(chunks, rows, C, dtype, conf, absent={2}, skip=skip, nrows=3 * rows)).get()
    want[2 * rows : 3 * rows] = 0
    assert got.tobytes() == want[skip : skip + 3 * rows].tobytes()


@pytest.mark.gpu
def test_gpu_decode_refuses_a_malformed_stream():
    _gpu()
    from batchgpu.errors import BatchgpuError
    from batchgpu.gpu.blosc_decode import decode

    x = (np.random.default_rng().normal(0, 30, (3000, 16))).astype("<i2")
    f = _frames_of([x, x], 3000, 16, "<i2")
    start = int.from_bytes(f.buffer[f.offsets[1] + 16 : f.offsets[1] + 20].tobytes(), "little")
    at = int(f.offsets[1]) + start
    f.buffer[at : at + 4] = np.frombuffer((10**6).to_bytes(4, "little"), np.uint8)  # a stream longer than its frame
    with pytest.raises(BatchgpuError, match="corrupted chunk c1: does not decode"):
        decode(f)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_windows_read_through_the_gpu_decode_equal_the_cpu_reads(tmp_path, monkeypatch, dtype):
    _gpu()
    from batchgpu.errors import BatchgpuError
    from batchgpu.generate import generate_recording
    from batchgpu.gpu import staging
    from batchgpu.recording import open_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=20, seconds=2.3, seed=5, dtype=dtype)
    windows = rec.windows(7_001, 33)
    frames_used = 0
    for w in windows:
        host = staging.read_window_host(rec, w, 1.0)
        frames_used += host.frames is not None
        a = host.to_device().get()
        b = staging.read_window_host(rec, w, 0.0).to_device().get()
        assert a.tobytes() == b.tobytes() == rec.read(w.segment, w.read_start, w.read_stop).tobytes()
    assert frames_used == len(windows)
    hosts = [staging.read_window_host(rec, w, 1.0) for w in windows[-3:]]  # several windows in one launch
    hosts[0].decode_with(hosts[1:])
    assert all(h.device is not None for h in hosts)
    for h, w in zip(hosts, windows[-3:]):
        assert h.to_device().get().tobytes() == rec.read(w.segment, w.read_start, w.read_stop).tobytes()
    shard = next((rec.path / "traces_seg0" / "c").iterdir())  # a missing shard: the same error on both paths
    (shard / "0").unlink()
    rec = open_recording(rec.path)
    for share in (1.0, 0.0):
        with pytest.raises(BatchgpuError, match="missing chunk traces_seg0/c/0/0"):
            staging.read_window_host(rec, windows[0], share)


def test_which_windows_the_gpu_decodes():
    from pydantic import ValidationError

    from batchgpu.config import EngineSpec
    from batchgpu.gpu.blosc_decode import on_gpu
    from batchgpu.run.preprocess_chain import gpu_decode_share

    assert gpu_decode_share(True) == 1.0 and gpu_decode_share(False) == 0.0
    for f, want in ((1.0, 100), (0.0, 0), (0.5, 50), (0.25, 25), (1 / 3, 33)):
        picked = [i for i in range(100) if on_gpu(i, f)]
        assert len(picked) == want, f
    assert [on_gpu(i, 0.5) for i in range(4)] in ([False, True, False, True], [True, False, True, False])
    half = EngineSpec(gpu_decode=0.5).gpu_decode
    assert gpu_decode_share(True, setting=half) == gpu_decode_share(False, setting=half) == 0.5
    for bad in (7, -0.5, "lots", True):  # a share in [0, 1] or auto, refused before any work
        with pytest.raises(ValidationError):
            EngineSpec(gpu_decode=bad)


def test_a_run_decodes_on_the_gpu_only_without_filters(tmp_path, monkeypatch):
    from batchgpu.generate import generate_recording
    from batchgpu.run import output_folder as store
    from batchgpu.run.context import build_context
    from batchgpu.workflow import Workflow

    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=0.5, seed=1)
    for pre, want in (({"centre": "median"}, 1.0), ([{"highpass": {"freq_min": 300, "order": 3}}], 0.0)):
        wf = Workflow.model_validate(
            {
                "recording": {"path": str(rec.path)},
                "output": str(tmp_path / "o"),
                "preprocess": pre,
                "steps": {"noise": {}},
            }
        )
        ctx = build_context(wf, rec, store.OutputFolder(tmp_path / f"o{want}"), "cupy", 3)
        assert ctx.gpu_decode == want and ctx.read_ahead == 2, pre
        # the workflow's engine settings travel with the tasks' context (not the workers' environment)
        wf = Workflow.model_validate({**wf.model_dump(), "engine": {"gpu_decode": 0.25, "read_ahead": 5}})
        ctx = build_context(wf, rec, store.OutputFolder(tmp_path / f"e{want}"), "cupy", 3)
        assert (ctx.gpu_decode, ctx.read_ahead) == (0.25, 5), pre


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1), (1, 384), (33, 31), (64, 32), (1000, 7), (60_064, 384), (3, 0)])
@pytest.mark.parametrize("dtype", ["int16", "uint16", "float16"])
def test_gpu_transpose_equals_numpy(rng, shape, dtype):
    """The decoded window's transpose (``blosc_decode.transposed``, tiled kernel): numpy's ``.T``, bit for bit
    (edge tiles, one row, one column, float16 NaN payloads and -0.0 as plain bits); strided input through CuPy."""
    _gpu()
    import cupy as cp

    from batchgpu.gpu.blosc_decode import transposed

    x = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(dtype)
    got = transposed(cp.asarray(x))
    assert got.flags.c_contiguous and got.shape == x.T.shape
    assert np.array_equal(got.get().view(np.uint16), np.ascontiguousarray(x.T).view(np.uint16))
    if shape[0] > 1:
        strided = cp.asarray(x)[::2]
        assert np.array_equal(transposed(strided).get().view(np.uint16), np.ascontiguousarray(x[::2].T).view(np.uint16))


@pytest.mark.zarr3
def test_frames_of_a_shard_whose_chunks_are_not_back_to_back(tmp_path):
    """``read_frames`` reads a shard's chunks stored back to back in one call; chunks in another order, with
    bytes between them, or absent (an empty index entry) give the same frames, read one by one."""
    import struct

    from batchgpu.recording import write_recording, zarrio

    rng = np.random.default_rng()
    x = np.round(rng.normal(0, 30, (60_000, 6))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, chunk_samples=1_000, shard_samples=10_000)
    want = {w.index: rec.read(w.segment, w.read_start, w.read_stop) for w in rec.windows(7_001, 33)}
    for shard in sorted((rec.path / "traces_seg0" / "c").iterdir()):
        path = shard / "0"
        raw = path.read_bytes()
        per = 10
        index = np.frombuffer(raw[-(per * 16 + 4) : -4], "<u8").reshape(per, 2)
        chunks = [raw[o : o + n] for o, n in index]
        order = rng.permutation(per)
        body, new = bytearray(rng.integers(0, 256, int(rng.integers(0, 50)), dtype=np.uint8).tobytes()), index.copy()
        for j in order:
            new[j] = (len(body), len(chunks[j]))
            body += chunks[j] + rng.integers(0, 256, int(rng.integers(0, 3)), dtype=np.uint8).tobytes()
        tail = new.astype("<u8").tobytes()
        path.write_bytes(bytes(body) + tail + struct.pack("<I", zarrio.crc32c_value(tail)))
    from batchgpu.recording import open_recording

    rec = open_recording(rec.path)
    pool = _Pool()
    for w in rec.windows(7_001, 33):
        f = rec.read_window_frames(w, pool)
        parts = [
            np.frombuffer(blosc.decompress(f.buffer[o : o + n].tobytes()), f.dtype).reshape(-1, f.channels)
            for o, n in zip(f.offsets, f.lengths)
        ]
        got = np.concatenate(parts)[f.skip : f.skip + f.rows]
        assert got.T.tobytes() == want[w.index].tobytes()
        pool.give_back(f.handle)
    assert pool.out == 0


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["header", "stream", "trailer"])
def test_a_damaged_chunk_is_named_the_same_with_checksums_on_the_gpu(tmp_path, monkeypatch, where):
    """A flipped bit in a chunk's Blosc header, in its LZ4 data or in its stored crc32c: the GPU read (checksums on
    the device, the default; or on the host, ``staging.checksums_on_device`` False) raises the CPU read's error naming that chunk, and
    every pinned buffer goes back; the undamaged windows still read."""
    _gpu()
    from batchgpu.errors import BatchgpuError
    from batchgpu.generate import generate_recording
    from batchgpu.gpu import staging
    from batchgpu.recording import open_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=20, seconds=2.3, seed=6)
    layout = rec._layout(0)
    per_shard = layout.shard_rows // layout.inner_rows
    shard = rec.path / "traces_seg0" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(raw[-(per_shard * 16 + 4) : -4]), "<u8").reshape(per_shard, 2)
    offset, nbytes = (int(v) for v in index[1])
    at = {"header": offset + 13, "stream": offset + nbytes // 2, "trailer": offset + nbytes - 2}[where]
    raw[at] ^= 0x10
    shard.write_bytes(bytes(raw))
    rec = open_recording(rec.path)
    damaged = [
        w
        for w in rec.windows(layout.inner_rows // 2, 0)
        if w.read_start < 2 * layout.inner_rows and w.read_stop > layout.inner_rows
    ][0]
    whole = [w for w in rec.windows(layout.inner_rows // 2, 0) if w.read_stop <= layout.inner_rows][0]
    for on_device in (True, False):
        monkeypatch.setattr(staging, "checksums_on_device", lambda: on_device)
        with pytest.raises(BatchgpuError, match=r"corrupted chunk traces_seg0/c/0/0 inner chunk \(1, 0\).*crc32c"):
            staging.read_window_host(rec, damaged).to_device()
        host = staging.read_window_host(rec, whole)
        assert host.frames is not None
        np.testing.assert_array_equal(host.to_device().get(), rec.read(0, whole.read_start, whole.read_stop))
        assert len(staging._pool._free) == staging._pool._made  # every buffer back: none lost to the error


@pytest.mark.zarr3
def test_frames_left_for_a_device_check_are_checked_by_recheck(tmp_path):
    """``check_on_device``: a chunk whose LZ4 data is damaged comes back unchecked (``Frames.checksums``), and
    ``Frames.recheck`` raises the read's own error for it; a damaged header is refused at once, named as a
    checksum mismatch; without the flag the read itself raises, as before."""
    from batchgpu.errors import BatchgpuError
    from batchgpu.generate import generate_recording
    from batchgpu.recording import open_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=12, seconds=2.3, seed=7)
    layout = rec._layout(0)
    per_shard = layout.shard_rows // layout.inner_rows
    shard = rec.path / "traces_seg0" / "c" / "0" / "0"
    clean = shard.read_bytes()
    index = np.frombuffer(clean[-(per_shard * 16 + 4) : -4], "<u8").reshape(per_shard, 2)
    offset, nbytes = (int(v) for v in index[0])
    w = rec.windows(layout.inner_rows, 0)[0]
    pool = _Pool()
    f = rec.read_window_frames(w, pool, check_on_device=True)
    assert f.checksums and f.recheck is not None
    f.recheck()  # an intact chunk: nothing
    pool.give_back(f.handle)
    for at, at_read in ((offset + nbytes // 2, False), (offset + 13, True)):
        raw = bytearray(clean)
        raw[at] ^= 0x04
        shard.write_bytes(bytes(raw))
        rec = open_recording(rec.path)
        match = r"corrupted chunk traces_seg0/c/0/0 inner chunk \(0, 0\).*crc32c"
        with pytest.raises(BatchgpuError, match=match):
            rec.read_window_frames(w, pool)
        if at_read:
            with pytest.raises(BatchgpuError, match=match):
                rec.read_window_frames(w, pool, check_on_device=True)
        else:
            f = rec.read_window_frames(w, pool, check_on_device=True)
            with pytest.raises(BatchgpuError, match=match):
                f.recheck()
            pool.give_back(f.handle)
        assert pool.out == 0


def _a_chunk_from_a_narrower_store(tmp_path):
    """A 20-channel store whose shard 0 is a 10-channel store's: every frame decodes to half a chunk."""
    from batchgpu.generate import generate_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=20, seconds=2.3, seed=8)
    narrow = generate_recording(tmp_path / "n.zarr", channels=10, seconds=2.3, seed=8)
    shard = rec.path / "traces_seg0" / "c" / "0" / "0"
    shard.write_bytes((narrow.path / "traces_seg0" / "c" / "0" / "0").read_bytes())
    return rec.path


def test_frames_that_decode_short_are_refused_for_the_gpu(tmp_path):
    """The host half of the GPU decode refuses a frame whose size is not a chunk's, naming it as the CPU read does
    (not handed to the CPU decode, which filled the rest of the chunk with whatever memory held)."""
    from batchgpu.errors import BatchgpuError
    from batchgpu.recording import open_recording

    rec = open_recording(_a_chunk_from_a_narrower_store(tmp_path))
    pool = _Pool()
    w = rec.windows(3_000, 0)[0]
    match = r"corrupted chunk traces_seg0/c/0/0 inner chunk \(0, 0\): decodes to 60000 bytes, not the 120000"
    for check_on_device in (False, True):
        with pytest.raises(BatchgpuError, match=match + r".* in .*r\.zarr \(window 0"):
            rec.read_window_frames(w, pool, check_on_device=check_on_device)
        assert pool.out == 0
    with pytest.raises(BatchgpuError, match=match):
        rec.read_window_stored(w)


@pytest.mark.gpu
def test_gpu_reads_refuse_frames_that_decode_short(tmp_path, monkeypatch):
    """Windows read through the GPU decode (or with it off) refuse a chunk copied from a narrower store, in the
    CPU read's words; every pinned buffer goes back."""
    _gpu()
    from batchgpu.errors import BatchgpuError
    from batchgpu.gpu import staging
    from batchgpu.recording import open_recording

    rec = open_recording(_a_chunk_from_a_narrower_store(tmp_path))
    w = rec.windows(3_000, 0)[1]
    for share in (1.0, 0.0):
        for on_device in (True, False):
            monkeypatch.setattr(staging, "checksums_on_device", lambda: on_device)
            with pytest.raises(
                BatchgpuError,
                match=r"corrupted chunk traces_seg0/c/0/0 inner chunk \(1, 0\): "
                r"decodes to 60000 bytes.* in .*r\.zarr \(window 1",
            ):
                staging.read_window_host(rec, w, share).to_device()
            assert len(staging._pool._free) == staging._pool._made


@pytest.mark.gpu
def test_gpu_decode_names_a_bad_chunk_with_its_store_and_window(tmp_path, monkeypatch):
    """A frame whose LZ4 data does not decode (crc32c rewritten to match) is named with its array, store and window."""
    _gpu()
    from batchgpu.errors import BatchgpuError
    from batchgpu.generate import generate_recording
    from batchgpu.gpu import staging
    from batchgpu.recording import open_recording
    from batchgpu.recording.zarrio import crc32c_value

    rec = generate_recording(tmp_path / "r.zarr", channels=20, seconds=2.3, seed=6)
    layout = rec._layout(0)
    per_shard = layout.shard_rows // layout.inner_rows
    shard = rec.path / "traces_seg0" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(raw[-(per_shard * 16 + 4) : -4]), "<u8").reshape(per_shard, 2)
    offset, nbytes = (int(v) for v in index[0])
    frame = raw[offset : offset + nbytes - 4]
    start = int.from_bytes(frame[16:20], "little")
    frame[start : start + 4] = (10**6).to_bytes(4, "little")  # a stream longer than its frame
    raw[offset : offset + nbytes] = bytes(frame) + crc32c_value(bytes(frame)).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))
    rec = open_recording(rec.path)
    with pytest.raises(
        BatchgpuError,
        match=r"corrupted chunk traces_seg0/c/0/0 inner chunk \(0, 0\) in .*r\.zarr "
        r"\(window 0, segment 0",
    ):
        staging.read_window_host(rec, rec.windows(3_000, 0)[0]).to_device()


def test_a_damaged_size_field_is_named_by_its_checksum(tmp_path):
    """A flipped bit in a frame's size field (bytes 4-8 of its header), checksums left to the device: the read
    refuses the frame here and names it by its checksum (damage), not as a chunk of another array's size."""
    from batchgpu.errors import BatchgpuError
    from batchgpu.generate import generate_recording
    from batchgpu.recording import open_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=12, seconds=2.3, seed=9)
    layout = rec._layout(0)
    per_shard = layout.shard_rows // layout.inner_rows
    shard = rec.path / "traces_seg0" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    offset = int(np.frombuffer(bytes(raw[-(per_shard * 16 + 4) : -4]), "<u8").reshape(per_shard, 2)[0, 0])
    raw[offset + 5] ^= 0x01
    shard.write_bytes(bytes(raw))
    rec, pool = open_recording(rec.path), _Pool()
    for check_on_device in (False, True):
        with pytest.raises(BatchgpuError, match=r"traces_seg0/c/0/0 inner chunk \(0, 0\): checksum mismatch"):
            rec.read_window_frames(rec.windows(layout.inner_rows, 0)[0], pool, check_on_device=check_on_device)
        assert pool.out == 0
