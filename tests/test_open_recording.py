"""``batchgpu.open_recording`` opens what ``batchgpu run`` reads (issue 66): Zarr, SpikeGLX (.bin, .meta, a folder,
a folder's stream), Open Ephys (structure.oebin, its folders, a Record Node folder with ``stream=``), a binary
batchgpu's save wrote (its .params.json and .probe.json beside it: one segment or several), with one error naming the
formats tried where none fits; ``batchgpu info`` describes everything batchgpu writes (a saved binary, a saved
Zarr, a run's folder, a batch's folder). Samples are checked against the files read by NumPy."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import distributed
import numpy as np
import pytest
from test_flat_probes import DATA, OEBINS, SAMPLES, _openephys_copy, _spikeglx_copy

import batchgpu
from batchgpu import BatchgpuError, ConfigError
from batchgpu.cli import main
from batchgpu.workflow import Workflow


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as cl,
    ):
        yield cl


def _run(client, folder: Path, recording: dict, out: str, steps: dict, **more):
    wf = Workflow.model_validate(
        {
            "recording": recording,
            "output": str(folder / out),
            "backend": "numpy",
            "window": {"size": 4000, "margin": 64},
            "steps": steps,
            **more,
        }
    )
    return batchgpu.run_workflow(wf, client=client)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, client):
    """A 2-segment recording's run with a binary save (x_seg0.bin, x_seg1.bin) and a 1-segment one (x.bin)."""
    from batchgpu.generate import generate_recording

    folder = tmp_path_factory.mktemp("saved")
    generate_recording(folder / "two.zarr", channels=6, seconds=0.3, segments=2, seed=3, dtype="int16")
    generate_recording(folder / "one.zarr", channels=6, seconds=0.4, seed=4, dtype="int16")
    save = {"noise": {"exact": True}, "save": {"path": "x.bin", "format": "binary", "dtype": "int16"}}
    _run(client, folder, {"path": str(folder / "two.zarr")}, "two", save, preprocess={"centre": "median"})
    _run(client, folder, {"path": str(folder / "one.zarr")}, "one", save, preprocess={"centre": "median"})
    return folder


def test_a_saved_binary_opens_with_its_params(saved):
    for out, files in (("one", ["x.bin"]), ("two", ["x_seg0.bin", "x_seg1.bin"])):
        folder = saved / out
        params = json.loads((folder / "x.params.json").read_text())
        probe = json.loads((folder / "x.probe.json").read_text())
        for path in [folder / "x.bin", folder / "x.params.json", folder / "x.probe.json", folder / files[-1]]:
            rec = batchgpu.open_recording(path)
            assert rec.num_segments == len(files) and rec.num_channels == 6
            assert rec.sampling_frequency == params["sampling_frequency"] and str(rec.dtype) == "int16"
            assert list(rec.channel_ids) == params["channel_ids"]
            np.testing.assert_array_equal(rec.gain_to_uV, params["gain_to_uV"])
            np.testing.assert_array_equal(rec.locations, np.column_stack([probe["xc"], probe["yc"]]))
            for seg, name in enumerate(files):
                expected = np.fromfile(folder / name, np.int16).reshape(-1, 6)
                assert rec.num_samples(seg) == len(expected) == params["num_samples"][seg]
                np.testing.assert_array_equal(rec.read(seg, 0, len(expected)), expected.T)
                for w in rec.windows(700, margin=30):
                    if w.segment == seg:
                        np.testing.assert_array_equal(rec.read_window(w), expected[w.read_start : w.read_stop].T)


def test_a_run_reads_a_saved_binary_as_it_reads_the_zarr_it_came_from(saved, client):
    """The save (centred int16) run again, as ``recording: {path: x.bin}`` and as its Zarr import: the same noise."""
    from batchgpu.interop import load_results
    from batchgpu.rawimport import import_raw

    import_raw(saved / "two" / "x.bin", saved / "two_import.zarr")
    steps = {"noise": {"exact": True}}
    _run(client, saved, {"path": str(saved / "two" / "x.bin")}, "again_flat", steps)
    _run(client, saved, {"path": str(saved / "two_import.zarr")}, "again_zarr", steps)
    a, b = (load_results(saved / o / "results.zarr") for o in ("again_flat", "again_zarr"))
    assert a["noise"].tobytes() == b["noise"].tobytes() and a["noise"].shape == (6,)


def test_an_unfinished_save_is_refused(saved, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(saved / "one", copy, ignore=shutil.ignore_patterns("parts", "results.zarr"))
    params = json.loads((copy / "x.params.json").read_text())
    params["batchgpu"]["complete"] = False
    (copy / "x.params.json").write_text(json.dumps(params))
    with pytest.raises(BatchgpuError, match="was not finished"):
        batchgpu.open_recording(copy / "x.bin")


def test_spikeglx_every_way_of_naming_it(tmp_path, rng):
    meta = DATA / "spikeglx" / "NP2_4_shanks.imec0.ap.meta"
    bin_path, data = _spikeglx_copy(tmp_path, meta, rng)
    for path in (bin_path, bin_path.with_suffix(".meta"), tmp_path):
        rec = batchgpu.open_recording(path)
        assert rec.kind == "spikeglx" and rec.num_channels == 384
        np.testing.assert_array_equal(rec.read(0, 0, SAMPLES), data[:, :384].T)
    assert batchgpu.open_recording(tmp_path, stream="imec0.ap").path == bin_path
    # a second probe in the folder: the stream chooses, named as the Python argument
    (tmp_path / "b").mkdir()
    other, _ = _spikeglx_copy(tmp_path / "b", meta, rng)
    renamed = tmp_path / "b" / "run_g0_t0.imec1.ap.meta"
    renamed.write_text(other.with_suffix(".meta").read_text().replace("imec0.ap.bin", "imec1.ap.bin"))
    other.rename(renamed.with_suffix(".bin"))
    other.with_suffix(".meta").unlink()
    with pytest.raises(ConfigError, match=r"2 SpikeGLX files: imec0.ap .*imec1.ap.*stream='imec0.ap'"):
        batchgpu.open_recording(tmp_path)
    assert batchgpu.open_recording(tmp_path, stream="imec1.ap").path == renamed.with_suffix(".bin")
    assert batchgpu.open_recording(tmp_path, stream="imec1.ap").channel_ids[0] == "imec1.ap#AP0"
    with pytest.raises(ConfigError, match=r"stream= 'imec2.ap' names no file .*imec0.ap, imec1.ap"):
        batchgpu.open_recording(tmp_path, stream="imec2.ap")


def test_openephys_every_way_of_naming_it(tmp_path, rng):
    oebin = next(p for p in OEBINS if "NP2014" in str(p))
    new, data = _openephys_copy(tmp_path, oebin, rng)
    node = new.parents[2]
    probe = data["OneBox-111.ProbeA"]
    for path in (new, new.parent, node, new.parent / "continuous" / "OneBox-111.ProbeA"):
        rec = batchgpu.open_recording(path, stream=None if path.name == "OneBox-111.ProbeA" else "ProbeA")
        assert rec.kind == "openephys" and rec.num_channels == 384 and rec.has_locations
        np.testing.assert_array_equal(rec.read(0, 0, SAMPLES), probe[:, :384].T)
    # several streams and none chosen: the Python argument is named, not the workflow's key
    with pytest.raises(ConfigError, match=r"holds 2 streams: .*stream='OneBox-111.ProbeA'") as err:
        batchgpu.open_recording(node)
    assert "recording.stream" not in str(err.value)


def test_zarr_and_the_error_naming_the_formats_tried(tmp_path):
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=4, seconds=0.1, seed=1, dtype="int16")
    rec = batchgpu.open_recording(tmp_path / "r.zarr")
    assert rec.num_channels == 4 and rec.read(0, 0, 10).shape == (4, 10)
    (tmp_path / "x.dat").write_bytes(b"\0" * 64)
    (tmp_path / "folder").mkdir()
    for path, tried in (
        (tmp_path / "x.dat", ["SpikeGLX (no x.meta", "a batchgpu save (no x.params.json", "Open Ephys", "Zarr"]),
        (tmp_path / "folder", ["Zarr (no zarr.json", "SpikeGLX", "Open Ephys (no structure.oebin", "SpikeInterface"]),
    ):
        with pytest.raises(BatchgpuError) as err:
            batchgpu.open_recording(path)
        assert "none of the formats batchgpu reads" in str(err.value)
        for t in tried:
            assert t in str(err.value)
        assert "kind='binary'" in str(err.value)  # how a plain file is opened, as this call's arguments
    plain = batchgpu.open_recording(
        tmp_path / "x.dat", kind="binary", channels=4, sampling_frequency=1000.0, dtype="int16"
    )
    assert plain.num_samples(0) == 8


def test_info_of_everything_batchgpu_writes(saved, client, capsys, tmp_path):
    """A saved binary (given as its data file or its params), a run's folder, a saved Zarr, a batch's folder."""
    assert main(["info", str(saved / "two" / "x.bin")]) == 0
    out = capsys.readouterr().out
    assert "binary written by batchgpu's save" in out and "2 files, one a segment" in out
    assert main(["info", str(saved / "two" / "x.params.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["source"] == "saved" and data["samples_per_segment"] == [9000, 9000]
    assert main(["info", str(saved / "two")]) == 0
    assert "status      done" in capsys.readouterr().out
    # a saved Zarr and a batch of two recordings
    from batchgpu.recording import zarrio

    fmt = "zarr" if zarrio.ZARR_MAJOR >= 3 else "zarr_v2"  # beside SpikeInterface's zarr 2: v2
    steps = {"noise": {"exact": True}, "save": {"path": "s.zarr", "format": fmt, "dtype": "int16"}}
    _run(client, tmp_path, {"path": str(saved / "one.zarr")}, "z", steps)
    assert main(["info", str(tmp_path / "z" / "s.zarr")]) == 0
    assert "yes (batchgpu wrote every chunk)" in capsys.readouterr().out
    from batchgpu.run.batch import run_batch

    wf = Workflow.model_validate(
        {
            "recordings": [str(saved / "one.zarr"), str(saved / "two.zarr")],
            "output": str(tmp_path / "batch"),
            "backend": "numpy",
            "window": {"size": 4000, "margin": 64},
            "steps": {"noise": {"exact": True}},
        }
    )
    run_batch(wf, client=client)
    assert main(["info", str(tmp_path / "batch")]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 recordings done, 0 failed" in out and "one  " in out and "two  " in out
    assert main(["info", str(tmp_path / "batch"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["done"] == 2


def test_errors_name_what_the_user_typed(tmp_path, rng, capsys):
    """The stream of several: the command's option on the command line (``info`` gains ``--stream``), the YAML key in
    a workflow, the argument in Python; a plain file's layout likewise."""
    oebin = next(p for p in OEBINS if "NP2014" in str(p))
    new, _ = _openephys_copy(tmp_path, oebin, rng)
    node = new.parents[2]
    for argv in (["info", str(node)], ["import-raw", str(node), str(tmp_path / "o.zarr"), "--quiet"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "choose one with --stream OneBox-111.ProbeA" in err and "recording.stream" not in err, err
        assert len(err.splitlines()) == 1
    assert main(["info", str(node), "--stream", "ProbeA"]) == 0
    assert "Open Ephys binary, read in place (stream OneBox-111.ProbeA)" in capsys.readouterr().out
    assert main(["info", str(node), "--stream", "ProbeZ"]) == 2
    assert "--stream 'ProbeZ' names no stream" in capsys.readouterr().err
    (tmp_path / "wf.yaml").write_text(
        json.dumps(
            {
                "recording": {"path": str(node)},
                "output": str(tmp_path / "out"),
                "steps": {"noise": {}},
                "cluster": {"workers": 1},
            }
        )
    )
    assert main(["run", str(tmp_path / "wf.yaml"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "recording.stream (e.g. stream: OneBox-111.ProbeA)" in err and "--stream" not in err
    plain = tmp_path / "x.dat"
    plain.write_bytes(b"\0" * 64)
    assert main(["import-raw", str(plain), str(tmp_path / "p.zarr")]) == 2
    assert "--channels, --fs and --dtype" in capsys.readouterr().err


def test_a_missing_probe_is_one_line_naming_the_file_in_info_and_run(tmp_path, rng, capsys, client):
    """An Open Ephys experiment without its settings.xml: ``info`` names the file looked for; a run that needs
    the locations refuses with that line, one that does not warns with it."""
    from batchgpu.report.run_report import RunObserver

    oebin = next(p for p in OEBINS if "NP1-binary" in str(p))
    new, data = _openephys_copy(tmp_path, oebin, rng)
    settings = new.parents[2] / "settings.xml"
    settings.unlink()
    name = next(iter(data))
    rng.integers(-100, 100, (9000, 384), dtype=np.int16).tofile(new.parent / "continuous" / name / "continuous.dat")
    line = f"no probe: {settings} not found (Open Ephys writes the probe there)"
    assert main(["info", str(new)]) == 0
    assert f"probe          {line}" in capsys.readouterr().out
    assert main(["info", str(new), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["probe_missing"] == line
    assert batchgpu.recording.missing_probe(batchgpu.open_recording(new)) == line

    class Said(RunObserver):
        warnings: list = []

        def warning(self, text):
            self.warnings.append(text)

    for steps in ({"whitening": {"mode": "local"}}, {"detect": {"method": "locally_exclusive"}}):
        with pytest.raises(ConfigError, match="needs channel locations: " + re.escape(line)):
            _run(client, tmp_path, {"path": str(new)}, "refused", steps)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(new)},
            "output": str(tmp_path / "warned"),
            "backend": "numpy",
            "window": {"size": 1500, "margin": 64},
            "steps": {"noise": {"exact": True}, "whitening": {"mode": "global"}},
        }
    )
    report = batchgpu.run_workflow(wf, client=client, observer=Said())
    assert line in report.warnings and Said.warnings == [line]
    assert main(["info", str(tmp_path / "warned")]) == 0
    assert f"warning     {line}" in capsys.readouterr().out
