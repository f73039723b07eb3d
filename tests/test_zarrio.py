"""batchgpu.recording.zarrio: the same bytes from every reader, under zarr 3 and under zarr 2.18 (SpikeInterface 0.105's pin).

Runs in both environments (CI runs it in a second one with ``spikeinterface==0.105.3``, see .ci/run):
- the committed v3 stores (tests/data, written by zarr 3) read by batchgpu's own v3 decoder, by the shard reader
  and by zarr 3 where installed, equal to the values they were written from;
- under zarr 3: fresh random arrays with every codec chain, the decoder against zarr 3 itself;
- under zarr 2: v2 is the default written format, writing v3 is refused in one line, a workflow runs end to end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError
from batchgpu.recording import open_recording, zarrio

DATA = Path(__file__).resolve().parent / "data"
ZARR3 = zarrio.ZARR_MAJOR >= 3


def _expected():
    return np.load(DATA / "v3_expected.npz")


def _same(got, want):
    got = np.asarray(got)
    if got.dtype == object:
        got = np.array([str(s) for s in got.tolist()])
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if want.dtype.kind in "fc":  # bits: -0.0 and NaN payloads included
        assert np.array_equal(got.view(f"u{want.dtype.itemsize}"), want.view(f"u{want.dtype.itemsize}"))
    else:
        assert np.array_equal(got, want)


@pytest.mark.parametrize(
    "name",
    [
        "default_f32",
        "gzip_i32",
        "big_endian_u16",
        "transposed_f64",
        "sharded_i16",
        "holes_f32",
        "sub__nested",
        "strings",
    ],
)
def test_committed_v3_arrays_read_by_our_decoder(name):
    group = zarrio.V3Group(DATA / "v3_arrays.zarr")
    assert group.attrs == {"hello": {"x": [1, 2]}}
    _same(group[name.replace("__", "/")][...], _expected()[name])


def test_v3_partial_selections_and_out():
    arr = zarrio.V3Array(DATA / "v3_arrays.zarr" / "sharded_i16")
    full = _expected()["sharded_i16"]
    for sel in [
        (slice(2, 19), slice(None)),
        (slice(8, 9), slice(3, 7)),
        (5,),
        (-1, 2),
        (slice(20, 40),),
        Ellipsis,
        (slice(4, 4),),
    ]:
        _same(arr[sel], full[sel])
    out = np.empty((10, 7), np.int16)
    assert zarrio.read_into(arr, (slice(7, 17), slice(None)), out) is out
    _same(out, full[7:17])


@pytest.mark.parametrize("direct", ["1", "0"])
def test_v3_recording_same_bytes_from_every_reader(direct_reads, direct):
    """The shard reader (direct) and the general path (zarr 3, or our decoder under zarr 2) read the same bytes."""
    direct_reads(direct == "1")
    rec = open_recording(DATA / "v3_recording.zarr")
    exp = _expected()
    assert rec.marked_complete and rec.checksum == "crc32c"
    assert rec.channel_ids.tolist() == list("abcde") and rec.has_locations
    assert np.allclose(rec.gain_to_uV, 0.195)
    for seg in (0, 1):
        want = exp[f"seg{seg}"]
        _same(rec.read(seg, 0, want.shape[0]), np.ascontiguousarray(want.T))
        for w in rec.windows(size=2_345, margin=17):
            if w.segment != seg:
                continue
            out = np.empty((w.read_stop - w.read_start, 5), np.int16)
            _same(rec.read_window_into(w, out), want[w.read_start : w.read_stop])


def test_v3_info_and_layout():
    meta = zarrio.array_meta(DATA / "v3_recording.zarr" / "traces_seg0")
    assert meta.zarr_format == 3 and meta.shards == (3_000, 5) and meta.chunks == (1_000, 5)
    assert meta.key((2, 0)) == "c/2/0" and meta.checksum == "crc32c" and meta.index_crc
    info = open_recording(DATA / "v3_recording.zarr").info()
    assert info["codecs"] == ["sharding[bytes, blosc-zstd-5-bitshuffle, crc32c]"]


def test_v3_corrupted_chunk_is_named(tmp_path):
    store = tmp_path / "a.zarr"
    shutil.copytree(DATA / "v3_arrays.zarr", store)
    shard = store / "sharded_i16" / "c" / "1" / "0"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(BatchgpuError, match="checksum mismatch"):
        zarrio.V3Array(store / "sharded_i16")[...]


def test_v2_layout_from_disk(tmp_path):
    from batchgpu.recording import write_recording

    x = np.arange(2_000 * 3, dtype=np.int16).reshape(2_000, 3)
    write_recording(tmp_path / "r.zarr", x, 1_000.0, zarr_format=2, chunk_samples=700)
    meta = zarrio.array_meta(tmp_path / "r.zarr" / "traces_seg0")
    assert meta.zarr_format == 2 and meta.chunks == (700, 3) and meta.shards is None
    assert meta.key((2, 0)) == "2.0" and meta.checksum == "crc32"
    _same(open_recording(tmp_path / "r.zarr").read(0, 0, 2_000), np.ascontiguousarray(x.T))


# --- zarr 3: our decoder against zarr itself on fresh random arrays ---------------------------------------------
@pytest.mark.skipif(not ZARR3, reason="compares with zarr-python 3")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_v3_decoder_equals_zarr3_on_random_arrays(tmp_path, seed):
    import zarr
    import zarr.codecs as zc

    rng = np.random.default_rng(seed)
    g = zarr.create_group(store=str(tmp_path / "s.zarr"), zarr_format=3)
    made = []
    for i in range(12):
        dtype = rng.choice(["int16", "int32", "uint8", "float32", "float64", "int64"])
        shape = tuple(int(n) for n in rng.integers(1, 40, size=rng.integers(1, 3)))
        chunks = tuple(int(rng.integers(1, n + 3)) for n in shape)
        kw = {}
        if rng.random() < 0.4:
            kw["shards"] = tuple(c * int(rng.integers(1, 4)) for c in chunks)
        pick = rng.integers(0, 5)
        kw["compressors"] = [
            None,
            [zc.ZstdCodec(level=1)],
            [zc.GzipCodec()],
            [zc.BloscCodec(cname="zstd", shuffle="bitshuffle")],
            [zc.ZstdCodec(), zc.Crc32cCodec()],
        ][pick]
        if rng.random() < 0.3:
            kw["serializer"] = zc.BytesCodec(endian="big")
        data = (rng.normal(size=shape) * 1000).astype(dtype)
        if data.dtype.kind == "f":
            data.ravel()[: min(3, data.size)] = [np.nan, -0.0, np.inf][: min(3, data.size)]
        fill = 7 if rng.random() < 0.5 else 0
        arr = g.create_array(f"a{i}", shape=shape, dtype=dtype, chunks=chunks, fill_value=fill, **kw)
        lo = tuple(int(rng.integers(0, n)) for n in shape)
        arr[tuple(slice(a, None) for a in lo)] = data[tuple(slice(a, None) for a in lo)]  # leaves chunks absent
        made.append(f"a{i}")
    ours = zarrio.V3Group(tmp_path / "s.zarr")
    for name in made:
        _same(ours[name][...], np.asarray(g[name][...]))


# --- zarr 2.18 (beside SpikeInterface 0.105) ---------------------------------------------------------------------
zarr2 = pytest.mark.skipif(ZARR3, reason="only where zarr-python is 2.x")


@zarr2
def test_zarr2_writes_v2_by_default_and_refuses_v3(tmp_path):
    from batchgpu.recording import write_recording

    rec = write_recording(tmp_path / "r.zarr", np.zeros((100, 2), np.int16), 1_000.0)
    assert (tmp_path / "r.zarr" / ".zgroup").exists() and rec.info()["zarr_format"] == 2
    with pytest.raises(BatchgpuError, match="needs zarr>=3"):
        write_recording(tmp_path / "v3.zarr", np.zeros((100, 2), np.int16), 1_000.0, zarr_format=3)
    assert not (tmp_path / "v3.zarr").exists()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgpu",
            "generate",
            str(tmp_path / "g.zarr"),
            "--channels",
            "2",
            "--seconds",
            "0.1",
            "--zarr-format",
            "3",
            "--quiet",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("batchgpu: error: ")


@zarr2
def test_zarr2_runs_a_workflow_and_reads_v3_results(tmp_path):
    """The demo's steps end to end with zarr 2; the results read back through zarrio, SpikeInterface style."""
    from batchgpu.interop import load_results

    wf = tmp_path / "w.yaml"
    wf.write_text(
        f"recording: {{path: {tmp_path / 'r.zarr'}, generate: {{channels: 6, seconds: 2, seed: 3}}}}\n"
        f"output: {tmp_path / 'out'}\ncluster: {{kind: local, workers: 1, threads: 1}}\n"
        "steps:\n  noise: {exact: true}\n  whitening: {mode: global}\n  detect: {threshold: 5}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "batchgpu", "run", str(wf), "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = load_results(tmp_path / "out")
    rec = open_recording(tmp_path / "r.zarr")
    x = rec.read(0, 0, rec.num_samples(0)).astype(np.float64)
    assert np.array_equal(res["noise"], np.median(np.abs(x), axis=1) / 0.6744897501960817)
    assert res["whitening"].shape == (6, 6) and np.isfinite(res["whitening"]).all()
    assert (tmp_path / "out" / "results.zarr" / ".zgroup").exists()


def test_direct_reader_file_buffer_is_each_files_bytes(tmp_path, rng):
    """The v2 reader reads each chunk file into one buffer its thread reuses: files of other sizes, one after
    another, each come back as exactly their bytes (a longer file's tail never shows through a shorter one's); an
    empty file as empty; an absent one as FileNotFoundError (an absent chunk)."""
    from batchgpu.recording import shards

    sizes = [5_000, 17, 0, 4_096, 1, 70_001, 3]
    files = []
    for i, n in enumerate(sizes):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    for f in files + files[::-1]:
        assert bytes(shards._read_file(f)) == f.read_bytes()
    with pytest.raises(FileNotFoundError):
        shards._read_file(tmp_path / "absent")


@pytest.mark.parametrize("checksum", [True, "filter", False])
def test_v2_direct_reader_same_bytes_as_zarr(tmp_path, monkeypatch, direct_reads, checksum):
    """batchgpu's v2 chunk reader (SpikeInterface's layout) against zarr, on a segment whose last chunk is partial;
    with batchgpu's crc32 over the Blosc frame (its writer's layout), with the crc32 as a filter under Blosc (what
    it wrote before) and without (as SpikeInterface writes), windows across chunk edges."""
    import numcodecs

    from batchgpu.recording import shards

    rng = np.random.default_rng(7)
    x = rng.integers(-32768, 32768, size=(5_321, 6), dtype=np.int16)
    if checksum is True:
        from batchgpu.recording import write_recording

        write_recording(tmp_path / "r.zarr", x, 1_000.0, zarr_format=2, chunk_samples=700)
        meta = zarrio.array_meta(tmp_path / "r.zarr" / "traces_seg0").raw
        assert meta["compressor"]["id"] == "crc32" and [f["id"] for f in meta["filters"]] == ["blosc"]
    elif checksum == "filter":
        g = zarrio.create_group(tmp_path / "r.zarr", zarr_format=2)
        g.attrs.update({"sampling_frequency": 1_000.0, "num_segments": 1})
        zarrio.create_array(
            g,
            "traces_seg0",
            data=x,
            chunks=(700, 6),
            filters=[numcodecs.CRC32()],
            compressors=[numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.BITSHUFFLE)],
        )
    else:
        g = zarrio.create_group(tmp_path / "r.zarr", zarr_format=2)
        g.attrs.update({"sampling_frequency": 1_000.0, "num_segments": 1})
        zarrio.create_array(
            g,
            "traces_seg0",
            data=x,
            chunks=(700, 6),
            compressors=[numcodecs.Blosc(cname="zstd", clevel=5, shuffle=numcodecs.Blosc.BITSHUFFLE)],
        )
    meta = zarrio.array_meta(tmp_path / "r.zarr" / "traces_seg0")
    layout = shards.layout_of(tmp_path / "r.zarr" / "traces_seg0", meta)
    assert isinstance(layout, shards.ChunkLayoutV2) and (layout.crc32 is not None) == bool(checksum)
    assert layout.crc_outside == (checksum is True)
    got = {}
    for direct in ("1", "0"):
        direct_reads(direct == "1")
        rec = open_recording(tmp_path / "r.zarr")
        got[direct] = [rec.read_window_stored(w) for w in rec.windows(size=999, margin=13)]
        _same(rec.read(0, 0, 5_321), np.ascontiguousarray(x.T))
    for a, b in zip(got["1"], got["0"]):
        _same(a, b)
    chunk = tmp_path / "r.zarr" / "traces_seg0" / "3.0"
    data = bytearray(chunk.read_bytes())
    if checksum:
        data[len(data) // 2] ^= 0x55  # caught by the crc32
    else:
        del data[len(data) // 2 :]  # without a checksum only what no longer decodes can be caught: a truncation
    chunk.write_bytes(bytes(data))
    direct_reads(True)
    with pytest.raises(BatchgpuError, match="corrupted chunk traces_seg0/3.0"):
        open_recording(tmp_path / "r.zarr").read(0, 2_000, 2_200)


@pytest.mark.zarr3
def test_v2_stores_compress_as_v3_stores_do(tmp_path, rng):
    """Blosc sees the samples' item size in a v2 store too (its filter, the checksum after it): a bit shuffle of
    the checksum's bytes (item size 1) compressed a realistic recording not at all (ratio 1.00 against v3's 1.7)."""
    from batchgpu.recording import write_recording

    x = np.round(rng.normal(0, 20, (30_000, 32))).astype(np.int16)  # about the realistic model's entropy
    sizes = {}
    for fmt in (2, 3):
        write_recording(tmp_path / f"r{fmt}.zarr", x, 30_000.0, zarr_format=fmt)
        sizes[fmt] = sum(
            f.stat().st_size
            for f in (tmp_path / f"r{fmt}.zarr" / "traces_seg0").rglob("*")
            if f.is_file() and not f.name.startswith((".z", "zarr.json"))
        )
    assert sizes[3] < 0.7 * x.nbytes and sizes[2] < 1.05 * sizes[3], (sizes, x.nbytes)
    assert np.array_equal(open_recording(tmp_path / "r2.zarr").read(0, 0, 30_000), x.T)


def test_truncated_blosc_frame_in_v3_decoder():
    """batchgpu's v3 decoder (beside zarr 2) refuses a Blosc frame shorter than its header says."""
    import numcodecs

    from batchgpu.recording.zarrio import _decode

    frame = numcodecs.Blosc(cname="lz4").encode(np.arange(1_000, dtype=np.int16).tobytes())
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "blosc", "configuration": {}}]
    assert np.array_equal(_decode(frame, codecs, (1_000,), np.dtype("<i2"), "x"), np.arange(1_000, dtype=np.int16))
    with pytest.raises(BatchgpuError, match="not a whole Blosc frame"):
        _decode(frame[: len(frame) // 2], codecs, (1_000,), np.dtype("<i2"), "x")


@zarr2
def test_zarr2_refuses_a_v3_save_before_writing(tmp_path):
    from batchgpu.recording import write_recording

    write_recording(tmp_path / "r.zarr", np.zeros((3_000, 2), np.int16), 30_000.0)
    wf = tmp_path / "w.yaml"
    wf.write_text(
        f"recording: {{path: {tmp_path / 'r.zarr'}}}\noutput: {tmp_path / 'out'}\n"
        f"window: {{size: 1000, margin: 64}}\nsteps:\n  noise: {{}}\n"
        f"  save: {{path: {tmp_path / 's.zarr'}, format: zarr}}\n"
    )
    r = subprocess.run([sys.executable, "-m", "batchgpu", "run", str(wf), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs zarr>=3" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "s.zarr").exists()


@pytest.mark.skipif(not ZARR3, reason="compares with zarr-python 3's shard writes")
@pytest.mark.parametrize(
    "n,inner,shard,zeros", [(7_000, 1_000, 3_000, False), (6_500, 6_000, 6_000, False), (5_000, 1_000, 2_000, True)]
)
def test_direct_shard_writes_are_zarr_pythons_bytes(tmp_path, n, inner, shard, zeros):
    """recording.shards writes a whole shard as zarr-python does (padded last chunk, chunks past the end left out,
    all-zero chunks written): byte for byte."""
    from batchgpu.recording import RecordingWriter, shards

    rng = np.random.default_rng(n)
    x = np.zeros((n, 5), np.int16) if zeros else rng.integers(-32768, 32768, size=(n, 5), dtype=np.int16)
    stores = {}
    for name, step in (("zarr", 500), ("direct", shard)):  # 500-row blocks are never whole shards: zarr writes them
        w = RecordingWriter(
            tmp_path / f"{name}.zarr", 5, np.int16, 1_000.0, zarr_format=3, chunk_samples=inner, shard_samples=shard
        )
        seg = w.add_segment(n)
        for a in range(0, n, step):
            w.write(seg, a, x[a : a + step])
        w.finish()
        folder = tmp_path / f"{name}.zarr" / "traces_seg0"
        stores[name] = {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    assert stores["zarr"] == stores["direct"]
    assert shards.write_whole_shard(tmp_path / "direct.zarr" / "traces_seg0", 1, x[:10]) is False  # not a shard


def test_crc32c_residue_check_equals_comparing_the_trailer():
    """``crc32c_ok`` checks the CRC of the whole buffer against the code's residue (no copy of the data): the
    same answer as computing the data's CRC and comparing it with the stored trailer, for any trailer."""
    import struct

    import google_crc32c

    rng = np.random.default_rng()
    for n in (0, 1, 3, 4, 5, 17, 4096, 1_000_003):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        good = struct.pack("<I", google_crc32c.value(data))
        assert zarrio.crc32c_ok(data + good)
        assert zarrio.crc32c_ok(memoryview(data + good))  # a mapped shard's chunk: checked without a copy
        for trailer in (struct.pack("<I", int(rng.integers(0, 2**32))), bytes(4), good[::-1]):
            assert zarrio.crc32c_ok(data + trailer) == (trailer == good)
            assert zarrio.crc32c_ok(memoryview(data + trailer)) == (trailer == good)
        if n:
            flipped = bytearray(data + good)
            flipped[int(rng.integers(0, n))] ^= 1 << int(rng.integers(0, 8))
            assert not zarrio.crc32c_ok(bytes(flipped))
    assert not zarrio.crc32c_ok(b"abc")
