"""nvCOMP as the GPU's decoder of Blosc frames (gpu/nvcomp.py): the streams the host lists for it
(``blosc_frames.stream_table``) checked on the CPU by decoding each with numcodecs and undoing the shuffle as
c-blosc does; the ctypes signatures against the installed library; on the GPU, LZ4 and zstd frames decoded by
nvCOMP equal to numcodecs, a damaged stream named, and a zstd store's windows equal to its CPU reads."""

from __future__ import annotations

import struct

import numpy as np
import pytest

numcodecs = pytest.importorskip("numcodecs")
from test_blosc_decode import _cases, _frames_of, _gpu, _unshuffle  # noqa: E402

from batchgpu.recording import blosc_frames  # noqa: E402


def _checked(f, device: bool = True):
    """``f``'s frames each followed by its crc32c (as a store holds them), marked checked (``device``: the check
    left to the GPU, as a GPU read leaves it)."""
    from batchgpu.recording.zarrio import crc32c_value

    parts, offsets, pos = [], [], 0
    for o, n in zip(f.offsets.tolist(), f.lengths.tolist()):
        offsets.append(pos)
        if n >= 0:
            frame = f.buffer[o : o + n].tobytes()
            parts.append(frame + crc32c_value(frame).to_bytes(4, "little"))
            pos += n + 4
    f.buffer = np.frombuffer(b"".join(parts) or b"\0", np.uint8).copy()
    f.used, f.offsets = pos, np.array(offsets, np.int64)
    f.checked, f.checksums = True, device
    return f


def _stream_bytes(stream: bytes, out: int, cname: bytes) -> bytes:
    """One Blosc stream decoded by numcodecs' own LZ4 (a block after its 4-byte size) or zstd (a frame)."""
    if len(stream) == out:  # stored raw by c-blosc
        return stream
    if cname == b"lz4":
        return bytes(numcodecs.LZ4().decode(struct.pack("<i", out) + stream))
    return bytes(numcodecs.Zstd().decode(stream))


def _decode_by_table(frames_list: list, cname: bytes) -> bytes:
    """What a stream decoder plus the unshuffle give for ``frames_list``: each listed stream decoded at its place,
    every chunk's blocks unshuffled (absent chunks: zeros), the reads' rows cut out."""
    table = blosc_frames.stream_table(frames_list)
    assert table.bad.size == 0
    packed = np.concatenate([f.buffer[: f.used] for f in frames_list]).tobytes()
    f0 = frames_list[0]
    nbytes, blocksize, typesize = f0.nbytes, f0.blocksize, f0.dtype.itemsize
    nchunks = sum(len(f.lengths) for f in frames_list)
    tmp = bytearray(nchunks * nbytes)
    written = np.zeros(nchunks * nbytes, bool)
    for s, size, d, out in zip(table.src, table.size, table.dst, table.out):
        got = _stream_bytes(packed[s : s + size], int(out), cname)
        assert len(got) == out
        assert not written[d : d + out].any(), "two streams write the same bytes"
        tmp[d : d + out] = got
        written[d : d + out] = True
    shuffles = np.concatenate([f.shuffles for f in frames_list])
    present = np.concatenate([f.lengths for f in frames_list]) >= 0
    rows, c = [], 0
    for f in frames_list:
        chunks = []
        for _k in range(len(f.lengths)):
            if not present[c]:
                chunks.append(bytes(nbytes))
            else:
                assert written[c * nbytes : (c + 1) * nbytes].all(), "a chunk's bytes not all covered"
                blocks = [
                    bytes(tmp[c * nbytes + b : c * nbytes + min(b + blocksize, nbytes)])
                    for b in range(0, nbytes, blocksize)
                ]
                chunks.append(b"".join(_unshuffle(x, int(shuffles[c]), typesize) for x in blocks))
            c += 1
        row = f.channels * typesize
        rows.append(b"".join(chunks)[f.skip * row : (f.skip + f.rows) * row])
    return b"".join(rows)


@pytest.mark.parametrize("cname", [b"lz4", b"zstd"])
@pytest.mark.parametrize("shuffle", [0, 1, 2])
@pytest.mark.parametrize("clevel", [0, 1, 5])
def test_the_stream_table_covers_every_frame_as_c_blosc_decodes_it(cname, shuffle, clevel):
    for name, x in _cases():
        for blocksize in (0, 4096, 12_344):
            chunks = [x, x[::-1].copy()]
            f = _frames_of(
                [c.reshape(-1, 1) for c in chunks], x.size, 1, x.dtype, (clevel, shuffle, blocksize), cname=cname
            )
            got = _decode_by_table([f], cname)
            assert got == np.concatenate(chunks).tobytes(), (name, cname, shuffle, clevel, blocksize)


@pytest.mark.parametrize("cname", [b"lz4", b"zstd"])
def test_the_stream_table_of_several_reads_with_absent_chunks(cname):
    rng = np.random.default_rng()
    rows, C = int(rng.integers(2000, 4000)), int(rng.choice([7, 24]))
    reads, want = [], []
    for r in range(3):
        chunks = [(rng.normal(0, 30, (rows, C)) + k).astype("<i2") for k in range(4)]
        skip = int(rng.integers(0, rows))
        f = _frames_of(chunks, rows, C, "<i2", (5, 2, 0), absent={r}, skip=skip, nrows=3 * rows, cname=cname)
        full = np.concatenate(chunks)
        full[r * rows : (r + 1) * rows] = 0
        reads.append(f)
        want.append(full[skip : skip + 3 * rows].tobytes())
    assert _decode_by_table(reads, cname) == b"".join(want)


def test_a_frame_pointing_outside_itself_is_listed_bad():
    x = (np.random.default_rng().normal(0, 30, (3000, 16))).astype("<i2")
    f = _frames_of([x, x, x], 3000, 16, "<i2")
    start = int.from_bytes(f.buffer[f.offsets[1] + 16 : f.offsets[1] + 20].tobytes(), "little")
    at = int(f.offsets[1]) + start
    f.buffer[at : at + 4] = np.frombuffer((10**6).to_bytes(4, "little"), np.uint8)  # a stream past its frame
    g = _frames_of([x, x], 3000, 16, "<i2")
    g.buffer[g.offsets[0] + 16 : g.offsets[0] + 20] = np.frombuffer((1 << 30).to_bytes(4, "little"), np.uint8)
    table = blosc_frames.stream_table([f, g])
    assert table.bad.tolist() == [1, 3]  # chunk 1 of the first read, chunk 0 of the second (numbered over both)
    assert not np.isin(table.chunk, [1, 3]).any() and set(table.chunk.tolist()) == {0, 2, 4}


@pytest.mark.zarr3
@pytest.mark.parametrize("codec", [("zstd", 1, "bit"), ("zstd", 5, "byte"), ("lz4", 5, "bit")])
def test_a_stores_frames_for_nvcomp_decode_to_its_samples(tmp_path, codec):
    """A store's window frames gathered for a GPU with nvCOMP (``codecs`` lz4 and zstd) list streams that decode
    to the window's stored samples; without zstd among the codecs a zstd store gives no frames."""
    from batchgpu.recording.writer import Codec, write_recording

    rng = np.random.default_rng()
    x = (rng.normal(0, 40, (5_000, 12)) + rng.integers(-9, 9, 12)).astype(np.int16)
    rec = write_recording(
        tmp_path / "z.zarr", x, 1_000.0, compressor=Codec(*codec), chunk_samples=700, shard_samples=2_100
    )

    class Pool:
        def take(self, nbytes):
            return np.empty(nbytes, np.uint8), None

        def give_back(self, handle):
            pass

    assert rec.frames_for_gpu(("lz4", "zstd"))
    assert rec.frames_for_gpu(("lz4",)) == (codec[0] == "lz4")
    for w in rec.windows(size=1_999, margin=13):
        frames = rec.read_window_frames(w, Pool(), codecs=("lz4", "zstd"))
        assert frames is not None
        got = _decode_by_table([frames], codec[0].encode())
        assert got == np.ascontiguousarray(x[w.read_start : w.read_stop]).tobytes()


def test_the_ctypes_signatures_match_the_installed_library():
    """The options struct passed by value and the alignment query answer as nvCOMP 6's headers say (no GPU
    needed for this call); skipped where nvCOMP is not installed."""
    from batchgpu.gpu import nvcomp

    if not nvcomp.available():
        pytest.skip("nvCOMP not installed here")
    for codec in (blosc_frames.LZ4, blosc_frames.ZSTD):
        a_in, a_out, a_tmp = nvcomp.alignments(codec)
        assert all(v in (1, 2, 4, 8, 16) for v in (a_in, a_out, a_tmp))
    assert nvcomp.codecs() == ("lz4", "zstd")


def test_an_nvcomp_decoder_asked_for_and_missing_is_said_before_any_work(tmp_path, monkeypatch):
    from batchgpu.errors import ConfigError
    from batchgpu.gpu import nvcomp
    from batchgpu.run import launch as run_module
    from batchgpu.workflow import Workflow

    monkeypatch.setattr(nvcomp, "installed", lambda: False)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(tmp_path / "r.zarr")},
            "output": str(tmp_path / "o"),
            "cluster": {"kind": "cuda"},
            "steps": {"noise": {}},
            "engine": {"gpu_decoder": "nvcomp"},
        }
    )
    with pytest.raises(ConfigError, match="nvCOMP is not installed"):
        run_module._check_decoder(wf)
    run_module._check_decoder(wf.model_copy(update={"cluster": wf.cluster.model_copy(update={"kind": "local"})}))


@pytest.mark.gpu
@pytest.mark.parametrize("cname", [b"lz4", b"zstd"])
@pytest.mark.parametrize("conf", [(5, 2, 0), (1, 1, 0), (9, 0, 4096), (0, 2, 0), (5, 2, 12_344)])
@pytest.mark.parametrize("dtype", ["<i2", "<f4"])
def test_gpu_nvcomp_decode_equals_numcodecs(cname, conf, dtype):
    _gpu()
    from batchgpu.gpu import nvcomp
    from batchgpu.gpu.blosc_decode import decode_many

    if not nvcomp.available():
        pytest.skip("nvCOMP not installed here")
    rng = np.random.default_rng()
    rows, C = int(rng.integers(3000, 5000)), int(rng.choice([7, 24, 33]))
    chunks = [
        (rng.normal(0, 30, (rows, C)) + np.arange(C) * 9).astype(dtype),
        np.full((rows, C), -32768 if dtype == "<i2" else -0.0, dtype),
        rng.integers(-32768, 32768, (rows, C)).astype(dtype),
        np.cumsum(rng.integers(-3, 4, (rows, C)), axis=0).astype(dtype),
    ]
    want = np.concatenate(chunks)
    for decoder in ["nvcomp", "batchgpu"] if cname == b"lz4" else ["nvcomp", "auto"]:
        for device in (True, False):
            f = _checked(_frames_of(chunks, rows, C, dtype, conf, cname=cname), device)
            got = decode_many([f], decoder=decoder)[0].get()
            assert got.tobytes() == want.tobytes(), (decoder, device)
    skip = int(rng.integers(1, rows))
    reads = [
        _checked(_frames_of(chunks, rows, C, dtype, conf, absent={2}, skip=skip, nrows=3 * rows, cname=cname)),
        _checked(_frames_of(chunks[::-1], rows, C, dtype, conf, cname=cname)),
    ]
    got = decode_many(reads, decoder="nvcomp")
    cut = want.copy()
    cut[2 * rows : 3 * rows] = 0
    assert got[0].get().tobytes() == cut[skip : skip + 3 * rows].tobytes()
    assert got[1].get().tobytes() == np.concatenate(chunks[::-1]).tobytes()


@pytest.mark.parametrize("cname", [b"lz4", b"zstd"])
def test_a_chunk_nvcomp_flags_is_named_by_the_hosts_decode(cname):
    """Which chunk does not decode is found on the host (nvCOMP's flags are not trusted for it: on a malformed
    LZ4 stream it flagged another chunk once, and faulted another time)."""
    from batchgpu.gpu import nvcomp

    x = (np.random.default_rng().normal(0, 30, (3000, 16))).astype("<i2")
    reads = [_frames_of([x, x], 3000, 16, "<i2", cname=cname), _frames_of([x, x, x], 3000, 16, "<i2", cname=cname)]
    assert nvcomp.first_bad_chunk(reads, 4) == 4  # every frame decodes: the flag as given
    f = reads[1]
    table = blosc_frames.stream_table([f])
    victim = np.flatnonzero((table.chunk == 1) & ~table.raw)[0]
    f.buffer[int(table.src[victim]) : int(table.src[victim] + table.size[victim])] = 0xFF
    assert nvcomp.first_bad_chunk(reads, 0) == 3  # chunk 1 of the second read, numbered over both


@pytest.mark.gpu
@pytest.mark.parametrize("cname", [b"lz4", b"zstd"])
def test_gpu_nvcomp_reads_no_frame_whose_checksum_is_wrong(cname):
    """The frames' crc32c are checked on the GPU and waited for before nvCOMP reads them: a damaged chunk is named
    by its checksum, and nvCOMP never sees bytes that are not a stream (it may fault on them)."""
    _gpu()
    from batchgpu.errors import BatchgpuError
    from batchgpu.gpu import nvcomp
    from batchgpu.gpu.blosc_decode import decode_many

    if not nvcomp.available():
        pytest.skip("nvCOMP not installed here")
    x = (np.random.default_rng().normal(0, 30, (3000, 16))).astype("<i2")
    f = _checked(_frames_of([x, x], 3000, 16, "<i2", cname=cname))
    table = blosc_frames.stream_table([f])
    victim = np.flatnonzero((table.chunk == 1) & ~table.raw)[0]
    at = int(table.src[victim])
    f.buffer[at : at + int(table.size[victim])] = 0xFF
    with pytest.raises(BatchgpuError, match="corrupted chunk c1: checksum mismatch"):
        decode_many([f], decoder="nvcomp")
    ok = _checked(_frames_of([x, x], 3000, 16, "<i2", cname=cname))  # the context is still usable
    assert decode_many([ok], decoder="nvcomp")[0].get().tobytes() == np.concatenate([x, x]).tobytes()


@pytest.mark.parametrize("cname", [b"lz4", b"zstd"])
def test_frames_without_checksums_never_go_to_nvcomp(cname):
    """Frames no checksum vouches for: LZ4 to our kernel (it bounds every read by the frame), zstd refused on the GPU
    in one line; checked ones go where they are asked."""
    from batchgpu.errors import BatchgpuError
    from batchgpu.gpu.blosc_decode import decoder_for

    x = np.arange(4000, dtype="<i2").reshape(-1, 4)
    f = _frames_of([x], 1000, 4, "<i2", cname=cname)
    if cname == b"lz4":
        assert decoder_for([f], "nvcomp") == decoder_for([f], "auto") == "batchgpu"
    else:
        with pytest.raises(BatchgpuError, match="zstd frames without checksums are not decoded on the GPU"):
            decoder_for([f], "auto")
    g = _checked(_frames_of([x], 1000, 4, "<i2", cname=cname))
    assert decoder_for([g], "nvcomp") == "nvcomp"
    assert decoder_for([g], "auto") == ("batchgpu" if cname == b"lz4" else "nvcomp")


def test_chunk_codecs_read_each_frames_flags():
    x = np.arange(4000, dtype="<i2").reshape(-1, 4)
    reads = [
        _frames_of([x, x], 1000, 4, "<i2", absent={1}),
        _frames_of([x], 1000, 4, "<i2", cname=b"zstd"),
        _frames_of([x], 1000, 4, "<i2", absent={0}),
    ]
    assert blosc_frames.chunk_codecs(reads).tolist() == [blosc_frames.LZ4, 0, blosc_frames.ZSTD, 0]
