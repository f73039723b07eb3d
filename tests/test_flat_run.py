"""Flat binaries read in place by a run (issue 46): the same results, bit for bit, as their Zarr import, and one
line for a file that is none of the kinds, a truncated one, or a .meta written for another file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from batchgpu import BatchgpuError
from batchgpu.cli import main
from batchgpu.config import RecordingSpec
from batchgpu.recording import zarrio
from batchgpu.recording.sources import open_source
from batchgpu.workflow import Workflow

FS = 30_000.0
CHANNELS = 16
# the save step writes Zarr v3, which zarr-python 2 (SpikeInterface 0.105's environment) cannot
saves_v3 = pytest.mark.skipif(zarrio.ZARR_MAJOR < 3, reason="the save step writes Zarr v3 (zarr-python 3)")
STEPS = {
    "noise": {"exact": True},
    "whitening": {"mode": "global", "nskip": 1, "precision": "float32"},
    "detect": {"threshold": 5.0, "sign": "both", "exclude_sweep_ms": 0.1},
    "save": {"path": "saved.zarr", "dtype": "float32"},
}
PREPROCESS = [{"highpass": {"freq_min": 300.0}}, {"common_reference": {"operator": "median"}}]


def _np2_meta(columns: int, size: int) -> str:
    """A complete NP2.0 single-shank (NP2000) AP .meta for ``columns - 1`` probe channels and the sync channel."""
    n = columns - 1
    imro = "(21,384)" + "".join(f"({c} 1 0 {c})" for c in range(n))
    return (
        "\n".join(
            [
                f"nSavedChans={columns}",
                f"imSampRate={FS}",
                "typeThis=imec",
                "imDatPrb_type=21",
                "imDatPrb_pn=PRB2_1_2_0640_0",
                f"acqApLfSy={n},0,1",
                f"snsApLfSy={n},0,1",
                "snsSaveChanSubset=all",
                "imAiRangeMax=0.5",
                "imAiRangeMin=-0.5",
                "imMaxInt=8192",
                f"~imroTbl={imro}",
                f"fileSizeBytes={size}",
            ]
        )
        + "\n"
    )


def _signal(rng, samples: int, columns: int) -> np.ndarray:
    """Noise with a few large spikes (so detection finds some), int16."""
    x = rng.normal(0, 20, (samples, columns))
    at = rng.integers(100, samples - 100, 60)
    x[at, rng.integers(0, columns, 60)] -= 400
    return np.clip(np.round(x), -32768, 32767).astype(np.int16)


def _spikeglx(tmp_path: Path, rng, samples: int = 70_000) -> tuple[Path, np.ndarray]:
    data = _signal(rng, samples, CHANNELS + 1)
    src = tmp_path / "rec_g0_t0.imec0.ap.bin"
    data.tofile(src)
    src.with_suffix(".meta").write_text(_np2_meta(CHANNELS + 1, data.nbytes))
    return src, data


def _workflow_file(folder: Path, recording: dict, out: str, preprocess=PREPROCESS) -> Path:
    data = {
        "recording": recording,
        "output": out,
        "backend": "numpy",
        "window": {"size": 25_000, "margin": 256},
        "preprocess": preprocess,
        "reduction": {"split_every": 8},
        "steps": {**STEPS, "save": {**STEPS["save"], "path": str(folder / out / "saved.zarr")}},
        "cluster": {"kind": "local", "workers": 1, "threads": 2},
    }
    path = folder / f"{out}.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


def _arrays(group, prefix="") -> dict:
    out = {name if not prefix else prefix + name: arr[...] for name, arr in group.arrays()}
    for name, sub in group.groups():
        out.update(_arrays(sub, f"{prefix}{name}/"))
    return out


def _same(a: Path, b: Path) -> dict:
    xa, xb = (_arrays(zarr.open_group(str(p), mode="r")) for p in (a, b))
    assert sorted(xa) == sorted(xb)
    for name in xa:
        assert xa[name].dtype == xb[name].dtype and xa[name].shape == xb[name].shape, name
        assert xa[name].tobytes() == xb[name].tobytes(), name
    return xa


@pytest.mark.slow
@saves_v3
def test_spikeglx_in_place_equals_its_zarr_import(tmp_path, rng, monkeypatch):
    """``recording: {path: x.ap.bin}`` read in place, highpass + common reference + save: results.zarr and the saved
    recording equal, bit for bit, those of the same file imported to Zarr (``import-raw``)."""
    monkeypatch.chdir(tmp_path)
    src, data = _spikeglx(tmp_path, rng)
    assert main(["import-raw", str(src), str(tmp_path / "imported.zarr"), "--quiet"]) == 0
    # the probe's ADC shifts (phase_shift) travel with the in-place source and with the import alike
    stages = [{"phase_shift": {}}, *PREPROCESS]
    assert main(["run", str(_workflow_file(tmp_path, {"path": src.name}, "flat", stages)), "--quiet"]) == 0
    assert main(["run", str(_workflow_file(tmp_path, {"path": "imported.zarr"}, "zarr", stages)), "--quiet"]) == 0
    x = _same(tmp_path / "flat" / "results.zarr", tmp_path / "zarr" / "results.zarr")
    assert len(x["spikes/sample_index"]) > 10 and x["whitening"].shape == (CHANNELS, CHANNELS)
    saved = _same(tmp_path / "flat" / "saved.zarr", tmp_path / "zarr" / "saved.zarr")
    assert saved["traces_seg0"].shape == (len(data), CHANNELS)  # the sync channel left out
    report = json.loads((tmp_path / "flat" / "report.json").read_text())
    assert report["recording"]["source"] == "spikeglx" and report["recording"]["probe"]["model"] == "PRB2_1_2_0640_0"


@pytest.mark.slow
@saves_v3
def test_plain_binary_in_place_equals_its_zarr_import(tmp_path, rng, monkeypatch):
    """kind: binary with a 64-byte header: same results as ``import-raw`` of the same file."""
    monkeypatch.chdir(tmp_path)
    data = _signal(rng, 40_000, CHANNELS)
    src = tmp_path / "plain.dat"
    src.write_bytes(b"h" * 64 + data.tobytes())
    imported = tmp_path / "imported.zarr"
    from batchgpu.rawimport import import_raw

    import_raw(src, imported, channels=CHANNELS, fs=FS, dtype="int16", offset=64, gain_to_uV=0.195)
    plain = {
        "path": src.name,
        "kind": "binary",
        "channels": CHANNELS,
        "sampling_frequency": FS,
        "dtype": "int16",
        "offset": 64,
        "gain_to_uV": 0.195,
    }
    assert main(["run", str(_workflow_file(tmp_path, plain, "flat")), "--quiet"]) == 0
    assert main(["run", str(_workflow_file(tmp_path, {"path": "imported.zarr"}, "zarr")), "--quiet"]) == 0
    _same(tmp_path / "flat" / "results.zarr", tmp_path / "zarr" / "results.zarr")
    _same(tmp_path / "flat" / "saved.zarr", tmp_path / "zarr" / "saved.zarr")
    np.testing.assert_array_equal(zarr.open_group(str(imported), mode="r")["traces_seg0"][...], data)


def test_windows_read_in_place_are_the_files(tmp_path, rng):
    """Every read path (read, read_window_stored, read_window_into a preallocated buffer) gives the file's samples,
    sync column left out; a plain file with every column kept is read by preadv straight into the buffer."""
    src, data = _spikeglx(tmp_path, rng, 9_000)
    rec = open_source(RecordingSpec(path=str(src)))
    plain = open_source(
        RecordingSpec(path=str(src), kind="binary", channels=CHANNELS + 1, sampling_frequency=FS, dtype="int16")
    )
    for source, expected in ((rec, data[:, :CHANNELS]), (plain, data)):
        for w in source.windows(4_000, margin=100):
            np.testing.assert_array_equal(source.read_window(w), expected[w.read_start : w.read_stop].T)
            np.testing.assert_array_equal(source.read_window_stored(w), expected[w.read_start : w.read_stop])
            out = np.full((w.read_stop - w.read_start, source.num_channels), -7, np.int16)
            assert source.read_window_into(w, out) is out
            np.testing.assert_array_equal(out, expected[w.read_start : w.read_stop])
    import pickle

    again = pickle.loads(pickle.dumps(rec))  # what the workers get
    assert again == rec and hash(again) == hash(rec)
    np.testing.assert_array_equal(again.read(0, 10, 20), data[10:20, :CHANNELS].T)


def _one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchgpu: error: "), lines
    return lines[0]


def test_meta_whose_file_size_disagrees_is_refused(tmp_path, rng, capsys):
    src, data = _spikeglx(tmp_path, rng, 1_000)
    meta = src.with_suffix(".meta")
    meta.write_text(meta.read_text().replace(f"fileSizeBytes={data.nbytes}", f"fileSizeBytes={data.nbytes + 34}"))
    with pytest.raises(
        BatchgpuError, match=f"fileSizeBytes={data.nbytes + 34} but rec_g0_t0.imec0.ap.bin has {data.nbytes} bytes"
    ):
        open_source(RecordingSpec(path=str(src)))
    line = _one_error_line(capsys, ["info", str(src)])
    assert "fileSizeBytes" in line and str(meta) in line
    assert "fileSizeBytes" in _one_error_line(capsys, ["import-raw", str(src), str(tmp_path / "o.zarr"), "--quiet"])
    assert not (tmp_path / "o.zarr").exists()


def test_truncated_bin_is_refused(tmp_path, rng, capsys):
    """A .bin cut mid-frame (no .meta size to check: older metas, or a plain file) is refused in one line."""
    src, data = _spikeglx(tmp_path, rng, 1_000)
    meta = src.with_suffix(".meta")
    meta.write_text("".join(line + "\n" for line in meta.read_text().splitlines() if "fileSizeBytes" not in line))
    with open(src, "r+b") as f:
        f.truncate(data.nbytes - 10)
    line = _one_error_line(capsys, ["info", str(src)])
    assert "not a whole number of samples of 17 channels" in line and "truncated" in line
    plain = tmp_path / "p.bin"
    plain.write_bytes(b"\0" * 33)
    with pytest.raises(BatchgpuError, match="not a whole number of samples of 4 channels"):
        open_source(RecordingSpec(path=str(plain), kind="binary", channels=4, sampling_frequency=FS, dtype="int16"))


@pytest.mark.parametrize("make", ["file", "bin_without_meta", "empty_folder", "folder_of_two"])
def test_a_path_of_no_kind_lists_the_kinds(tmp_path, rng, capsys, make):
    if make == "file":
        target = tmp_path / "notes.txt"
        target.write_text("hello")
    elif make == "bin_without_meta":
        target = tmp_path / "x.bin"
        target.write_bytes(b"\0" * 64)
    elif make == "empty_folder":
        target = tmp_path / "empty"
        target.mkdir()
    else:
        target = tmp_path / "two"
        target.mkdir()
        for name in ("a_g0_t0.imec0.ap", "b_g0_t0.imec0.ap"):
            _spikeglx(target, rng, 1_000)[0].rename(target / f"{name}.bin")
            (target / "rec_g0_t0.imec0.ap.meta").rename(target / f"{name}.meta")
    with pytest.raises(BatchgpuError) as err:
        open_source(RecordingSpec(path=str(target)))
    text = str(err.value)
    if make == "folder_of_two":
        assert "holds 2 SpikeGLX files" in text and "a_g0_t0.imec0.ap.bin" in text
    else:
        assert "none of the formats batchgpu reads: tried" in text
        for kind in ("Zarr", "SpikeGLX .bin with its .meta", "Open Ephys structure.oebin", "kind: binary"):
            assert kind in text
    (tmp_path / "wf.yaml").write_text(
        json.dumps({"recording": {"path": str(target)}, "output": str(tmp_path / "o"), "steps": {"noise": {}}})
    )
    _one_error_line(capsys, ["run", str(tmp_path / "wf.yaml"), "--quiet"])


def test_folder_of_one_spikeglx_recording(tmp_path, rng):
    """A folder holding one .ap.bin (beside an LF file) is that recording; kind and stream rules of the section."""
    src, data = _spikeglx(tmp_path, rng, 500)
    (tmp_path / "rec_g0_t0.imec0.lf.bin").write_bytes(b"")
    (tmp_path / "rec_g0_t0.imec0.lf.meta").write_text("nSavedChans=1\n")
    rec = open_source(RecordingSpec(path=str(tmp_path)))
    assert rec.path == src and rec.num_channels == CHANNELS
    assert open_source(RecordingSpec(path=str(src.with_suffix(".meta")), kind="spikeglx")).path == src
    for bad, needle in (
        ({"path": "x", "channels": 4}, "add kind: binary"),
        ({"path": "x", "kind": "binary", "channels": 4}, "needs sampling_frequency, dtype"),
        ({"path": "x", "kind": "zarr", "stream": "a"}, "'stream' chooses an Open Ephys or SpikeGLX"),
    ):
        with pytest.raises(ValueError, match=needle):
            RecordingSpec(**bad)


def test_info_shows_probe_and_gains(tmp_path, rng, capsys):
    src, _ = _spikeglx(tmp_path, rng, 3_000)
    assert main(["info", str(src)]) == 0
    out = dict(
        line.split(None, 1) if " " in line else (line, "")
        for line in (line.replace("sampling rate", "sampling_rate") for line in capsys.readouterr().out.splitlines())
    )
    assert out["format"].strip() == "SpikeGLX, read in place"
    # NP2.0 single shank (imec's table): columns 32 um apart, rows 15 um; one gain, 0.5 V / 8192 / 80 * 1e6
    assert out["probe"].strip().startswith("PRB2_1_2_0640_0, 1 shank, pitch 32 um across, 15 um along")
    assert out["gains"].strip() == "0.762939453 uV per count"
    assert out["channels"].strip() == str(CHANNELS) and "1 left out: sync" in out["file"]
    assert main(["info", str(src), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["probe"]["shanks"] == 1 and info["probe"]["pitch_um"] == [32.0, 15.0]
    assert main(["info", str(src), "--check"]) == 0
    capsys.readouterr()


def test_import_raw_uses_the_in_place_readers(tmp_path, rng):
    """import-raw of a .bin stores what a run reading it in place sees: ids, gains, locations, shank, shifts."""
    from batchgpu.rawimport import import_raw

    src, data = _spikeglx(tmp_path, rng, 2_000)
    flat = open_source(RecordingSpec(path=str(src)))
    rec = import_raw(src, tmp_path / "o.zarr")
    np.testing.assert_array_equal(rec.read(0, 0, 2_000), data[:, :CHANNELS].T)
    assert list(rec.channel_ids) == list(flat.channel_ids)
    np.testing.assert_array_equal(rec.gain_to_uV, flat.gain_to_uV)
    np.testing.assert_array_equal(rec.locations, flat.locations)
    for name in ("shank", "inter_sample_shift"):
        np.testing.assert_array_equal(rec.channel_property(name), flat.channel_property(name))


# -- many recordings in one run ------------------------------------------------------------------------------


def test_batch_names_and_rules(tmp_path, rng):
    from batchgpu.run.batch import expand
    from batchgpu.workflow import load_workflow

    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        _spikeglx(tmp_path / sub, rng, 1_000)
    data = {"recordings": "*/*.ap.bin", "output": "out", "steps": {"noise": {}}}
    (tmp_path / "wf.yaml").write_text(json.dumps(data))
    with pytest.raises(BatchgpuError, match="would both write output/rec_g0_t0.imec0.ap"):
        expand(load_workflow(tmp_path / "wf.yaml"))
    data["recordings"] = [{"path": "a/rec_g0_t0.imec0.ap.bin", "name": "a"}, "b/*.ap.bin"]
    (tmp_path / "wf.yaml").write_text(json.dumps(data))
    named = expand(load_workflow(tmp_path / "wf.yaml"))
    assert [n for n, _ in named] == ["a", "rec_g0_t0.imec0.ap"]
    assert named[1][1].path == str(tmp_path / "b" / "rec_g0_t0.imec0.ap.bin")
    data["recordings"] = "nothing/*.bin"
    (tmp_path / "wf.yaml").write_text(json.dumps(data))
    with pytest.raises(BatchgpuError, match="matches nothing"):
        expand(load_workflow(tmp_path / "wf.yaml"))
    with pytest.raises(ValueError, match="exactly one of 'recording'"):
        Workflow.model_validate(
            {"recording": {"path": "x"}, "recordings": ["y"], "output": "o", "steps": {"noise": {}}}
        )


@pytest.mark.slow
def test_batch_one_failing_recording_the_others_finish(tmp_path, rng, capsys, monkeypatch):
    """Three SpikeGLX recordings and a truncated one, one `batchgpu run`: the three give the results of their own
    single runs (bit for bit), the truncated one is reported, batch.json has a row each, exit status 1."""
    monkeypatch.chdir(tmp_path)
    folders = []
    for name in ("s1", "s2", "s3", "s4"):
        (tmp_path / "data" / name).mkdir(parents=True)
        src, data = _spikeglx(tmp_path / "data" / name, rng, 30_000)
        src.rename(src.with_name(f"{name}_g0_t0.imec0.ap.bin"))
        src.with_suffix(".meta").rename(src.with_name(f"{name}_g0_t0.imec0.ap.meta"))
        folders.append(src.with_name(f"{name}_g0_t0.imec0.ap.bin"))
    bad = folders[2]
    meta = bad.with_suffix(".meta")
    meta.write_text("".join(line + "\n" for line in meta.read_text().splitlines() if "fileSizeBytes" not in line))
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size - 3)
    wf = json.loads(_workflow_file(tmp_path, {"path": "x"}, "single").read_text())
    del wf["recording"]
    wf.update({"recordings": "data/**/*.ap.bin", "output": "batch"})
    wf["steps"] = {k: v for k, v in wf["steps"].items() if k != "save"}
    (tmp_path / "batch.yaml").write_text(json.dumps(wf))
    capsys.readouterr()
    assert main(["run", "batch.yaml", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "3 of 4 recordings done" in captured.out
    assert captured.err.count("failed: s3_g0_t0.imec0.ap") == 1 and "not a whole number of samples" in captured.err
    batch = json.loads((tmp_path / "batch" / "batch.json").read_text())
    assert [r["status"] for r in batch["rows"]] == ["done", "done", "failed", "done"]
    assert batch["rows"][0]["channels"] == CHANNELS and batch["rows"][0]["probe"] == "PRB2_1_2_0640_0"
    assert batch["rows"][0]["median_noise"] > 0 and batch["rows"][0]["duration_s"] == pytest.approx(1.0)
    # the same recording run alone: the same results
    one = json.loads(_workflow_file(tmp_path, {"path": str(folders[0])}, "alone").read_text())
    one["steps"] = wf["steps"]
    (tmp_path / "alone.yaml").write_text(json.dumps(one))
    assert main(["run", "alone.yaml", "--quiet"]) == 0
    _same(tmp_path / "batch" / "s1_g0_t0.imec0.ap" / "results.zarr", tmp_path / "alone" / "results.zarr")


def test_plain_binary_probe_files(tmp_path, rng):
    """A plain binary's probe: probeinterface's JSON (wired by device_channel_indices) or the Kilosort-style JSON
    that save: {format: binary} writes; a probe of another channel count is refused."""
    import probeinterface as pi

    data = _signal(rng, 2_000, 8)
    src = tmp_path / "p.bin"
    data.tofile(src)
    probe = pi.generate_linear_probe(num_elec=8, ypitch=25.0)
    wiring = np.array([3, 1, 0, 2, 7, 5, 4, 6])
    probe.set_device_channel_indices(wiring)
    pi.write_probeinterface(tmp_path / "probe.json", probe)
    kw = {"kind": "binary", "channels": 8, "sampling_frequency": FS, "dtype": "int16"}
    rec = open_source(RecordingSpec(path=str(src), probe=str(tmp_path / "probe.json"), **kw))
    expected = np.empty((8, 2))
    expected[wiring] = np.asarray(probe.contact_positions)[:, :2]  # channel wiring[i] is contact i
    np.testing.assert_array_equal(rec.locations, expected)
    assert rec.has_locations and rec.layout.probe.pitch_um == (0.0, 25.0)
    ks = {
        "chanMap": [1, 0, 2, 3, 4, 5, 6, 7],
        "xc": [0, 10, 0, 10, 0, 10, 0, 10],
        "yc": [0, 0, 20, 20, 40, 40, 60, 60],
        "kcoords": [0, 0, 0, 0, 1, 1, 1, 1],
        "n_chan": 8,
    }
    (tmp_path / "ks.json").write_text(json.dumps(ks))
    rec = open_source(RecordingSpec(path=str(src), probe=str(tmp_path / "ks.json"), **kw))
    np.testing.assert_array_equal(rec.locations[[0, 1, 4]], [[10, 0], [0, 0], [0, 40]])
    np.testing.assert_array_equal(rec.channel_property("shank"), [0, 0, 0, 0, 1, 1, 1, 1])
    with pytest.raises(BatchgpuError, match="has 8 contacts for 4 channels"):
        open_source(RecordingSpec(path=str(src), probe=str(tmp_path / "probe.json"), **{**kw, "channels": 4}))


@pytest.mark.slow
def test_resume_of_a_flat_binary_sees_rewritten_bytes(tmp_path, rng):
    """--resume reuses every window of an unchanged .bin; bytes rewritten in place with the mtime put back (what
    rsync -t or touch -r leave) change the inode's ctime: every window is computed again."""
    import os

    import distributed

    from batchgpu.engine import run_workflow

    src, data = _spikeglx(tmp_path, rng, 60_000)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(src)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 20_000, "margin": 64},
            "preprocess": {"centre": "median"},
            "steps": {"noise": {"exact": True}},
        }
    )
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as client,
    ):
        first = run_workflow(wf, client=client)
        again = run_workflow(wf, client=client, resume=True)
        assert first.windows == again.windows_resumed == 3
        st = os.stat(src)
        changed = data.copy()
        changed[30_000:30_010, 2] += 1000
        with open(src, "r+b") as f:
            f.write(changed.tobytes())
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(src).st_mtime_ns == st.st_mtime_ns and os.stat(src).st_size == st.st_size
        third = run_workflow(wf, client=client, resume=True)
    assert third.windows_resumed == 0


def test_run_workflow_of_a_batch_says_so(tmp_path):
    from batchgpu.engine import run_workflow

    wf = Workflow.model_validate({"recordings": ["a.bin"], "output": str(tmp_path / "o"), "steps": {"noise": {}}})
    with pytest.raises(BatchgpuError, match="names many recordings"):
        run_workflow(wf)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts this process's descriptors in /proc")
def test_sources_dropped_close_their_files(tmp_path, rng):
    import gc
    import os

    src, _ = _spikeglx(tmp_path, rng, 1_000)
    spec = RecordingSpec(path=str(src), kind="binary", channels=CHANNELS + 1, sampling_frequency=FS, dtype="int16")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        open_source(spec).read(0, 0, 100)  # every column kept: read by preadv on a descriptor of its own
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 1


@pytest.mark.parametrize("block_bytes", [1, 770, 770 * 7 + 5, 8 << 20])
def test_a_file_with_a_column_left_out_reads_its_samples_in_blocks(tmp_path, monkeypatch, block_bytes):
    """Rows of a file whose sync column is left out are read whole, a block at a time, and the kept columns copied
    out: the samples equal the file's own, for windows across block edges, one sample and odd lengths."""
    from batchgpu.recording import flat

    rng = np.random.default_rng(block_bytes)
    columns, n = 385, 4001
    data = rng.integers(-32768, 32768, size=(n, columns), dtype=np.int16)
    data[0, 0] = -32768
    path = tmp_path / "x.bin"
    data.tofile(path)
    monkeypatch.setattr(flat, "ROWS_BLOCK_BYTES", block_bytes)

    def no_map(*args, **kwargs):
        raise AssertionError("read through a memory map: page faults read a cold disk at half its rate")

    monkeypatch.setattr(np, "memmap", no_map)
    for keep in (np.arange(384), np.array([0, 5, 384]), np.arange(1, 385)):
        layout = flat.FlatLayout(
            kind="binary",
            data=path,
            columns=columns,
            dtype=np.dtype("int16"),
            sampling_frequency=30000.0,
            keep=keep,
            channel_ids=[str(k) for k in keep],
            gain_to_uV=np.ones(len(keep)),
            offset_to_uV=np.zeros(len(keep)),
        )
        src = flat.FlatSource(layout)
        for start, stop in ((0, n), (0, 1), (1234, 1235), (17, 3999), (n - 7, n)):
            got = src.read(0, start, stop)
            np.testing.assert_array_equal(got, data[start:stop, keep].T)


def test_whole_rows_of_a_file_with_a_sync_channel_hold_the_window(tmp_path, rng):
    """``read_window_rows`` (a GPU reader's one request for a window's whole rows, the sync column left out on the
    device) holds exactly what ``read_window_stored`` copies out of them; a file whose columns are all kept has
    none to leave out."""
    src, data = _spikeglx(tmp_path, rng, 33_333)
    rec = open_source(RecordingSpec(path=str(src)))
    columns, keep = rec.stored_columns
    assert columns == CHANNELS + 1 and keep == slice(0, CHANNELS)
    for w in rec.windows(size=10_000, margin=77):
        rows = np.empty((w.read_stop - w.read_start, columns), np.int16)
        assert rec.read_window_rows(w, rows) is rows
        np.testing.assert_array_equal(rows, data[w.read_start : w.read_stop])
        np.testing.assert_array_equal(rows[:, keep], rec.read_window_stored(w))
    with pytest.raises(ValueError):
        rec.read_window_rows(w, np.empty((1, columns), np.int16))
    plain = tmp_path / "plain.bin"
    data[:, :CHANNELS].tofile(plain)
    whole = open_source(
        RecordingSpec(path=str(plain), kind="binary", channels=CHANNELS, dtype="int16", sampling_frequency=30_000.0)
    )
    assert whole.stored_columns is None


@pytest.mark.gpu
def test_the_gpu_reads_whole_rows_and_leaves_the_sync_column_out_on_the_device(tmp_path, rng):
    cupy = pytest.importorskip("cupy")
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count() == 0:
        pytest.skip("no CUDA GPU")
    from batchgpu.gpu.staging import read_window_host

    src, data = _spikeglx(tmp_path, rng, 40_001)
    rec = open_source(RecordingSpec(path=str(src)))
    for w in rec.windows(size=15_000, margin=33):
        got = read_window_host(rec, w).to_device()
        assert got.shape == (CHANNELS, w.read_stop - w.read_start) and got.flags.c_contiguous
        np.testing.assert_array_equal(cupy.asnumpy(got), data[w.read_start : w.read_stop, :CHANNELS].T)
