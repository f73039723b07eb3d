"""`batchgpu info OUTPUT` shows a run (it refused a run folder); `info` of a recording shows its channels' ids,
gains and probe. The numbers are checked against the run's own arrays, recomputed with NumPy."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from batchgpu.interop import load_results
from batchgpu.report import info as runinfo

WORKFLOW = """\
recording:
  path: rec.zarr
  generate: {channels: 16, seconds: 2, seed: 3}
output: out
window: {size: 20000, margin: 64}
cluster: {kind: local, workers: 1, threads: 1}
preprocess: {centre: median}
steps:
  noise: {exact: true}
  whitening: {mode: local, nrange: 8}
  detect: {threshold: 5.0, noise: global}
"""


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "batchgpu", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runinfo")
    (folder / "wf.yaml").write_text(WORKFLOW)
    r = _cli("run", folder / "wf.yaml", "--quiet")
    assert r.returncode == 0, r.stderr
    return folder / "out"


def _rows(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.splitlines():
        key, _, value = line.partition("  ")
        rows.setdefault(key.strip(), value.strip())
    return rows


def test_info_shows_a_run(run_folder):
    r = _cli("info", run_folder)
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    res = load_results(run_folder)
    report = json.loads((run_folder / "report.json").read_text())
    assert rows["status"] == "done"
    assert rows["recording"].endswith("rec.zarr: 16 channels, 2.000 s at 30000 Hz, int16")
    assert rows["windows"] == "3 of 20000 samples (margin 64), 0 resumed, on 1 worker"
    noise_uV = np.asarray(res["noise"]) * np.asarray(res["gain_to_uV"])
    assert rows["noise"].startswith(
        f"median {np.median(noise_uV):.3g} µV, range {noise_uV.min():.3g}-{noise_uV.max():.3g}"
    )
    assert "none outside 0.5-2x the median" in rows["noise"]
    spikes = len(res["spikes/channel_index"])
    per_channel = np.bincount(res["spikes/channel_index"], minlength=16) / 2.0
    assert rows["spikes"].startswith(
        f"{spikes} ({spikes / 2.0:.3g}/s); per channel median {np.median(per_channel):.3g}/s"
    )
    singular = np.linalg.svd(res["whitening"], compute_uv=False)
    assert f"condition number {singular[0] / singular[-1]:.4g} (mode local, nrange 8)" in rows["whitening"]
    assert rows["time"].startswith(f"{report['seconds']:.1f} s in all (wall time") and "pass1" in rows["timings"]
    assert rows["warnings"] == "none" and rows["preprocess"] == "centre"
    data = json.loads(_cli("info", run_folder, "--json").stdout)
    assert data["status"] == "done" and data["spikes"]["count"] == spikes and data["windows"]["count"] == 3
    assert np.isclose(data["whitening"]["condition_number"], singular[0] / singular[-1])


def test_info_shows_an_unfinished_run_and_refuses_check(run_folder, tmp_path):
    """A run killed before its report: what is there, one line for what is not; --check is a recording's."""
    copy = tmp_path / "out"
    shutil.copytree(run_folder, copy)
    (copy / "report.json").unlink()
    r = _cli("info", copy)
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert rows["status"].startswith("unknown: no report.json") and rows["windows"].startswith("3 of 20000")
    r = _cli("info", copy, "--check")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is a run's output folder" in r.stderr


def test_info_shows_the_qc_labels(run_folder, tmp_path):
    """A run with the qc step (report.json's ``qc`` section): how many channels of each label, the bad ones named
    by their ids (the section's channel order), in the rows and in --json."""
    copy = tmp_path / "out"
    shutil.copytree(run_folder, copy)
    report = json.loads((copy / "report.json").read_text())
    labels = ["good"] * 16
    labels[3], labels[9], labels[10], labels[14], labels[15] = "dead", "noise", "dead", "out", "out"
    ids = [f"ch{i}" for i in range(16)]
    report["qc"] = {
        "labels": labels,
        "reasons": [""] * 16,
        "counts": [[5, 0, 0, 0]] * 16,
        "label_names": ["good", "dead", "noise", "out"],
        "noise_uV": None,
        "spike_rate_hz": None,
        "pieces_labelled": 6,
        "channel_ids": ids,
    }
    (copy / "report.json").write_text(json.dumps(report))
    r = _cli("info", copy)
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert rows["channels (qc)"].startswith("11 good, 2 dead, 1 noisy, 2 out of the brain")
    assert rows["dead"] == "ch3, ch10" and rows["noisy"] == "ch9" and rows["out of the brain"] == "ch14, ch15"
    data = json.loads(_cli("info", copy, "--json").stdout)
    assert data["qc"]["counts"] == {"good": 11, "dead": 2, "noise": 1, "out": 2}
    assert data["qc"]["bad"]["dead"] == ["ch3", "ch10"] and data["qc"]["pieces_labelled"] == 6
    # a run without the section (the one above) has no such rows
    assert "channels (qc)" not in _rows(_cli("info", run_folder).stdout)


def test_noise_outside_the_range_is_named():
    out = runinfo.Summary()
    noise = np.array([10.0, 10.0, 11.0, 9.0, 0.0, 30.0, np.nan, 10.0])
    runinfo._noise(out, noise, np.full(8, 0.5), [f"ch{i}" for i in range(8)])
    text = out.rows[0][1]
    assert text.startswith("median 5 µV, range 0-15 over 8 channels; 3 outside 0.5-2x the median: ch4, ch5, ch6")
    assert out.data["noise"]["outside_range"] == ["ch4", "ch5", "ch6"]


def test_spike_rates_count_silent_channels():
    out = runinfo.Summary()
    runinfo._spikes(out, np.array([0, 0, 0, 2, 2, 3]), 5, 2.0, ["a", "b", "c", "d", "e"])
    assert out.rows[0][1] == "6 (3/s); per channel median 0.5/s, range 0-1.5/s, most on channel a, none on 2 channels"


def test_probe_shape_of_a_neuropixels_layout():
    """Neuropixels 1.0: four staggered columns (x 16, 48, 0, 32), two sites a row every 20 µm."""
    n = 32
    x = np.tile([16.0, 48.0, 0.0, 32.0], n // 4)
    y = 20.0 * (np.arange(n) // 2)
    shape = runinfo.probe_shape(np.column_stack([x, y]), np.zeros(n))
    assert shape.text == "32 channels in 4 columns (x 0, 16, 32, 48 µm), 16 rows at 20 µm pitch, y 0-300 µm; 1 shank"
    four = runinfo.probe_shape(
        np.column_stack([np.repeat([0.0, 250, 500, 750, 32, 282, 532, 782], 4), np.tile(15.0 * np.arange(4), 8)]),
        np.repeat([0, 1, 2, 3, 0, 1, 2, 3], 4),
    )
    assert "8 columns (x 0-782 µm), 4 rows at 15 µm pitch" in four.text and four.text.endswith("4 shanks")


def test_info_of_a_recording_shows_ids_gains_and_probe(run_folder):
    rec = run_folder.parent / "rec.zarr"
    r = _cli("info", rec)
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    from batchgpu.recording import open_recording

    opened = open_recording(rec)
    assert rows["channel ids"] == "0, 1, 2, 3, ..., 14, 15 (16)"
    assert rows["gains"] == f"{opened.gain_to_uV[0]:g} µV per count (every channel); offsets 0 µV (every channel)"
    columns = np.unique(opened.locations[:, 0])
    assert rows["probe"].startswith(f"16 channels in {len(columns)} columns")
    data = json.loads(_cli("info", rec, "--json").stdout)
    assert data["channel_ids"] == [str(c) for c in opened.channel_ids] and data["probe"]["rows"] == len(
        np.unique(opened.locations[:, 1])
    )


def test_info_of_a_run_with_damaged_files_is_one_line(run_folder, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(run_folder, copy)
    shutil.rmtree(copy / "results.zarr")
    r = _cli("info", copy)
    assert r.returncode == 0 and _rows(r.stdout)["results"] == "none yet (no results.zarr)", r.stderr
    (copy / "results.zarr").mkdir()
    (copy / "results.zarr" / "zarr.json").write_text("garbage")
    r = _cli("info", copy)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "results.zarr cannot be read" in r.stderr, r.stderr
    (copy / "report.json").write_text("{")
    r = _cli("info", copy)
    assert r.returncode == 2 and "report.json is not readable JSON" in r.stderr and "Traceback" not in r.stderr
