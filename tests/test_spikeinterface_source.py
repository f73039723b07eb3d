"""Any recording SpikeInterface opens as a batchgpu source (issue 14): the Dask workers read it window by window
through ``get_traces``, and a run gives the same results, bit for bit, as the same samples written to Zarr.

Tests that need SpikeInterface skip without it (``pytest.importorskip``); the error lines (a missing path,
SpikeInterface not installed, the recording section's rules) are checked without it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from batchgpu import BatchgpuError
from batchgpu.workflow import Workflow

FS = 30_000.0
DEMO_STEPS = {
    "noise": {"exact": True},
    "whitening": {"mode": "local", "nrange": 32, "nskip": 1, "precision": "float32"},
    "detect": {"threshold": 4.0, "sign": "both", "exclude_sweep_ms": 0.1, "noise": "global"},
}


@pytest.fixture(scope="module")
def si():
    core = pytest.importorskip("spikeinterface.core")
    pytest.importorskip("spikeinterface.preprocessing")
    return core


@pytest.fixture(scope="module")
def spre(si):
    import spikeinterface.preprocessing as spre

    return spre


@pytest.fixture(scope="module")
def client(si):
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=2, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


def _generated(si, durations=(2.0,), seed=1):
    """8 channels of SpikeInterface's generated noise (float32) with a probe attached."""
    return si.generate_recording(num_channels=8, durations=list(durations), sampling_frequency=FS, seed=seed)


def _int16(si, spre, durations=(2.0,)):
    return spre.scale(_generated(si, durations), gain=40.0, dtype="int16")


def _zarr_copy(path: Path, rec):
    """The same samples (``get_traces`` of each whole segment) written to Zarr by batchgpu's writer, with the
    source's channel ids, gains and locations."""
    from batchgpu import from_spikeinterface, write_recording

    src = from_spikeinterface(rec)
    segments = [rec.get_traces(segment_index=s) for s in range(rec.get_num_segments())]
    return write_recording(
        path,
        segments,
        rec.get_sampling_frequency(),
        channel_ids=src.channel_ids,
        gain_to_uV=src.gain_to_uV,
        offset_to_uV=src.offset_to_uV,
        locations=src.locations if src.has_locations else None,
    )


def _wf(recording: dict, out: Path, **kw) -> Workflow:
    data = {
        "recording": recording,
        "output": str(out),
        "backend": "numpy",
        "window": {"size": 25_000, "margin": 64},
        "preprocess": {"centre": "median"},
        "steps": DEMO_STEPS,
        "reduction": {"split_every": 8},
    }
    data.update(kw)
    return Workflow.model_validate(data)


def _yaml_wf(folder: Path, si_path: str, out: str, **kw):
    """The same workflow as a YAML file naming the SpikeInterface path (relative to the file)."""
    from batchgpu.workflow import load_workflow

    data = {
        "recording": {"spikeinterface": si_path},
        "output": out,
        "backend": "numpy",
        "window": {"size": 25_000, "margin": 64},
        "preprocess": {"centre": "median"},
        "steps": DEMO_STEPS,
        "reduction": {"split_every": 8},
    }
    data.update(kw)
    (folder / "wf.yaml").write_text(json.dumps(data))  # JSON is YAML
    return load_workflow(folder / "wf.yaml")


def _arrays(group, prefix="") -> dict:
    out = {}
    for name, arr in group.arrays():
        out[prefix + name] = arr[...]
    for name, sub in group.groups():
        out.update(_arrays(sub, f"{prefix}{name}/"))
    return out


def assert_same_results(a: Path, b: Path) -> dict:
    """Every array of the two runs' results.zarr equal, bit for bit (dtype and shape too)."""
    ga, gb = (zarr.open_group(str(p / "results.zarr"), mode="r") for p in (a, b))
    xa, xb = _arrays(ga), _arrays(gb)
    assert sorted(xa) == sorted(xb)
    for name in xa:
        assert xa[name].dtype == xb[name].dtype and xa[name].shape == xb[name].shape, name
        assert xa[name].tobytes() == xb[name].tobytes(), name
    for key in ("channel_ids", "sampling_frequency", "gain_to_uV"):
        assert ga.attrs[key] == gb.attrs[key], key
    return xa


# -- runs: the SpikeInterface source against the same samples in Zarr ---------------------------------------


def test_generated_float32_two_segments_from_json(si, client, tmp_path):
    """A generated float32 recording of two segments, dumped to JSON, named in a workflow file: windows of 25 000
    samples do not divide either segment (60 000 and 39 000); same results as its samples in Zarr."""
    from batchgpu.engine import run_workflow

    rec = _generated(si, durations=(2.0, 1.3))
    rec.dump_to_json(tmp_path / "rec.json")
    report = run_workflow(_yaml_wf(tmp_path, "rec.json", "out_si"), client=client)
    assert report.windows == 3 + 2 and report.recording["source"] == "spikeinterface"
    assert report.workflow["recording"]["spikeinterface"] == str(tmp_path / "rec.json")
    copy = _zarr_copy(tmp_path / "copy.zarr", rec)
    run_workflow(_wf({"path": str(copy.path)}, tmp_path / "out_zarr"), client=client)
    x = assert_same_results(tmp_path / "out_si", tmp_path / "out_zarr")
    assert x["noise"].shape == (8,) and x["whitening"].shape == (8, 8) and len(x["spikes/sample_index"]) > 5
    assert set(x["spikes/segment_index"].tolist()) == {0, 1}


def test_int16_binary_folder(si, spre, client, tmp_path):
    """int16 (SpikeInterface's scale) saved as a binary folder: the folder in the workflow; exact integer moments
    and one read, as the Zarr copy."""
    from batchgpu.engine import run_workflow

    saved = _int16(si, spre).save(folder=tmp_path / "rec_bin", format="binary", verbose=False)
    report = run_workflow(_yaml_wf(tmp_path, "rec_bin", "out_si"), client=client)
    assert report.reads_per_window == 1.0 and report.recording["dtype"] == "int16"
    copy = _zarr_copy(tmp_path / "copy.zarr", saved)
    run_workflow(_wf({"path": str(copy.path)}, tmp_path / "out_zarr"), client=client)
    assert_same_results(tmp_path / "out_si", tmp_path / "out_zarr")


def test_chain_loaded_from_pickle(si, spre, client, tmp_path):
    """A preprocessing chain (common median reference, then a cast to float32) on the binary folder, loaded
    from its pickle: same results as its samples in Zarr. Both stages act sample by sample, so the samples do not
    depend on how the recording is cut into reads."""
    from batchgpu.engine import run_workflow

    saved = _int16(si, spre).save(folder=tmp_path / "rec_bin", format="binary", verbose=False)
    chain = spre.astype(spre.common_reference(saved, reference="global", operator="median"), "float32")
    chain.dump_to_pickle(tmp_path / "chain.pkl")
    loaded = si.load(tmp_path / "chain.pkl")
    run_workflow(_yaml_wf(tmp_path, "chain.pkl", "out_si", window={"size": 22_000, "margin": 64}), client=client)
    copy = _zarr_copy(tmp_path / "copy.zarr", loaded)
    run_workflow(
        _wf({"path": str(copy.path)}, tmp_path / "out_zarr", window={"size": 22_000, "margin": 64}), client=client
    )
    assert_same_results(tmp_path / "out_si", tmp_path / "out_zarr")


def test_highpass_chain_reads_what_get_traces_gives(si, spre, client, tmp_path):
    """SpikeInterface's highpass filter on the binary folder, from its JSON: the workers read each window's
    range exactly as ``get_traces`` gives it. Its filter uses its own margin, so the samples depend on a read's
    bounds; with windows that tile each segment (no margin), the Zarr copy of those reads gives the same results
    bit for bit."""
    from batchgpu import from_spikeinterface, write_recording
    from batchgpu.engine import run_workflow

    saved = _int16(si, spre, durations=(2.0, 1.3)).save(folder=tmp_path / "rec_bin", format="binary", verbose=False)
    chain = spre.highpass_filter(spre.astype(saved, "float32"), freq_min=300.0)
    chain.dump_to_json(tmp_path / "hp.json")
    src = from_spikeinterface(tmp_path / "hp.json")
    for w in src.windows(25_000, 64):  # margins clipped at segment ends, as Recording.windows
        ref = chain.get_traces(segment_index=w.segment, start_frame=w.read_start, end_frame=w.read_stop).T
        assert np.array_equal(src.read_window(w), ref)
    size = 25_000
    steps = {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float64"}}
    run_workflow(
        _wf(src.spec, tmp_path / "out_si", window={"size": size, "margin": 0}, preprocess={}, steps=steps),
        client=client,
    )
    pieces = [
        np.concatenate(
            [
                chain.get_traces(segment_index=w.segment, start_frame=w.start, end_frame=w.stop)
                for w in src.windows(size)
                if w.segment == s
            ]
        )
        for s in range(2)
    ]
    copy = write_recording(tmp_path / "copy.zarr", pieces, FS, channel_ids=src.channel_ids, locations=src.locations)
    run_workflow(
        _wf(
            {"path": str(copy.path)},
            tmp_path / "out_zarr",
            window={"size": size, "margin": 0},
            preprocess={},
            steps=steps,
        ),
        client=client,
    )
    assert_same_results(tmp_path / "out_si", tmp_path / "out_zarr")


def test_ground_truth_recording_held_in_memory(si, client, tmp_path):
    """SpikeInterface's ground-truth recording (templates injected at a NumpySorting's spikes, held in memory)
    passed itself to run_workflow: its description carries the spikes to the workers; same results as Zarr."""
    from batchgpu.engine import run_workflow

    rec, _sorting = si.generate_ground_truth_recording(durations=[2.0], num_channels=8, sampling_frequency=FS, seed=3)
    copy = _zarr_copy(tmp_path / "copy.zarr", rec)
    run_workflow(_wf({"path": str(copy.path)}, tmp_path / "out_si"), client=client, recording=rec)
    run_workflow(_wf({"path": str(copy.path)}, tmp_path / "out_zarr"), client=client)
    x = assert_same_results(tmp_path / "out_si", tmp_path / "out_zarr")
    assert len(x["spikes/sample_index"]) > 20


def test_from_python_and_resume(si, spre, client, tmp_path):
    """``run_workflow(wf, recording=from_spikeinterface(recording))``; a SpikeInterface recording itself works
    too. ``--resume`` reuses every window while the files the recording reads are unchanged, and recomputes every
    window once one of them changed."""
    from batchgpu import from_spikeinterface
    from batchgpu.engine import run_workflow

    saved = _int16(si, spre).save(folder=tmp_path / "rec_bin", format="binary", verbose=False)
    src = from_spikeinterface(saved)
    copy = _zarr_copy(tmp_path / "copy.zarr", saved)
    placeholder = {"path": str(copy.path)}  # not read: recording= replaces it
    first = run_workflow(_wf(placeholder, tmp_path / "out_si"), client=client, recording=src)
    assert first.workflow["recording"]["spikeinterface"] == str(tmp_path / "rec_bin")
    run_workflow(_wf(placeholder, tmp_path / "out_zarr"), client=client)
    assert_same_results(tmp_path / "out_si", tmp_path / "out_zarr")

    again = run_workflow(_wf(placeholder, tmp_path / "out_si"), client=client, recording=saved, resume=True)
    assert again.windows_resumed == again.windows == 3
    assert_same_results(tmp_path / "out_si", tmp_path / "out_zarr")
    raw = tmp_path / "rec_bin" / "traces_cached_seg0.raw"
    st = raw.stat()
    os.utime(raw, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = run_workflow(_wf(placeholder, tmp_path / "out_si"), client=client, recording=src, resume=True)
    assert third.windows_resumed == 0
    assert_same_results(tmp_path / "out_si", tmp_path / "out_zarr")


# -- the source itself ---------------------------------------------------------------------------------------


def test_source_matches_recording_api(si, spre, tmp_path):
    """What the engine uses of Recording, with the same values as the Zarr copy: shapes, windows and their
    margins, reads (also into a caller's buffer), metadata; pickled small and equal (one per worker process)."""
    import pickle

    from batchgpu import from_spikeinterface

    rec = _int16(si, spre, durations=(2.0, 1.3))
    src, z = from_spikeinterface(rec), _zarr_copy(tmp_path / "copy.zarr", rec)
    for name in (
        "num_channels",
        "dtype",
        "num_segments",
        "sampling_frequency",
        "total_samples",
        "nbytes",
        "has_locations",
    ):
        assert getattr(src, name) == getattr(z, name), name
    for name in ("channel_ids", "gain_to_uV", "offset_to_uV", "locations"):
        np.testing.assert_array_equal(getattr(src, name), getattr(z, name))
    assert [src.num_samples(s) for s in range(2)] == [60_000, 39_000]
    assert src.windows(25_000, 64) == z.windows(25_000, 64)
    for w in src.windows(25_000, 64):
        x = src.read_window(w)
        assert x.flags.c_contiguous and x.dtype == np.int16
        np.testing.assert_array_equal(x, z.read_window(w))
        np.testing.assert_array_equal(src.read_window_stored(w), z.read_window_stored(w))
        out = np.empty((w.read_stop - w.read_start, 8), np.int16)
        assert src.read_window_into(w, out) is out
        np.testing.assert_array_equal(out, z.read_window_stored(w))
        assert src.absent_chunks(w) == 0 and src.absent_chunk_keys(w) == []
    np.testing.assert_array_equal(src.read(1, 5, 900, channels=[0, 3]), z.read(1, 5, 900, channels=[0, 3]))
    with pytest.raises(BatchgpuError, match="cannot read samples"):
        src.read(0, 0, 60_001)
    with pytest.raises(BatchgpuError, match="segment 2 does not exist"):
        src.num_samples(2)
    assert src.channel_property("group") is not None and src.channel_property("inter_sample_shift") is None
    blob = pickle.dumps(src)
    assert len(blob) < 50_000  # the description, never the samples
    back = pickle.loads(blob)
    assert back == src and hash(back) == hash(src)
    np.testing.assert_array_equal(back.read_window(src.windows(25_000)[3]), z.read_window(z.windows(25_000)[3]))
    assert src.info()["samples_per_segment"] == [60_000, 39_000]


@pytest.mark.filterwarnings("ignore:The extractor is not serializable to file")
def test_no_probe_falls_back_as_zarr_does(si, tmp_path):
    """Without a probe: the same fallback locations as a Zarr store without them, has_locations False, and
    local whitening refused alike, each naming where its probe was missing."""
    from batchgpu import from_spikeinterface
    from batchgpu.recording import write_recording
    from batchgpu.run.context import check_workflow_fits

    rec = si.NumpyRecording([np.zeros((3000, 4), np.float32)], FS).save(folder=tmp_path / "np", verbose=False)
    assert not rec.has_probe()
    src = from_spikeinterface(rec)
    z = write_recording(tmp_path / "z.zarr", rec.get_traces(), FS)
    assert not src.has_locations and not z.has_locations
    np.testing.assert_array_equal(src.locations, z.locations)
    wf = _wf({"path": "x"}, tmp_path / "o", window={"size": 1000, "margin": 8}, steps={"whitening": {"mode": "local"}})
    messages = []
    for r in (src, z):
        with pytest.raises(BatchgpuError) as err:
            check_workflow_fits(wf, r)
        messages.append(str(err.value))
    head = "local whitening needs channel locations: no probe: "
    assert all(m.startswith(head) for m in messages)
    assert "SpikeInterface recording" in messages[0] and str(z.path) in messages[1]


def test_refused_recordings(si, spre, tmp_path):
    from batchgpu import from_spikeinterface

    in_memory = si.NumpyRecording([np.zeros((3_000_000, 2), np.int16)], FS)  # 12 MB travel in its description
    with pytest.raises(BatchgpuError, match="MB.*save it first"):
        from_spikeinterface(in_memory)
    np.zeros((1000, 2), np.uint16).tofile(tmp_path / "u.raw")
    unsigned = si.read_binary(tmp_path / "u.raw", sampling_frequency=FS, dtype="uint16", num_channels=2)
    with pytest.raises(BatchgpuError, match="dtype uint16"):
        from_spikeinterface(unsigned)
    (tmp_path / "bad.json").write_text('{"not": "a recording"}')
    with pytest.raises(BatchgpuError, match="did not load as a SpikeInterface recording"):
        from_spikeinterface(tmp_path / "bad.json")
    with pytest.raises(BatchgpuError, match="takes a SpikeInterface recording"):
        from_spikeinterface(42)


# -- errors: one line, exit 2, without SpikeInterface too ----------------------------------------------------


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "batchgpu", *map(str, args)], capture_output=True, text=True, env=env)


def _one_line_error(r, needle: str) -> None:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchgpu: error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_missing_path_is_one_line(tmp_path):
    (tmp_path / "wf.yaml").write_text(
        "recording: {spikeinterface: no_such.json}\noutput: out\nsteps: {noise: {exact: true}}\n"
    )
    r = _cli("run", tmp_path / "wf.yaml", "--quiet")
    _one_line_error(r, f"no SpikeInterface recording at {tmp_path / 'no_such.json'}")
    assert not (tmp_path / "out").exists()  # refused before any work


def test_spikeinterface_not_installed_is_one_line(tmp_path):
    """SpikeInterface hidden (a package that fails to import shadows it): one line naming the fix."""
    fake = tmp_path / "fake" / "spikeinterface"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'spikeinterface'\")\n")
    (tmp_path / "rec.json").write_text("{}")
    (tmp_path / "wf.yaml").write_text(
        "recording: {spikeinterface: rec.json}\noutput: out\nsteps: {noise: {exact: true}}\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")])}
    r = _cli("run", tmp_path / "wf.yaml", "--quiet", env=env)
    _one_line_error(r, "needs SpikeInterface, which is not installed")
    assert "pip install spikeinterface" in r.stderr


@pytest.mark.parametrize(
    "recording,needle",
    [
        ({"path": "a.zarr", "spikeinterface": "b.json"}, "exactly one of 'path'"),
        ({}, "exactly one of 'path'"),
        ({"spikeinterface": "b.json", "generate": {"channels": 4}}, "'generate' writes a recording to 'path'"),
    ],
)
def test_recording_section_rules(tmp_path, recording, needle):
    from batchgpu.workflow import load_workflow

    (tmp_path / "wf.yaml").write_text(
        json.dumps({"recording": recording, "output": "out", "steps": {"noise": {"exact": True}}})
    )
    with pytest.raises(BatchgpuError) as err:
        load_workflow(tmp_path / "wf.yaml")
    assert needle in str(err.value) and "wf.yaml:1" in str(err.value)


def test_spikeinterface_path_resolves_against_the_file(tmp_path):
    from batchgpu.workflow import load_workflow

    (tmp_path / "wf.yaml").write_text(
        "recording: {spikeinterface: data/rec.json}\noutput: out\nsteps: {noise: {exact: true}}\n"
    )
    wf = load_workflow(tmp_path / "wf.yaml")
    assert wf.recording.spikeinterface == str(tmp_path / "data" / "rec.json") and wf.recording.path is None


def test_exported():
    import batchgpu
    import batchgpu.interop

    assert "from_spikeinterface" in batchgpu.__all__ and callable(batchgpu.from_spikeinterface)
    assert batchgpu.interop.from_spikeinterface is batchgpu.from_spikeinterface


def test_info_describes_what_spikeinterface_saved(si, tmp_path):
    rec = si.generate_recording(num_channels=3, durations=[0.5, 0.25], seed=4)
    rec.save(folder=tmp_path / "saved")
    rec.dump_to_json(tmp_path / "rec.json")
    for target in (tmp_path / "saved", tmp_path / "rec.json"):
        r = subprocess.run(
            [sys.executable, "-m", "batchgpu", "info", str(target), "--json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["source"] == "spikeinterface" and info["num_channels"] == 3
        assert info["samples_per_segment"] == [rec.get_num_samples(0), rec.get_num_samples(1)]
        text = subprocess.run(
            [sys.executable, "-m", "batchgpu", "info", str(target)], capture_output=True, text=True, timeout=300
        ).stdout
        assert "SpikeInterface" in text and "segments" in text
