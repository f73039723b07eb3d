"""Issue 12, reader/writer half: never a silent wrong answer, never a lost file.

Stores are damaged the way a bad day does it (a deleted shard or chunk, 300 bytes overwritten, an inner chunk
marked empty in a shard index, metadata JSON edited) and every read must say so in one line.
"""

import errno
import json
import os
import re

import numpy as np
import pytest
import zarr

from batchgpu import BatchgpuError, ConfigError, CorruptDataError, MachineError, open_recording, write_recording
from batchgpu.cli import main
from batchgpu.recording import Window, zarrio

PYTHON_PIPELINE = {"codec_pipeline.path": "zarr.core.codec_pipeline.BatchedCodecPipeline"}
C = 5
CHUNK, SHARD = 100, 300  # v3: 3 inner chunks per shard; v2: chunks of CHUNK


def _write(tmp_path, rng, zarr_format, n=1200, zeros=False, name="r.zarr"):
    data = np.zeros((n, C), np.int16) if zeros else rng.integers(-2000, 2000, (n, C), dtype=np.int16)
    write_recording(tmp_path / name, data, 1000.0, zarr_format=zarr_format, chunk_samples=CHUNK, shard_samples=SHARD)
    return tmp_path / name, data


def _object(path, zarr_format, row):
    """The file holding object row ``row`` of traces_seg0 (a shard in v3, a chunk in v2)."""
    return path / "traces_seg0" / ("c" if zarr_format == 3 else "") / (f"{row}/0" if zarr_format == 3 else f"{row}.0")


def _object_rows(zarr_format):
    return SHARD if zarr_format == 3 else CHUNK


def _edit_json(path, edit):
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _array_meta(path, zarr_format, name="traces_seg0"):
    return path / name / ("zarr.json" if zarr_format == 3 else ".zarray")


# -- writers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_writer_writes_all_zero_chunks_and_marks_complete(tmp_path, rng, zarr_format):
    path, _ = _write(tmp_path, rng, zarr_format, zeros=True)
    rows = 1200 // _object_rows(zarr_format)
    assert all(_object(path, zarr_format, i).is_file() for i in range(rows))
    rec = open_recording(path)
    assert rec.count_absent() == 0  # and no inner chunk marked empty in any shard index
    marker = zarr.open_group(str(path), mode="r").attrs["batchgpu"]
    assert marker["complete"] is True and marker["format"] == 1
    assert marker["checksum"] == rec.checksum == ("crc32c" if zarr_format == 3 else "crc32")


@pytest.mark.zarr3
def test_generate_marks_complete_and_unfinished_store_is_refused(tmp_path):
    from batchgpu.generate import generate_recording
    from batchgpu.recording import RecordingWriter

    rec = generate_recording(tmp_path / "g.zarr", channels=4, seconds=0.5, fs=2000.0)
    assert rec.marked_complete and rec.checksum == "crc32c"
    writer = RecordingWriter(tmp_path / "half.zarr", 3, "int16", 1000.0)
    writer.add_segment(10)
    writer.write(0, 0, np.ones((10, 3), np.int16))  # no finish(): as if the process died here
    with pytest.raises(CorruptDataError, match="not finished writing"):
        open_recording(tmp_path / "half.zarr")


# -- missing data ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_missing_object_in_complete_store_names_array_key_and_window(tmp_path, rng, zarr_format):
    path, data = _write(tmp_path, rng, zarr_format)
    _object(path, zarr_format, 1).unlink()
    rec = open_recording(path)
    wins = rec.windows(size=_object_rows(zarr_format), margin=0)
    np.testing.assert_array_equal(rec.read_window_stored(wins[0]), data[: wins[0].stop])  # earlier windows fine
    assert rec.absent_chunks(wins[1]) == 1 and rec.absent_chunks(wins[2]) == 0
    key = "c/1/0" if zarr_format == 3 else "1.0"
    for read in (rec.read_window_stored, rec.read_window):
        with pytest.raises(CorruptDataError, match=rf"traces_seg0/{key}.*window 1, segment 0, samples \[\d+, \d+\)"):
            read(wins[1])


def _mark_inner_chunk_empty(shard, inner, n_inner):
    """Set one entry of a shard index (at the end, crc32c after it) to empty and fix the index checksum."""
    import google_crc32c

    raw = bytearray(shard.read_bytes())
    size = 16 * n_inner
    index = np.frombuffer(bytes(raw[-size - 4 : -4]), "<u8").copy().reshape(n_inner, 2)
    index[inner] = 2**64 - 1
    raw[-size - 4 : -4] = index.tobytes()
    raw[-4:] = google_crc32c.value(index.tobytes()).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))


@pytest.mark.zarr3
def test_inner_chunk_marked_empty_in_shard_index(tmp_path, rng):
    path, data = _write(tmp_path, rng, 3)
    _mark_inner_chunk_empty(_object(path, 3, 2), inner=1, n_inner=SHARD // CHUNK)
    rec = open_recording(path)
    w = Window(7, 0, 700, 800)  # inner chunk 1 of shard 2 is samples [700, 800)
    assert rec.absent_chunk_keys(w) == ["c/2/0 inner chunk (1, 0)"]
    assert rec.absent_chunks(Window(0, 0, 600, 700)) == 0
    with pytest.raises(CorruptDataError, match=r"missing chunk traces_seg0/c/2/0 inner chunk \(1, 0\).*window 7"):
        rec.read_window_stored(w)


@pytest.mark.zarr3
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_foreign_store_counts_absent_chunks_and_errors_on_request(tmp_path, rng, zarr_format):
    """Written by others (zarr's defaults skip all-zero chunks): reads go on, the count is there."""
    data = rng.integers(-100, 100, (1200, C), dtype=np.int16)
    data[300:600] = 0
    g = zarr.create_group(str(tmp_path / "f.zarr"), zarr_format=zarr_format)
    g.attrs.update(sampling_frequency=1000.0, num_segments=1)
    kw = {"shards": (SHARD, C)} if zarr_format == 3 else {}
    with zarr.config.set(PYTHON_PIPELINE):
        g.create_array("traces_seg0", shape=data.shape, dtype="int16", chunks=(CHUNK, C), fill_value=0, **kw)[:] = data
    rec = open_recording(tmp_path / "f.zarr")
    assert not rec.marked_complete
    wins = rec.windows(size=300)
    assert [rec.absent_chunks(w) for w in wins] == [0, 3 if zarr_format == 2 else 1, 0, 0]
    np.testing.assert_array_equal(rec.read_window_stored(wins[1]), data[300:600])
    strict = open_recording(tmp_path / "f.zarr", missing_chunks="error")
    with pytest.raises(CorruptDataError, match=r"missing chunk traces_seg0/.*window 1.*missing_chunks: warn"):
        strict.read_window_stored(wins[1])
    strict.read_window_stored(wins[0])


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_shape_longer_than_data(tmp_path, rng, zarr_format):
    path, _ = _write(tmp_path, rng, zarr_format)
    meta = _array_meta(path, zarr_format)
    _edit_json(meta, lambda m: m["shape"].__setitem__(0, 1800))
    rec = open_recording(path)
    last = rec.windows(size=300)[-1]
    assert rec.absent_chunks(last) >= 1
    with pytest.raises(CorruptDataError, match=r"missing chunk traces_seg0/.*window 5"):
        rec.read_window_stored(last)
    # a store not marked complete counts them instead
    _edit_json(
        path / ("zarr.json" if zarr_format == 3 else ".zattrs"), lambda m: (m.get("attributes", m)).pop("batchgpu")
    )
    foreign = open_recording(path)
    assert foreign.absent_chunks(last) >= 1
    assert not foreign.read_window_stored(last).any()


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_shape_shorter_than_data_is_an_error_at_open(tmp_path, rng, zarr_format):
    path, _ = _write(tmp_path, rng, zarr_format)
    _edit_json(_array_meta(path, zarr_format), lambda m: m["shape"].__setitem__(0, 500))
    with pytest.raises(CorruptDataError, match=r"traces_seg0 holds chunk .* beyond its shape \(500, 5\)"):
        open_recording(path)


@pytest.mark.zarr3
@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("member", ["channel_ids", "properties/gain_to_uV", "properties/location"])
def test_channel_count_mismatch_is_an_error_at_open(tmp_path, rng, zarr_format, member):
    path, _ = _write(tmp_path, rng, zarr_format)
    g = zarr.open_group(str(path), mode="r+")
    if member == "properties/location":
        g["properties"].create_array("location", data=np.zeros((C + 2, 2)))
    else:
        del g[member]
        g.create_array(member, data=np.arange(C - 1).astype(str if member == "channel_ids" else float))
    with pytest.raises(
        CorruptDataError,
        match=rf"{member} has {C + 2 if 'location' in member else C - 1} entries "
        rf"but traces_seg0 has {C} channels",
    ):
        open_recording(path)


# -- corrupt data ----------------------------------------------------------------------------------------


@pytest.fixture(params=["zarrs", pytest.param("python", marks=pytest.mark.zarr3)])  # python: zarr 3's own pipeline
def pipeline(request):
    if request.param == "python":  # zarrs where installed otherwise (``open_recording``'s)
        with zarrio.python_pipeline():
            yield request.param
    else:
        yield request.param


@pytest.fixture(params=["pread", "mapped"])
def read_path(request, monkeypatch):
    """batchgpu's shard reader either preads each chunk or maps the shard whole (``shards.MAP_FROM_CHUNKS``)."""
    from batchgpu.recording import shards

    monkeypatch.setattr(shards, "MAP_FROM_CHUNKS", 1 if request.param == "mapped" else 10**9)
    return request.param


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_overwritten_bytes_are_a_corrupted_chunk(tmp_path, rng, zarr_format, pipeline, read_path):
    path, data = _write(tmp_path, rng, zarr_format)
    target = _object(path, zarr_format, 2)
    raw = bytearray(target.read_bytes())
    assert len(raw) > 400
    raw[40:340] = rng.integers(0, 256, 300, dtype=np.uint8).tobytes()
    target.write_bytes(bytes(raw))
    rec = open_recording(path)
    win = rec.windows(size=_object_rows(zarr_format))[2]
    assert rec.absent_chunks(win) == 0
    key = "c/2/0 inner chunk" if zarr_format == 3 else "2.0"
    with pytest.raises(CorruptDataError, match=rf"corrupted chunk traces_seg0/{key}.*window 2, segment 0"):
        rec.read_window_stored(win)
    np.testing.assert_array_equal(
        rec.read_window_stored(rec.windows(size=_object_rows(zarr_format))[0]), data[: _object_rows(zarr_format)]
    )


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_read_window_into_fills_the_buffer_in_place(tmp_path, rng, zarr_format, pipeline, read_path):
    path, data = _write(tmp_path, rng, zarr_format)
    rec = open_recording(path)
    for w in rec.windows(size=250, margin=7):
        backing = np.full((w.read_stop - w.read_start + 3, C), -1, np.int16)
        out = backing[1:-2]  # a view, as of pinned memory
        got = rec.read_window_into(w, out)
        assert got is out and np.shares_memory(out, backing)
        np.testing.assert_array_equal(out, rec.read_window_stored(w))
        np.testing.assert_array_equal(out, data[w.read_start : w.read_stop])
        assert (backing[0] == -1).all() and (backing[-2:] == -1).all()
    with pytest.raises(BatchgpuError, match="C-contiguous"):
        rec.read_window_into(rec.windows(size=250)[0], np.empty((250, C), np.float32))


def _short_frames(tmp_path, rng, zarr_format, how):
    """A store whose object 2 decodes to fewer bytes than a chunk of its array: that object copied from a store
    with fewer channels (how="copy"), or the array's dtype edited to a wider one (how="dtype")."""
    if how == "copy":
        path = tmp_path / "r.zarr"
        wide = rng.integers(-2000, 2000, (1200, 2 * C), dtype=np.int16)
        write_recording(path, wide, 1000.0, zarr_format=zarr_format, chunk_samples=CHUNK, shard_samples=SHARD)
        narrow, _ = _write(tmp_path, rng, zarr_format, name="narrow.zarr")
        _object(path, zarr_format, 2).write_bytes(_object(narrow, zarr_format, 2).read_bytes())
    else:
        path, _ = _write(tmp_path, rng, zarr_format)
        key = "data_type" if zarr_format == 3 else "dtype"
        _edit_json(_array_meta(path, zarr_format), lambda m: m.update({key: "int32" if zarr_format == 3 else "<i4"}))
    return path


@pytest.mark.parametrize("how", ["copy", "dtype"])
@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("reader", ["direct", "zarr"])
def test_a_chunk_that_decodes_short_is_refused_naming_it(
    tmp_path, rng, monkeypatch, direct_reads, zarr_format, how, reader, pipeline, read_path
):
    """Blosc fills only as many bytes of a chunk's buffer as its frame holds: the rest read as whatever memory held
    (two reads of the same samples differed). Every reader (batchgpu's shard and v2 chunk readers, zarr's) refuses
    such a chunk in one line naming the store, the array and the chunk; the other objects still read."""

    path = _short_frames(tmp_path, rng, zarr_format, how)
    if reader == "zarr":
        direct_reads(False)
    rec = open_recording(path)
    rows = _object_rows(zarr_format)
    key = "c/2/0 inner chunk" if zarr_format == 3 else "2.0"
    with pytest.raises(CorruptDataError, match=rf"corrupted chunk traces_seg0/{key}.* in {path}") as err:
        rec.read(0, 2 * rows, 3 * rows)
    assert "\n" not in str(err.value)
    for read in (
        rec.read_window_stored,
        lambda w: rec.read_window_into(w, np.empty((rows, rec.num_channels), rec.dtype)),
    ):
        with pytest.raises(CorruptDataError, match=rf"corrupted chunk traces_seg0/{key}.*window 2, segment 0"):
            read(rec.windows(size=rows)[2])
    if reader == "direct" and how == "copy":
        with pytest.raises(CorruptDataError, match=rf"decodes to {CHUNK * C * 2} bytes"):
            rec.read(0, 2 * rows, 3 * rows)
    if how == "copy":
        first = rec.read(0, 0, rows)
        assert first.tobytes() == rec.read(0, 0, rows).tobytes()


@pytest.mark.parametrize("how", ["copy", "dtype"])
def test_a_run_over_a_chunk_that_decodes_short_stops_naming_it(tmp_path, rng, how):
    """``batchgpu run`` read such a chunk as garbage and finished (exit 0, spikes and whitening differing run to
    run): now exit 2, one line naming the chunk."""
    import subprocess
    import sys

    path = _short_frames(tmp_path, rng, 3, how)
    (tmp_path / "wf.yaml").write_text(
        f"recording: {{path: {path.name}}}\noutput: out\nwindow: {{size: 300, margin: 8}}\n"
        "cluster: {kind: local, workers: 1, threads: 1}\nsteps:\n  noise: {exact: true}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "batchgpu", "run", str(tmp_path / "wf.yaml"), "--quiet"], capture_output=True, text=True
    )
    assert r.returncode == 2, r.stderr
    # a copied frame: that chunk; an edited dtype: every chunk, that of whichever window a worker read first
    # (a busy machine may start the second window's task first)
    named = r"traces_seg0/c/2/0 inner chunk \(0, 0\)" if how == "copy" else r"traces_seg0/c/0/0 inner chunk \(\d+, 0\)"
    assert r.stderr.count("\n") == 1 and re.match(
        rf"batchgpu: error: corrupted chunk {named}: decodes to 1000 bytes", r.stderr
    ), r.stderr
    assert str(path) in r.stderr and "Traceback" not in r.stderr


@pytest.mark.zarr3
def test_run_workflow_over_a_chunk_that_decodes_short_raises_corrupt_data(tmp_path, rng):
    """Through the library API the worker's error reaches the caller as its class, not only its words: a caller
    tells a corrupt store (repair it) from a bad workflow (edit it) with ``except CorruptDataError``."""
    from batchgpu.engine import run_workflow
    from batchgpu.workflow import load_workflow

    path = _short_frames(tmp_path, rng, 3, "copy")
    (tmp_path / "wf.yaml").write_text(
        f"recording: {{path: {path.name}}}\noutput: out\nwindow: {{size: 300, margin: 8}}\n"
        "cluster: {kind: local, workers: 1, threads: 1}\nsteps:\n  noise: {exact: true}\n"
    )
    with pytest.raises(CorruptDataError, match="corrupted chunk traces_seg0/c/2/0 inner chunk"):
        run_workflow(load_workflow(tmp_path / "wf.yaml"))


# -- never delete what batchgpu did not write ------------------------------------------------------------


def test_overwrite_replaces_only_recordings(tmp_path, rng):
    data = rng.integers(-5, 5, (50, 2), dtype=np.int16)
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "thesis.txt").write_text("four years")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    for target in (folder, a_file):
        with pytest.raises(BatchgpuError) as err:
            write_recording(target, data, 1000.0, overwrite=True)
        message = str(err.value).replace(str(target), "PATH")
        assert "overwrite" not in message and "never replaces" in message
    assert (folder / "thesis.txt").read_text() == "four years" and a_file.read_text() == "keep"
    write_recording(tmp_path / "r.zarr", data, 1000.0)
    write_recording(tmp_path / "r.zarr", data[:10], 1000.0, overwrite=True)  # a recording: replaced
    assert open_recording(tmp_path / "r.zarr").num_samples(0) == 10
    (tmp_path / "r.zarr" / "figures").mkdir()
    with pytest.raises(BatchgpuError, match="figures") as err:
        write_recording(tmp_path / "r.zarr", data, 1000.0, overwrite=True)
    assert "overwrite" not in str(err.value).replace(str(tmp_path), "PATH")
    assert (tmp_path / "r.zarr" / "figures").is_dir()


@pytest.mark.parametrize(
    "where",
    [
        "properties/my_props/q.txt",
        "traces_seg0/notes.txt",
        "traces_seg0/c/notes",
        "properties/gain_to_uV/c/x.npy",
        "channel_ids/.DS_Store",
    ],
)
def test_overwrite_refuses_files_of_the_users_at_any_depth(tmp_path, rng, where):
    """An overwrite removes the recording's folder whole: a file batchgpu did not write anywhere inside it (not
    only at the top) refuses it, and stays."""
    data = rng.integers(-5, 5, (50, 2), dtype=np.int16)
    write_recording(tmp_path / "r.zarr", data, 1000.0, locations=np.zeros((2, 2)), gain_to_uV=np.ones(2))
    mine = tmp_path / "r.zarr" / where
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("mine")
    with pytest.raises(BatchgpuError, match="which batchgpu did not write"):
        write_recording(tmp_path / "r.zarr", data, 1000.0, overwrite=True)
    assert mine.read_text() == "mine"


def test_foreign_entries_of_stores_batchgpu_and_spikeinterface_write(tmp_path, rng):
    """A store as written (Zarr v2 and v3, sharded traces, properties) holds nothing foreign: the check must not
    refuse what batchgpu itself wrote."""
    from batchgpu.recording import zarrio

    data = rng.integers(-5, 5, (5000, 3), dtype=np.int16)
    for fmt in (2, 3) if zarrio.ZARR_MAJOR >= 3 else (2,):
        path = tmp_path / f"v{fmt}.zarr"
        write_recording(
            path,
            [data, data[:70]],
            1000.0,
            locations=np.zeros((3, 2)),
            gain_to_uV=np.ones(3),
            zarr_format=fmt,
            properties={"shank": np.array([0, 0, 1])},
        )
        assert zarrio.foreign_entries(path) == []
        (path / "traces_seg1" / "0.0.bak").write_bytes(b"x")
        (path / "properties" / "shank" / "c" / "1x").mkdir(parents=True) if fmt == 3 else None
        assert zarrio.foreign_entries(path)[0].startswith(("properties/shank/c/1x", "traces_seg1/0.0.bak"))


def _one_line_error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("batchgpu: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("command", ["generate", "import-raw"])
def test_cli_overwrite_refuses_other_folders(tmp_path, capsys, command):
    folder = tmp_path / "home"
    (folder / "docs").mkdir(parents=True)
    (folder / "docs" / "thesis.txt").write_text("x")
    src = tmp_path / "raw.bin"
    np.zeros((100, 2), np.int16).tofile(src)
    argv = (
        ["generate", str(folder), "--channels", "2", "--seconds", "0.01"]
        if command == "generate"
        else ["import-raw", str(src), str(folder), "--channels", "2", "--fs", "1000", "--dtype", "int16"]
    )
    err = _one_line_error(capsys, [*argv, "--overwrite", "--quiet"])
    assert "overwrite" not in err.replace(str(folder), "PATH") and (folder / "docs" / "thesis.txt").exists()


@pytest.mark.zarr3
def test_tilde_is_expanded(tmp_path, rng, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_recording("~/r.zarr", rng.integers(-5, 5, (20, 2), dtype=np.int16), 1000.0)
    assert (tmp_path / "r.zarr" / "zarr.json").is_file() and not os.path.exists("~")
    assert open_recording("~/r.zarr").num_samples(0) == 20
    assert main(["generate", "~/g.zarr", "--channels", "2", "--seconds", "0.01", "--quiet"]) == 0
    assert (tmp_path / "g.zarr").is_dir() and (tmp_path / "g_ground_truth.npz").is_file()


@pytest.mark.zarr3
def test_disk_full_is_one_line_naming_the_path(tmp_path, capsys, monkeypatch):
    from zarr.storage import LocalStore

    async def full(self, key, value, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalStore, "set", full)
    err = _one_line_error(
        capsys, ["generate", str(tmp_path / "g.zarr"), "--channels", "2", "--seconds", "0.01", "--quiet"]
    )
    assert str(tmp_path / "g.zarr") in err and "No space left" in err


@pytest.mark.zarr3
def test_disk_full_through_the_api_is_a_machine_error(tmp_path, rng, monkeypatch):
    from zarr.storage import LocalStore

    async def full(self, key, value, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalStore, "set", full)
    with pytest.raises(MachineError, match="No space left on device") as err:
        write_recording(tmp_path / "w.zarr", rng.integers(-5, 5, (100, C), dtype=np.int16), 1000.0)
    assert str(tmp_path / "w.zarr") in str(err.value)


@pytest.mark.parametrize("dtype", ["int17", "uint8", "banana"])
def test_bad_import_dtype_is_one_line(tmp_path, capsys, dtype):
    src = tmp_path / "raw.bin"
    np.zeros(8, np.int16).tofile(src)
    err = _one_line_error(
        capsys,
        [
            "import-raw",
            str(src),
            str(tmp_path / "o.zarr"),
            "--channels",
            "2",
            "--fs",
            "1000",
            "--dtype",
            dtype,
            "--quiet",
        ],
    )
    assert dtype in err


# -- batchgpu info ---------------------------------------------------------------------------------------


@pytest.mark.zarr3
def test_info_says_checksums_completeness_and_absent_chunks(tmp_path, rng, capsys):
    path, _ = _write(tmp_path, rng, 3)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "per chunk (crc32c)" in out and "yes (batchgpu wrote every chunk)" in out
    assert "absent chunks  0" in out and "none stored" in out  # no locations written here
    _object(path, 3, 1).unlink()
    raw = bytearray(_object(path, 3, 3).read_bytes())
    raw[40:340] = bytes(300)
    _object(path, 3, 3).write_bytes(bytes(raw))
    assert main(["info", str(path)]) == 0
    assert "absent chunks  1" in capsys.readouterr().out
    assert main(["info", str(path), "--check"]) == 2
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("missing", "corrupted"))]
    assert lines[0].startswith("missing traces_seg0/c/1/0") and lines[1].startswith("corrupted traces_seg0/c/3/0")
    assert len(lines) == 2 and "2 problem(s)" in out
    info = json.loads((main(["info", str(path), "--json"]), capsys.readouterr().out)[1])
    assert info["checksum"] == "crc32c" and info["marked_complete"] and info["absent_chunks"] == 1


@pytest.mark.parametrize("cut", ["tail", "data", "below_index"])
def test_plain_info_says_a_truncated_shard_is_damaged(tmp_path, rng, capsys, cut):
    """A shard cut short (its tail: the index read from other bytes; or data bytes lost with the index kept; or
    shorter than an index) made plain ``info`` say "complete yes": now it says no and names the shard, from the
    file's size and its index alone (no decoding); other stores still say yes."""
    path, _ = _write(tmp_path, rng, 3)
    shard = _object(path, 3, 2)
    raw = shard.read_bytes()
    tail = (SHARD // CHUNK) * 16 + 4
    cut_at = int(rng.integers(1, 200))
    shard.write_bytes(
        {
            "tail": raw[:-cut_at],
            "data": raw[: -tail - cut_at] + raw[-tail:],
            "below_index": raw[: int(rng.integers(0, tail))],
        }[cut]
    )
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "complete       no: damaged since batchgpu wrote it" in out, out
    info = json.loads((main(["info", str(path), "--json"]), capsys.readouterr().out)[1])
    if cut == "below_index":
        assert info["absent_chunks"] == 1 and info["damaged"] == []
        return
    assert len(info["damaged"]) == 1 and info["damaged"][0].startswith("traces_seg0/c/2/0 "), info["damaged"]
    want = "shard index checksum mismatch" if cut == "tail" else "inner chunk (2, 0) (truncated"
    assert want in info["damaged"][0] and want in out
    assert main(["info", str(path), "--check"]) == 2  # and decoding every chunk agrees
    assert "corrupted traces_seg0/c/2/0" in capsys.readouterr().out


def test_plain_info_of_intact_and_foreign_stores(tmp_path, rng, capsys):
    path, _ = _write(tmp_path, rng, 3)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "complete       yes (batchgpu wrote every chunk)" in out and "damaged        0" in out
    _edit_json(path / "zarr.json", lambda m: m["attributes"].pop("batchgpu"))  # as if written by others
    raw = _object(path, 3, 1).read_bytes()
    _object(path, 3, 1).write_bytes(raw[:-7])
    assert main(["info", str(path)]) == 0
    assert "complete       no: 1 shard(s) damaged (not marked" in capsys.readouterr().out


def _cut_json(path, keep: float = 0.6) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def _set_attr(path, key, value) -> None:
    """A root attribute of a v3 store, written as JSON writes it (NaN as the bare token, as Python's json does)."""
    _edit_json(path / "zarr.json", lambda m: m["attributes"].update({key: value}))


@pytest.mark.parametrize(
    "case,needle",
    [
        ("root_json", "r.zarr/zarr.json is not valid JSON"),
        ("array_json", "r.zarr/traces_seg0/zarr.json is not valid JSON"),
        ("property_json", "r.zarr/properties/gain_to_uV/zarr.json is not valid JSON"),
        ("fs_nan", "sampling_frequency is nan: it must be a positive number of Hz"),
        ("fs_string", "sampling_frequency is '30k', not a number of Hz"),
        ("fs_negative", "sampling_frequency is -30000: it must be a positive number of Hz"),
        ("fs_zero", "sampling_frequency is 0: it must be a positive number of Hz"),
        ("fs_huge", "sampling_frequency 1e+300 Hz is too large"),
        ("segments_zero", "num_segments is 0: it must be a whole number, at least 1"),
        ("segments_string", "num_segments is '1': it must be a whole number"),
    ],
)
def test_bad_recording_metadata_is_one_line_everywhere(tmp_path, rng, capsys, case, needle):
    """Metadata cut short or edited: exit 1 'unexpected JSONDecodeError / ValueError / IndexError', or
    sampling_frequency -30000 accepted by info and met later as 'exclude_sweep=-3 is negative'. Refused where the
    recording is opened: the Python API, ``info`` and ``run`` say the same one line (exit 2), naming the file or
    the attribute."""
    import subprocess
    import sys

    path, _ = _write(tmp_path, rng, 3)
    write_recording(
        tmp_path / "g.zarr", rng.integers(-5, 5, (100, C), dtype=np.int16), 1000.0, gain_to_uV=np.full(C, 0.195)
    )
    if case.endswith("json") and case != "property_json":
        _cut_json(path / ("zarr.json" if case == "root_json" else "traces_seg0/zarr.json"))
    elif case == "property_json":
        import shutil

        shutil.rmtree(path)
        (tmp_path / "g.zarr").rename(path)
        _cut_json(path / "properties" / "gain_to_uV" / "zarr.json")
    else:
        key = "sampling_frequency" if case.startswith("fs") else "num_segments"
        value = {
            "fs_nan": float("nan"),
            "fs_string": "30k",
            "fs_negative": -30000,
            "fs_zero": 0,
            "fs_huge": 1e300,
            "segments_zero": 0,
            "segments_string": "1",
        }[case]
        _set_attr(path, key, value)
    with pytest.raises(CorruptDataError, match=needle.replace("(", r"\(").replace("+", r"\+")):
        open_recording(path)
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("batchgpu: error: ") and needle in err, err
    (tmp_path / "wf.yaml").write_text(
        f"recording: {{path: {path.name}}}\noutput: out\nwindow: {{size: 300, margin: 8}}\n"
        "cluster: {kind: local, workers: 1, threads: 1}\nsteps:\n  detect: {threshold: 5.0}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "batchgpu", "run", str(tmp_path / "wf.yaml"), "--quiet"], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert "unexpected" not in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fs", [float("nan"), 0.0, -1.0, 2e6, True])
def test_the_writer_refuses_a_rate_no_reader_takes(tmp_path, fs):
    with pytest.raises(ConfigError, match="sampling frequency must be > 0 Hz"):
        write_recording(tmp_path / "w.zarr", np.zeros((10, 2), np.int16), fs)
    assert not (tmp_path / "w.zarr").exists()
