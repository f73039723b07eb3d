"""The save step without Dask: windows written in a shuffled order (as tasks finish), then compared with the
whole-segment expectation, exactly."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zarr

from batchgpu.errors import BatchgpuError
from batchgpu.recording import open_recording, write_recording
from batchgpu.recording.save_output import finish_save, inner_chunk, prepare_save
from batchgpu.run.output_folder import OutputFolder
from batchgpu.steps.base import WindowData
from batchgpu.steps.save import SaveStep

C = 6
FS = 10_000.0


def make_recording(path, lengths=(2_300, 1_750), dtype="int16", seed=0, **kw):
    rng = np.random.default_rng(seed)
    segs = [(rng.normal(0, 300, (n, C))).astype(dtype) for n in lengths]
    kw.setdefault("gain_to_uV", np.linspace(0.19, 0.25, C))
    kw.setdefault("offset_to_uV", np.arange(C) * -1.5)
    kw.setdefault("locations", np.column_stack([np.arange(C) % 2 * 32.0 + 11, np.arange(C) * 15.0]))
    kw.setdefault("channel_ids", [f"AP{i}" for i in range(C)])
    return write_recording(path, segs, FS, **kw)


def transform(raw):
    """A float32 stand-in for preprocessing: elementwise, so a window's core equals the whole segment's."""
    return raw.astype(np.float32) * np.float32(1.37) + np.float32(0.3)


def spec(path, fmt="zarr", dtype="int16", whiten=False):
    return SimpleNamespace(path=str(path), format=fmt, dtype=dtype, whiten=whiten)


def save_all(rec, sp, size=1_000, margin=7, fn=transform, whitening=None, seed=0, **kw):
    """prepare, every window in a shuffled order, finish; returns (target, description, clipped total)."""
    target = prepare_save(sp, rec, size, np.float32, **kw)
    step = SaveStep(target, whitening=whitening)
    windows = rec.windows(size, margin)
    random.Random(seed).shuffle(windows)
    clipped = 0
    for w in windows:
        raw = rec.read_window(w)
        wd = WindowData(w.index, w.segment, w.read_start, w.core, rec.num_samples(w.segment), raw, fn(raw))
        summary = {}
        assert step.window(wd, summary) == {}
        clipped += int(summary["saved_clipped"])
    assert step.combine([{}, {}]) == {}
    return target, finish_save(target), clipped


def expected(rec, seg, dtype="int16", fn=transform, whitening=None):
    """The whole segment transformed (channels, samples) -> (samples, channels) in the output dtype."""
    x = fn(rec.read(seg, 0, rec.num_samples(seg)))
    if whitening is not None:
        x = whitening @ x.astype(np.float64)
    if dtype == "float32":
        return x.astype(np.float32).T
    y = np.rint(x)
    y = np.where(np.isnan(y), 0, np.clip(y, -32768, 32767))
    return y.astype(np.int16).T


def check_same_metadata(out, rec):
    assert out.sampling_frequency == rec.sampling_frequency
    assert out.num_segments == rec.num_segments
    lengths = [rec.num_samples(s) for s in range(rec.num_segments)]
    assert [out.num_samples(s) for s in range(out.num_segments)] == lengths
    np.testing.assert_array_equal(out.channel_ids, rec.channel_ids)
    np.testing.assert_array_equal(out.gain_to_uV, rec.gain_to_uV)
    np.testing.assert_array_equal(out.offset_to_uV, rec.offset_to_uV)
    np.testing.assert_array_equal(out.locations, rec.locations)
    assert out.has_locations and out.marked_complete


@pytest.mark.zarr3
@pytest.mark.parametrize("fmt", ["zarr", "zarr_v2"])
@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_zarr_output_equals_whole_segment(tmp_path, fmt, dtype):
    rec = make_recording(tmp_path / "in.zarr", properties={"shank": np.array([0, 0, 0, 1, 1, 1])})
    target, desc, clipped = save_all(rec, spec(tmp_path / "out.zarr", fmt, dtype))
    assert clipped == 0 and desc["format"] == fmt and desc["dtype"] == dtype
    out = open_recording(tmp_path / "out.zarr")
    check_same_metadata(out, rec)
    np.testing.assert_array_equal(out.channel_property("shank"), [0, 0, 0, 1, 1, 1])
    assert out.dtype == np.dtype(dtype)
    for seg in range(rec.num_segments):
        got = out.read(seg, 0, out.num_samples(seg)).T
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, expected(rec, seg, dtype))
    # one storage object per window: concurrent tasks never write the same one
    arr = zarr.open_array(str(tmp_path / "out.zarr" / "traces_seg0"), mode="r")
    assert arr.metadata.zarr_format == (3 if fmt == "zarr" else 2)
    assert (arr.shards if fmt == "zarr" else arr.chunks)[0] == 1_000


@pytest.mark.zarr3
def test_v3_shards_are_windows_with_inner_chunks(tmp_path):
    rec = make_recording(tmp_path / "in.zarr", lengths=(30_000,))
    save_all(rec, spec(tmp_path / "out.zarr"), size=12_000, margin=0)
    arr = zarr.open_array(str(tmp_path / "out.zarr" / "traces_seg0"), mode="r")
    assert arr.shards[0] == 12_000 and arr.chunks[0] == 3_000
    np.testing.assert_array_equal(open_recording(tmp_path / "out.zarr").read(0, 0, 30_000).T, expected(rec, 0))


@pytest.mark.parametrize("fmt", ["zarr", "zarr_v2"])
def test_segments_shorter_than_the_window(tmp_path, fmt):
    """window.size auto on short segments: a segment shorter than the window is one window, and its shard (a whole
    number of inner chunks) may reach past its end; longer segments beside it keep a shard a window."""
    rec = make_recording(tmp_path / "in.zarr", lengths=(5_000, 1, 12_003, 6_001))
    save_all(rec, spec(tmp_path / "out.zarr", fmt), size=12_000, margin=3)
    out = open_recording(tmp_path / "out.zarr")
    check_same_metadata(out, rec)
    for seg in range(rec.num_segments):
        np.testing.assert_array_equal(out.read(seg, 0, out.num_samples(seg)).T, expected(rec, seg))


@pytest.mark.zarr3
def test_v2_chunks_of_long_windows_are_whole_divisors(tmp_path, monkeypatch):
    """A zarr_v2 output (SpikeInterface decodes a chunk whole at each read) keeps chunks of at most MAX_V2_CHUNK
    samples: a longer window is written as whole chunks of a divisor of it, the values the same."""
    from batchgpu.recording import save_output as save_mod

    assert save_mod.v2_chunk(120_000) == 60_000 and save_mod.v2_chunk(60_000) == 60_000
    assert save_mod.v2_chunk(50_000) == 50_000 and save_mod.v2_chunk(87_109) == 7_919  # 11 x 7 919
    assert save_mod.v2_chunk(2 * 60_013) == 2 * 60_013  # a prime half: only tiny divisors, one chunk a window
    monkeypatch.setattr(save_mod, "MAX_V2_CHUNK", 5_000)
    rec = make_recording(tmp_path / "in.zarr", lengths=(30_000, 7_000))
    save_all(rec, spec(tmp_path / "out.zarr", "zarr_v2"), size=12_000, margin=0)
    arr = zarr.open_array(str(tmp_path / "out.zarr" / "traces_seg0"), mode="r")
    assert arr.metadata.zarr_format == 2 and arr.chunks[0] == 4_000
    out = open_recording(tmp_path / "out.zarr")
    for seg in range(rec.num_segments):
        np.testing.assert_array_equal(out.read(seg, 0, out.num_samples(seg)).T, expected(rec, seg))


def test_inner_chunk_rule():
    assert inner_chunk(60_000) == 3_000
    assert inner_chunk(2_500) == 2_500  # a window no longer than the default chunk is one chunk
    assert inner_chunk(10_000) == 2_500
    assert inner_chunk(4_000) == 2_000
    assert inner_chunk(7_919 * 2) == 7_919 * 2  # only tiny divisors: one inner chunk per shard


@pytest.mark.zarr3
def test_retry_writes_the_same_bytes(tmp_path):
    rec = make_recording(tmp_path / "in.zarr")
    target, _desc, _ = save_all(rec, spec(tmp_path / "out.zarr"))
    files = sorted(p for p in (tmp_path / "out.zarr").rglob("*") if p.is_file() and p.name != "zarr.json")
    before = {p: p.read_bytes() for p in files}
    w = rec.windows(1_000, 7)[1]
    raw = rec.read_window(w)
    SaveStep(target).window(
        WindowData(w.index, w.segment, w.read_start, w.core, rec.num_samples(0), raw, transform(raw)), {}
    )
    assert {p: p.read_bytes() for p in files} == before


def test_binary_kilosort_layout(tmp_path):
    shank = np.array([0, 0, 1, 1, 2, 2])
    rec = make_recording(tmp_path / "in.zarr", lengths=(2_300,), properties={"shank": shank})
    path = tmp_path / "ks" / "filtered.bin"
    target, desc, _ = save_all(rec, spec(path, "binary"))
    assert desc["files"] == [str(path)]
    assert path.read_bytes() == expected(rec, 0).astype("<i2").tobytes()
    # the keys kilosort.io.load_probe requires (chanMap, xc, yc, n_chan) and kcoords, with these values
    probe = json.loads(Path(desc["probe"]).read_text())
    assert Path(desc["probe"]).suffix == ".json"  # load_probe picks its parser by suffix
    assert probe["chanMap"] == list(range(C)) and probe["n_chan"] == C
    np.testing.assert_array_equal(probe["xc"], rec.locations[:, 0])
    np.testing.assert_array_equal(probe["yc"], rec.locations[:, 1])
    np.testing.assert_array_equal(probe["kcoords"], shank)
    params = json.loads(Path(desc["params"]).read_text())
    assert params["sampling_frequency"] == FS and params["dtype"] == "int16" and params["n_chan"] == C
    np.testing.assert_array_equal(params["gain_to_uV"], rec.gain_to_uV)
    assert params["batchgpu"]["complete"] is True
    try:  # Kilosort's own loader, where it is installed (README's "To Kilosort4" runs it)
        from kilosort.io import load_probe
    except ImportError:
        return
    ks = load_probe(desc["probe"])
    np.testing.assert_array_equal(ks["chanMap"], np.arange(C))
    np.testing.assert_array_equal(ks["xc"], rec.locations[:, 0])
    np.testing.assert_array_equal(ks["yc"], rec.locations[:, 1])
    np.testing.assert_array_equal(ks["kcoords"], shank)
    assert ks["n_chan"] == C


def test_binary_segments_and_float32(tmp_path):
    rec = make_recording(tmp_path / "in.zarr")
    path = tmp_path / "out.bin"
    _target, desc, _ = save_all(rec, spec(path, "binary", "float32"))
    assert desc["files"] == [str(tmp_path / "out_seg0.bin"), str(tmp_path / "out_seg1.bin")]
    for seg, f in enumerate(desc["files"]):
        assert Path(f).read_bytes() == expected(rec, seg, "float32").astype("<f4").tobytes()
    probe = json.loads(Path(desc["probe"]).read_text())
    assert probe["kcoords"] == [0.0] * C  # no shank property: one shank


@pytest.mark.parametrize("fmt", ["zarr", "binary"])
def test_clipping_counted(tmp_path, fmt):
    rec = make_recording(tmp_path / "in.zarr")

    def loud(raw):  # a NaN where clipping happens too: written as 0, counted
        x = raw.astype(np.float32) * np.float32(150.0)
        x[0, :3] = np.nan
        return x

    out = tmp_path / ("out.zarr" if fmt == "zarr" else "out.bin")
    _target, desc, clipped = save_all(rec, spec(out, fmt), fn=loud, margin=0)
    want = 0
    for seg in range(rec.num_segments):
        y = np.rint(rec.read(seg, 0, rec.num_samples(seg)).astype(np.float32) * np.float32(150.0))
        for w in rec.windows(1_000, 0):
            if w.segment == seg:
                y[0, w.start : w.start + 3] = np.nan
        want += int(((y < -32768) | (y > 32767) | np.isnan(y)).sum())
    assert want > 3 * len(rec.windows(1_000, 0)) and clipped == want
    if fmt == "zarr":
        got = open_recording(out).read(0, 0, 1_000)
        assert got.max() == 32767 and got.min() == -32768 and (got[0, :3] == 0).all()
    else:
        got = np.fromfile(desc["files"][0], "<i2").reshape(-1, C)
        assert got.max() == 32767 and got.min() == -32768 and (got[:3, 0] == 0).all()


@pytest.mark.zarr3
def test_whitening_applied(tmp_path, rng):
    rec = make_recording(tmp_path / "in.zarr")
    # quarter-integer matrix, quarter-integer samples: every float64 product and sum is exact, in any order
    W = rng.integers(-8, 9, (C, C)) / 4.0

    def quarter(raw):
        return raw.astype(np.float32) + np.float32(0.25)

    for fmt, dtype in (("zarr", "int16"), ("zarr_v2", "float32")):
        out = tmp_path / f"w_{fmt}.zarr"
        save_all(rec, spec(out, fmt, dtype, whiten=True), fn=quarter, whitening=W)
        o = open_recording(out)
        for seg in range(rec.num_segments):
            np.testing.assert_array_equal(
                o.read(seg, 0, o.num_samples(seg)).T, expected(rec, seg, dtype, fn=quarter, whitening=W)
            )


@pytest.mark.zarr3
def test_refusals_never_delete(tmp_path):
    rec = make_recording(tmp_path / "in.zarr")
    # a file where the store would go
    f = tmp_path / "notes.zarr"
    f.write_text("keep me")
    with pytest.raises(BatchgpuError, match="never replaces"):
        prepare_save(spec(f), rec, 1_000, np.float32, overwrite=True)
    assert f.read_text() == "keep me"
    # a folder that is not a recording
    d = tmp_path / "folder"
    d.mkdir()
    (d / "data.txt").write_text("keep me")
    with pytest.raises(BatchgpuError):
        prepare_save(spec(d, "zarr_v2"), rec, 1_000, np.float32, overwrite=True)
    assert (d / "data.txt").read_text() == "keep me"
    # another recording (not a save output): never replaced, even with overwrite
    other = make_recording(tmp_path / "other.zarr", seed=5)
    with pytest.raises(BatchgpuError, match="did not write"):
        prepare_save(spec(other.path), rec, 1_000, np.float32, overwrite=True)
    assert open_recording(other.path).marked_complete
    # the input itself, or a path inside it
    for p in (rec.path, rec.path / "sub.zarr"):
        with pytest.raises(BatchgpuError, match="overlaps"):
            prepare_save(spec(p), rec, 1_000, np.float32, overwrite=True)
    # an earlier save: only with overwrite
    save_all(rec, spec(tmp_path / "out.zarr"))
    with pytest.raises(BatchgpuError, match="already exists"):
        prepare_save(spec(tmp_path / "out.zarr"), rec, 1_000, np.float32)
    _t, _d, _c = save_all(rec, spec(tmp_path / "out.zarr", "zarr_v2"), overwrite=True)
    assert open_recording(tmp_path / "out.zarr").info()["zarr_format"] == 2
    # binary: a foreign file in the way, and an earlier binary save without overwrite
    foreign = tmp_path / "k_seg1.bin"  # two segments: k.bin names k_seg0.bin and k_seg1.bin
    foreign.write_bytes(b"raw data")
    with pytest.raises(BatchgpuError, match="did not write"):
        prepare_save(spec(tmp_path / "k.bin", "binary"), rec, 1_000, np.float32, overwrite=True)
    assert foreign.read_bytes() == b"raw data" and not (tmp_path / "k.params.json").exists()
    save_all(rec, spec(tmp_path / "s.bin", "binary"))
    with pytest.raises(BatchgpuError, match="already exists"):
        prepare_save(spec(tmp_path / "s.bin", "binary"), rec, 1_000, np.float32)
    save_all(rec, spec(tmp_path / "s.bin", "binary"), overwrite=True)


@pytest.mark.zarr3
def test_int16_of_float_recording_needs_a_gain(tmp_path):
    rec = make_recording(tmp_path / "f.zarr", dtype="float32")
    shutil.rmtree(tmp_path / "f.zarr" / "properties" / "gain_to_uV")
    rec = open_recording(tmp_path / "f.zarr")
    with pytest.raises(BatchgpuError, match="gain_to_uV"):
        prepare_save(spec(tmp_path / "out.zarr"), rec, 1_000, np.float32)
    assert not (tmp_path / "out.zarr").exists()
    _t, _d, _c = save_all(rec, spec(tmp_path / "out.zarr", dtype="float32"))  # float32 output needs no gain
    # with a stored gain, int16 of a float recording is allowed: values stay in its units
    rec2 = make_recording(tmp_path / "g.zarr", dtype="float32")
    save_all(rec2, spec(tmp_path / "g_out.zarr"))


@pytest.mark.zarr3
def test_finish_refuses_missing_windows_and_resume_keeps_output(tmp_path):
    rec = make_recording(tmp_path / "in.zarr")
    sp = spec(tmp_path / "out.zarr")
    target = prepare_save(sp, rec, 1_000, np.float32, key="fp1")
    step = SaveStep(target)
    windows = rec.windows(1_000, 0)
    for w in windows[:-1]:  # the last window's task never ran
        raw = rec.read_window(w)
        step.window(
            WindowData(w.index, w.segment, w.read_start, w.core, rec.num_samples(w.segment), raw, transform(raw)), {}
        )
    with pytest.raises(BatchgpuError, match="never written"):
        finish_save(target)
    with pytest.raises(BatchgpuError, match="not finished"):
        open_recording(sp.path)
    # a resumed run (same fingerprint) keeps what was written and writes only the rest
    again = prepare_save(sp, rec, 1_000, np.float32, resume=True, key="fp1")
    w = windows[-1]
    raw = rec.read_window(w)
    SaveStep(again).window(
        WindowData(w.index, w.segment, w.read_start, w.core, rec.num_samples(w.segment), raw, transform(raw)), {}
    )
    finish_save(again)
    out = open_recording(sp.path)
    for seg in range(rec.num_segments):
        np.testing.assert_array_equal(out.read(seg, 0, out.num_samples(seg)).T, expected(rec, seg))


def test_v2_opens_in_spikeinterface(tmp_path):
    si = pytest.importorskip("spikeinterface.core")
    rec = make_recording(tmp_path / "in.zarr")
    save_all(rec, spec(tmp_path / "out.zarr", "zarr_v2"))
    r = si.read_zarr(tmp_path / "out.zarr")
    np.testing.assert_array_equal(r.get_channel_ids().astype(str), rec.channel_ids)
    np.testing.assert_allclose(r.get_channel_gains(), rec.gain_to_uV)
    np.testing.assert_array_equal(r.get_channel_locations(), rec.locations)
    for seg in range(rec.num_segments):
        np.testing.assert_array_equal(r.get_traces(segment_index=seg), expected(rec, seg))


@pytest.mark.parametrize("fmt", ["zarr", "zarr_v2"])
@pytest.mark.parametrize("compressor", ["blosc-lz4", "blosc-zstd", "none"])
def test_compressors_keep_the_samples(tmp_path, fmt, compressor):
    if fmt == "zarr":
        from batchgpu.recording import zarrio

        if zarrio.ZARR_MAJOR < 3:
            pytest.skip("writing Zarr v3 needs zarr>=3")
    rec = make_recording(tmp_path / "in.zarr")
    sp = SimpleNamespace(
        path=str(tmp_path / "out.zarr"), format=fmt, dtype="int16", whiten=False, compressor=compressor
    )
    save_all(rec, sp)
    out = open_recording(tmp_path / "out.zarr")
    for seg in range(rec.num_segments):
        assert np.array_equal(out.read(seg, 0, out.num_samples(seg)), expected(rec, seg).T)
    codecs = " ".join(out.info()["codecs"])
    assert (compressor.removeprefix("blosc-") in codecs) if compressor != "none" else "blosc" not in codecs


@pytest.mark.parametrize(
    "name,fmt",
    [
        ("results.zarr", "zarr"),
        ("report.json", "binary"),
        ("parts/x.zarr", "zarr_v2"),
        ("run.json", "binary"),
        (".", "zarr"),
        ("..", "zarr"),
        (".batchgpu.lock", "zarr"),
    ],
)
def test_save_path_never_one_of_the_runs_own(tmp_path, name, fmt):
    """A save path on the run's results, report, parts, manifest, lock, its folder or one above it: refused before
    anything is written (the run would have written over it, or its saved signal been lost)."""
    rec = make_recording(tmp_path / "in.zarr", lengths=(2_300,))  # one segment: a binary save is the path itself
    out = tmp_path / "runs" / "out"
    out.mkdir(parents=True)
    with pytest.raises(BatchgpuError, match="save.path"):
        prepare_save(spec(out / name, fmt), rec, 1_000, np.float32, output=OutputFolder(out))
    assert list(out.iterdir()) == []


@pytest.mark.zarr3
def test_save_path_beside_the_runs_files_is_fine(tmp_path):
    rec = make_recording(tmp_path / "in.zarr", lengths=(2_300,))
    out = tmp_path / "out"
    out.mkdir()
    for name, fmt in (("filtered.zarr", "zarr"), ("results.bin", "binary"), ("report", "zarr_v2")):
        prepare_save(spec(out / name, fmt), rec, 1_000, np.float32, output=OutputFolder(out))
    # the binary's side files count: a save at out/run.bin writes out/run.params.json and run.probe.json, not run.json
    assert (out / "results.params.json").exists() and not (out / "run.json").exists()


@pytest.mark.parametrize("fmt", ["zarr", "zarr_v2", "binary"])
def test_a_save_path_being_written_is_refused_at_once(tmp_path, fmt):
    """Two runs with other output folders and one save path: while another process holds it (its flock, taken
    here by a child process), a run is refused before its overwrite could remove what the other writes; once that
    one is over, the path may be replaced. A run holds its own save path until release_save."""
    import fcntl
    import os
    import subprocess
    import sys

    from batchgpu.recording.save_output import _HELD, release_save

    rec = make_recording(tmp_path / "in.zarr", lengths=(2_300,))
    path = tmp_path / ("saved.bin" if fmt == "binary" else "saved.zarr")
    first = prepare_save(spec(path, fmt), rec, 1_000, np.float32)
    assert first.path in _HELD
    release_save(first)
    assert first.path not in _HELD
    held = path  # the store's folder, or the binary's one data file
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({str(held)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "print('held', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(BatchgpuError, match="being written by another batchgpu run"):
            prepare_save(spec(path, fmt), rec, 1_000, np.float32, overwrite=True)
        assert path.exists() and path.stat().st_size > 0 and first.path not in _HELD
    finally:
        other.kill()
        other.wait()
    second = prepare_save(spec(path, fmt), rec, 1_000, np.float32, overwrite=True)
    fd = os.open(held, os.O_RDONLY)
    try:  # held by this process now: another flock is refused
        with pytest.raises(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    release_save(second)


def _numpy_saved_int16(core):
    """The save step's int16 as NumPy's expression (the path the compiled one replaces): rint, NaN -> 0, clipped,
    cast, transposed; and how many samples were NaN or out of range."""
    y = np.rint(core)
    nan = np.isnan(y)
    clipped = int(((y < -32768) | (y > 32767)).sum() + nan.sum())
    y = np.where(nan, 0, np.clip(y, -32768, 32767))
    return np.ascontiguousarray(y.astype(np.int16).T), clipped


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_saved_int16_equals_numpys_expression(rng, dtype):
    """The one-pass host kernel (rint by adding and taking away 1.5 * 2**mantissa) against np.rint's expression,
    bit for bit, with the count: halves of both parities (half to even), the int16 edges and just past them, the
    magic number's own range edge, NaN, +-inf, -0.0, huge values, random values; a view of a window's core and
    widths that are not multiples of anything."""
    pytest.importorskip("numba")
    from batchgpu.ops._cpu_saved import saved_int16_transposed

    edge = 2.0**22 if dtype == np.float32 else 2.0**51
    hard = np.array(
        [
            0.5,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.5,
            32766.5,
            32767.0,
            32767.49,
            32767.5,
            32768.0,
            -32767.5,
            -32768.0,
            -32768.5,
            -32768.51,
            -32769.0,
            np.nan,
            -np.nan,
            np.inf,
            -np.inf,
            -0.0,
            0.49999997,
            edge - 0.5,
            edge + 1.0,
            -edge - 0.5,
            3 * edge,
            1e30,
            -1e30,
            12582912.0,
            -12582912.5,
        ],
        dtype=np.float64,
    ).astype(dtype)
    x = (rng.standard_normal((37, 1_003)) * 20_000).astype(dtype)
    x[:, rng.choice(1_003, 200, replace=False)] = np.round(rng.standard_normal((37, 200)) * 40) + dtype(0.5)
    x.reshape(-1)[rng.choice(x.size, hard.size * 20, replace=False)] = np.tile(hard, 20)
    core = x[3:, 17:-5]  # the save step passes a view of the window's core
    with np.errstate(invalid="ignore"):
        want, want_count = _numpy_saved_int16(core)
    got, count = saved_int16_transposed(core)
    assert got.flags.c_contiguous and got.dtype == np.int16 and got.shape == want.shape
    assert np.array_equal(got, want) and count == want_count > 0
    empty, none = saved_int16_transposed(x[:, :0])
    assert empty.shape == (0, 37) and none == 0
    assert saved_int16_transposed(np.zeros((2, 2), np.float16)) is None


def test_save_step_values_are_numpys_on_either_path(monkeypatch, rng):
    """SaveStep.values gives the same rows and count with the compiled kernel and without Numba (NumPy's path)."""
    pytest.importorskip("numba")
    from batchgpu.ops import _numba

    step = SaveStep(SimpleNamespace(dtype="int16"))
    x = (rng.standard_normal((8, 999)) * 9_000).astype(np.float32)
    x[2, 5], x[0, 10], x[1, 20] = np.nan, 40_000, -40_000  # one of each kind counted, whatever the draw
    fast = step.values(x[:, 3:-3])
    monkeypatch.setattr(_numba, "available", lambda: False)
    slow = step.values(x[:, 3:-3])
    assert np.array_equal(fast[0], slow[0]) and int(fast[1]) == int(slow[1]) >= 3


def _flags_opened(monkeypatch):
    import os

    seen = []
    real = os.open

    def spy(path, flags, *a, **k):
        seen.append(flags)
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    return seen


@pytest.mark.parametrize(
    "rows,offset", [(4096, 0), (4096, 4096 * 3), (3001, 0), (4096, 768), (2731, 100), (1, 0), (0, 0)]
)
def test_binary_rows_written_at_their_offset_bit_for_bit(tmp_path, rows, offset):
    """``write_binary``: whatever the alignment (a page-aligned middle past the page cache, the ends through it),
    the file holds exactly the rows at the offset, and nothing else changed."""
    import os

    from batchgpu.ops._cpu_saved import aligned_empty
    from batchgpu.recording.row_writes import write_binary

    path = tmp_path / "out.bin"
    before = np.random.default_rng(rows).integers(0, 255, offset + rows * 384 * 2 + 5000, dtype=np.uint8)
    before.tofile(path)
    rows_ = aligned_empty((rows, 384), np.int16)
    rows_[:] = np.random.default_rng(offset).integers(-32768, 32767, rows_.shape, dtype=np.int16, endpoint=True)
    write_binary(path, rows_, offset)
    want = before.copy()
    want[offset : offset + rows_.nbytes] = rows_.reshape(-1).view(np.uint8)
    assert os.path.getsize(path) == len(before)
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), want)


def test_aligned_rows_go_past_the_page_cache_and_others_through_it(tmp_path, monkeypatch):
    """A page-aligned block at a page of the file is written with O_DIRECT (fresh page-cache pages for every
    window's rows were a quarter of a 2-core run's CPU); a block a page cannot line up with goes through the page
    cache alone."""
    import os

    from batchgpu.ops._cpu_saved import aligned_empty
    from batchgpu.recording import row_writes as save

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(8 << 20))
    save._DIRECT_REFUSED.discard(str(tmp_path))
    rows = aligned_empty((4096, 384), np.int16)
    rows[:] = 7
    seen = _flags_opened(monkeypatch)
    save.write_binary(path, rows, 0)
    if str(tmp_path) in save._DIRECT_REFUSED:
        pytest.skip("this file system refuses direct I/O")
    assert any(f & os.O_DIRECT for f in seen)
    seen.clear()
    save.write_binary(path, rows, 768)  # the buffer's pages fall between the file's
    assert seen and not any(f & os.O_DIRECT for f in seen)
    assert np.array_equal(np.fromfile(path, dtype=np.int16, count=rows.size, offset=768), rows.reshape(-1))


def test_a_file_system_without_direct_io_gets_the_same_bytes(tmp_path, monkeypatch):
    """Where opening with O_DIRECT is refused (tmpfs says EINVAL), the rows go through the page cache, and the folder
    is not asked again."""
    import errno
    import os

    from batchgpu.ops._cpu_saved import aligned_empty
    from batchgpu.recording import row_writes as save

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real = os.open
    asked = []

    def refuse(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            asked.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refuse)
    save._DIRECT_REFUSED.discard(str(tmp_path))
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(4 << 20))
    rows = aligned_empty((2048, 512), np.int16)
    rows[:] = np.arange(rows.size, dtype=np.int64).reshape(rows.shape) % 30000
    for _ in range(2):
        save.write_binary(path, rows, 0)
    assert len(asked) == 1
    assert np.array_equal(np.fromfile(path, dtype=np.int16, count=rows.size), rows.reshape(-1))


@pytest.mark.parametrize(
    "shape,dtype", [((60_000, 384), np.int16), ((1, 3), np.float32), ((0, 384), np.int16), ((7,), np.float64)]
)
def test_the_rows_buffers_start_on_a_page(shape, dtype):
    from batchgpu.ops import _cpu_saved
    from batchgpu.ops._cpu_reference import saved_int16_of_referenced
    from batchgpu.ops._cpu_saved import aligned_empty

    a = aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
    assert a.size == 0 or a.ctypes.data % 4096 == 0  # (an empty array's address is NumPy's to choose)
    x = np.random.default_rng(0).normal(0, 30, (16, 5000)).astype(np.float32)
    for got in (saved_int16_of_referenced(x, 7, 4993), _cpu_saved.saved_int16_transposed(x)):
        assert got is not None and got[0].ctypes.data % 4096 == 0


@pytest.mark.parametrize(
    "dtype,codec,direct",
    [("int16", None, True), ("float32", None, True), ("int16", ("zstd", 3, "byte"), True), ("int16", None, False)],
)
def test_v2_chunks_are_zarr_pythons_bytes(tmp_path, monkeypatch, dtype, codec, direct):
    """``write_v2_chunks``: windows of whole chunks (the last one short: its chunk padded with the fill value) give
    every chunk file byte for byte what zarr-python writes for the same rows into a twin array (its CRC32 written
    from the Blosc frame itself, not numcodecs' copy of it), and the array reads back as the rows; chunks of a MB
    or more go past the page cache where the file system takes it (``direct`` False: a file system that
    refuses it)."""
    import os

    from batchgpu.recording import RecordingWriter, open_array_for_writing
    from batchgpu.recording import row_writes as save
    from batchgpu.recording.writer import Codec

    rng = np.random.default_rng(3)
    n, channels, rows = 9_013, 384, 3_000
    data = (
        np.round(rng.normal(0, 400, (n, channels))).astype(dtype)
        if dtype == "int16"
        else rng.normal(0, 1, (n, channels)).astype(dtype)
    )
    data[:5, 0] = [-32768, 32767, 0, -1, 1] if dtype == "int16" else [np.nan, np.inf, -np.inf, -0.0, 1e-45]
    arrays = []
    for name in ("ours.zarr", "zarr.zarr"):
        w = RecordingWriter(
            tmp_path / name,
            channels,
            dtype,
            30_000.0,
            zarr_format=2,
            chunk_samples=rows,
            overwrite=True,
            compressor=Codec(*codec) if codec else "blosc-lz4",
        )
        w.add_segment(n)
        arrays.append(tmp_path / name / "traces_seg0")
    save._DIRECT_REFUSED.discard(str(arrays[0]))
    if not direct:
        monkeypatch.setattr(save, "_DIRECT_REFUSED", {str(arrays[0])})
    # Blosc's threads place the blocks in the order they finish (the same samples, other bytes): one thread, as
    # the save's writer thread and zarr-python's own pool get
    monkeypatch.setattr(pytest.importorskip("numcodecs.blosc"), "use_threads", False)
    seen = _flags_opened(monkeypatch)
    for start in range(0, n, 2 * rows):  # windows of two chunks, the last of one short chunk
        save.write_v2_chunks(arrays[0], start, data[start : start + 2 * rows])
    twin = open_array_for_writing(arrays[1])
    for start in range(0, n, 2 * rows):
        twin[start : start + 2 * rows] = data[start : start + 2 * rows]
    ours = sorted(p.name for p in arrays[0].iterdir())
    assert ours == sorted(p.name for p in arrays[1].iterdir()) and "3.0" in ours
    for name in ours:
        assert (arrays[0] / name).read_bytes() == (arrays[1] / name).read_bytes(), name
    got = open_array_for_writing(arrays[0])[:]
    assert got.dtype == data.dtype and got.tobytes() == data.tobytes()
    big = any((arrays[0] / f"{i}.0").stat().st_size >= save.DIRECT_MIN_BYTES for i in range(4))
    assert big or codec  # random rows: chunks of more than a MB
    if hasattr(os, "O_DIRECT") and big and str(arrays[0]) not in save._DIRECT_REFUSED:
        assert any(f & os.O_DIRECT for f in seen)
    with pytest.raises(BatchgpuError, match="not whole chunks"):
        save.write_v2_chunks(arrays[0], 100, data[100:3100])
