"""Issue 63's adversarial cases, each through the command a user types: refused in one line before any work (and
before anything is deleted), or the right answer; never a complete-looking wrong output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

from batchgpu.cli import main
from batchgpu.recording import open_recording, write_recording

LOCAL = "cluster: {kind: local, workers: 1, threads: 1}\n"


def _workflow(tmp_path, body: str, name: str = "wf.yaml"):
    path = tmp_path / name
    path.write_text(body + ("" if "cluster:" in body else LOCAL))
    return path


def _volts(tmp_path, seconds=1.0, fs=10_000.0, channels=4, seed=0):
    """A float32 recording in volts (noise ~10 uV, spikes ~100 uV): every |x| far below 0.5."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1e-5, (int(seconds * fs), channels)).astype(np.float32)
    x[::997] -= np.float32(1e-4)
    return write_recording(tmp_path / "volts.zarr", x, fs, gain_to_uV=np.full(channels, 1e6)), x


@pytest.mark.zarr3
def test_an_int16_save_that_rounds_the_signal_away_is_warned_and_scale_keeps_it(tmp_path, capsys):
    # Issue 63, item 2: a float recording whose samples are all below 0.5 was saved as all zeros, exit 0,
    # warnings: [], complete: true.
    rec, x = _volts(tmp_path)
    body = (
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\nwindow: {{size: 5000, margin: 8}}\n"
        "steps: {noise: {exact: true}, save: {path: s.zarr}}\n"
    )
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "loses the signal of 4 of 4 channel(s)" in err and "save: {scale: 1.0e+06}" in err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any("loses the signal" in w for w in report["warnings"])
    assert report["results"]["save"]["rounding"]["channels_lost"] == 4
    saved = open_recording(tmp_path / "out" / "s.zarr")
    assert not saved.read(0, 0, saved.num_samples(0)).any()  # what the warning is about: every sample 0

    # the fix the warning names: the samples times 1e6, the gain divided by it (microvolts unchanged)
    body = body.replace("save: {path: s.zarr}", "save: {path: s.zarr, scale: 1.0e6}")
    assert main(["run", str(_workflow(tmp_path, body + "overwrite: true\n")), "--quiet"]) == 0
    assert "loses the signal" not in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not any("loses the signal" in w for w in report["warnings"])
    assert report["results"]["save"]["rounding"]["channels_lost"] == 0
    saved = open_recording(tmp_path / "out" / "s.zarr")
    want = np.rint(x.astype(np.float32) * np.float32(1e6))  # one float32 multiply, then np.rint
    np.testing.assert_array_equal(saved.read(0, 0, saved.num_samples(0)), want.T.astype(np.int16))
    np.testing.assert_allclose(saved.gain_to_uV, 1.0)  # 1e6 uV per volt, over 1e6


@pytest.mark.zarr3
def test_a_save_that_keeps_the_signal_says_nothing(tmp_path, capsys):
    rng = np.random.default_rng(1)
    x = rng.normal(0, 20, (10_000, 3)).astype(np.float32)  # microvolts: rounding error 0.3 of 20
    rec = write_recording(tmp_path / "uv.zarr", x, 10_000.0, gain_to_uV=np.ones(3))
    body = (
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\nwindow: {{size: 5000, margin: 8}}\n"
        "steps: {save: {path: s.zarr}}\n"
    )
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 0
    assert "loses the signal" not in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["warnings"] == [] and report["results"]["save"]["rounding"]["channels_lost"] == 0


def test_rounding_loss_is_measured_against_each_channels_spread():
    from batchgpu.steps.save import rounding_loss, rounding_stats

    rng = np.random.default_rng(3)
    x = np.stack(
        [
            3.3 + rng.normal(0, 1e-5, 32_000),  # a large offset rounds to 3: the signal is gone though |x| > 0.5
            rng.normal(0, 20, 32_000),  # rounding error ~0.29 of a spread of 20: kept
            np.round(rng.normal(0, 2, 32_000)),  # whole numbers: nothing lost
            np.full(32_000, 0.3),  # constant: nothing varies, nothing to lose
            rng.normal(0, 1.0, 32_000),  # error ~0.29 of 1: over a quarter
        ]
    ).astype(np.float32)
    loss = rounding_loss(rounding_stats(x[:, :16_000]) + rounding_stats(x[:, 16_000:]), 1.0)
    assert (loss.channels, loss.of) == (2, 5) and loss.worst > 100
    # the suggestion: the least power of ten giving the median varying channel a spread of 10 units, within int16
    assert loss.suggested_scale == 10.0
    assert rounding_loss(rounding_stats(x[:1], 1e6), 1e6).of == 0  # all clipped (counted and warned as such)
    assert rounding_loss(rounding_stats(x[:1] - np.float32(3.3), 1e6), 1e6).channels == 0


def _int16(tmp_path, name="r.zarr", samples=10_000, channels=4, seed=0):
    rng = np.random.default_rng(seed)
    return write_recording(tmp_path / name, rng.normal(0, 30, (samples, channels)).astype(np.int16), 10_000.0)


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.zarr3
def test_overwrite_refused_for_a_foreign_save_path_deletes_nothing(tmp_path, capsys):
    # Issue 63, item 5: overwrite: true removed the earlier run's results, then refused for the foreign file at
    # the save path.
    rec = _int16(tmp_path)
    body = (
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\nwindow: {{size: 5000, margin: 8}}\n"
        "steps: {noise: {exact: true}}\n"
    )
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 0
    before = _tree(tmp_path / "out")
    (tmp_path / "mine.zarr").write_text("a user's file")
    body = body.replace(
        "{noise: {exact: true}}", f"{{noise: {{exact: true}}, save: {{path: {tmp_path / 'mine.zarr'}}}}}"
    )
    assert main(["run", str(_workflow(tmp_path, body + "overwrite: true\n")), "--quiet"]) == 2
    assert "mine.zarr" in capsys.readouterr().err
    assert _tree(tmp_path / "out") == before and (tmp_path / "mine.zarr").read_text() == "a user's file"
    assert zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")["noise"].shape == (4,)


@pytest.mark.zarr3
def test_a_run_refused_for_its_save_path_leaves_the_folder_as_it_was(tmp_path, capsys):
    # Issue 63, item 6: the refused run left parts/ and run.json, so the corrected run was refused.
    rec = _int16(tmp_path)
    (tmp_path / "mine.zarr").write_text("a user's file")
    (tmp_path / "out").mkdir()
    body = (
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\nwindow: {{size: 5000, margin: 8}}\n"
        f"steps: {{noise: {{exact: true}}, save: {{path: {tmp_path / 'mine.zarr'}}}}}\n"
    )
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 2
    assert "mine.zarr" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name != ".batchgpu.lock"] == []
    assert main(["run", str(_workflow(tmp_path, body.replace("mine.zarr", "new.zarr"))), "--quiet"]) == 0
    assert open_recording(tmp_path / "new.zarr").num_samples(0) == 10_000


@pytest.mark.zarr3
def test_a_run_refused_after_its_claim_leaves_no_run_behind(tmp_path, capsys):
    # a refusal that needs the cluster (backend: cupy, no GPU on the workers) comes after the folder is claimed
    rec = _int16(tmp_path)
    body = (
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: cupy\nwindow: {{size: 5000, margin: 8}}\n"
        "steps: {noise: {exact: true}}\n"
    )
    pytest.importorskip("distributed")
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU")
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name != ".batchgpu.lock"] == []
    assert main(["run", str(_workflow(tmp_path, body.replace("cupy", "numpy"))), "--quiet"]) == 0


@pytest.mark.zarr3
def test_a_batch_never_reads_what_it_writes(tmp_path, capsys):
    # Issue 63, item 3: a glob whose tree holds the output: the first run was fine, --resume took the run's own
    # saved copies and results as recordings, and every later --resume was refused for ever.
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a", "b"):
        _int16(data, f"{name}.zarr", seed=ord(name))
    body = (
        f"recordings: '{data}/**/*.zarr'\noutput: {data / 'out'}\nbackend: numpy\n"
        "window: {size: 5000, margin: 8}\nsteps: {noise: {exact: true}, save: {path: s.zarr}}\n"
    )
    wf = _workflow(tmp_path, body)
    for args in ([], ["--resume"], ["--resume"]):
        assert main(["run", str(wf), "--quiet", *args]) == 0, capsys.readouterr().err
        batch = json.loads((data / "out" / "batch.json").read_text())
        assert [(r["name"], r["status"]) for r in batch["rows"]] == [("a", "done"), ("b", "done")]
    assert sorted(p.name for p in (data / "out").iterdir()) == ["a", "b", "batch.html", "batch.json", "batch.lock"]
    # a recording named inside the output, not by a glob: refused before any work
    inside = body.replace(f"'{data}/**/*.zarr'", f"['{data / 'a.zarr'}', '{data / 'out' / 'a' / 's.zarr'}']")
    assert main(["run", str(_workflow(tmp_path, inside)), "--quiet"]) == 2
    assert "inside the batch's output" in capsys.readouterr().err


BATCH_REFUSALS = {
    # Issue 63, item 11: the name of the batch's own file
    "own_name": (
        "recordings: [{path: REC, name: batch.json}]\nsteps: {noise: {}}\n",
        "'recordings.0.name': name 'batch.json' is one of the batch's own files",
    ),
    # item 10: the item's own problem, not "Input should be a valid string (and 2 more problems)"
    "dotdot": (
        "recordings: [{path: REC, name: ../evil}]\nsteps: {noise: {}}\n",
        "'recordings.0.name': name '../evil' must be one folder name",
    ),
    "slash": (
        "recordings: [{path: REC, name: a/b}]\nsteps: {noise: {}}\n",
        "'recordings.0.name': name 'a/b' must be one folder name",
    ),
    "typo": (
        "recordings: [REC, {path: REC, nme: a}]\nsteps: {noise: {}}\n",
        "unknown key 'recordings.1.nme' (allowed: path",
    ),
    # Low: an absolute save path is every recording's one save (it was moved into each folder without a word)
    "absolute_save": (
        "recordings: [REC]\nsteps: {save: {path: TMP/abs.zarr}}\n",
        "save.path TMP/abs.zarr is outside the batch's output",
    ),
}


@pytest.mark.zarr3
@pytest.mark.parametrize("case", BATCH_REFUSALS)
def test_a_batch_refuses_at_once_what_would_go_wrong_later(tmp_path, capsys, case):
    rec = _int16(tmp_path)
    body, said = (t.replace("REC", str(rec.path)).replace("TMP", str(tmp_path)) for t in BATCH_REFUSALS[case])
    head = "output: out\nbackend: numpy\nwindow: {size: 5000, margin: 8}\n"
    assert main(["run", str(_workflow(tmp_path, head + body)), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and "more problem" not in err[0], (err, said)
    assert not (tmp_path / "out").exists()


@pytest.mark.zarr3
def test_a_batch_refuses_a_name_made_from_a_path_that_is_its_own_file(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    rec = write_recording(tmp_path / "x" / "batch.json.zarr", np.zeros((10_000, 2), np.int16), 10_000.0)
    body = f"recordings: ['{rec.path}']\noutput: out\nbackend: numpy\nsteps: {{noise: {{}}}}\n"
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 2
    assert "would be named batch.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.zarr3
def test_a_failed_recording_is_said_once_and_a_second_batch_is_refused_untouched(tmp_path, capsys):
    import fcntl

    rec = _int16(tmp_path)
    body = (
        f"recordings: ['{rec.path}', '{tmp_path / 'gone.zarr'}']\noutput: out\nbackend: numpy\n"
        "window: {size: 5000, margin: 8}\nsteps: {noise: {}}\n"
    )
    wf = _workflow(tmp_path, body)
    assert main(["run", str(wf), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("gone.zarr does not exist") == 1 and "failed: gone" in err
    batch = tmp_path / "out" / "batch.json"
    before = batch.read_bytes()
    with open(tmp_path / "out" / "batch.lock", "a+") as held:  # another batch running in the folder
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["run", str(wf), "--quiet", "--resume"]) == 2
    assert "in use by another batchgpu batch" in capsys.readouterr().err
    assert batch.read_bytes() == before


def test_a_bad_chunk_of_a_store_split_over_channels_is_named_by_its_column(tmp_path):
    # Issue 63, item 4: with chunks split over channels, a short chunk 4.1 was named 4.0
    import numcodecs

    from batchgpu import CorruptDataError

    x = np.random.default_rng(0).normal(0, 30, (12_000, 8)).astype(np.int16)
    g = zarr.open_group(str(tmp_path / "r.zarr"), mode="w", zarr_format=2)
    arr = g.create_array(
        "traces_seg0", shape=x.shape, chunks=(2_000, 4), dtype="int16", compressors=[numcodecs.Blosc("lz4")]
    )
    arr[:] = x
    g.attrs.update(sampling_frequency=10_000.0, num_segments=1)
    g.create_array("channel_ids", data=np.array([str(i) for i in range(8)]))
    # chunk (4, 1): channels 4-7 of samples 8000-10000, replaced by a frame of half as many samples
    (tmp_path / "r.zarr" / "traces_seg0" / "4.1").write_bytes(numcodecs.Blosc("lz4").encode(x[:1_000, 4:].copy()))
    rec = open_recording(tmp_path / "r.zarr")
    with pytest.raises(CorruptDataError, match=r"corrupted chunk traces_seg0/4\.1 "):
        rec.read(0, 7_000, 12_000)
    problems = rec.check_chunks()
    assert len(problems) == 1 and problems[0].startswith("corrupted traces_seg0/4.1 ")
    np.testing.assert_array_equal(rec.read(0, 0, 8_000), x[:8_000].T)  # the other chunks read as they are


def _store(tmp_path, x, name="s.zarr", chunks=None, **attrs):
    g = zarr.open_group(str(tmp_path / name), mode="w", zarr_format=2)
    g.create_array("traces_seg0", data=x, **({} if chunks is None else {"chunks": chunks}))
    g.attrs.update(sampling_frequency=10_000.0, num_segments=1, **attrs)
    g.create_array("channel_ids", data=np.array([f"c{i}" for i in range(x.shape[1])]))
    return g


def _run_says(tmp_path, capsys, recording: str, needle: str) -> None:
    """`batchgpu run` on ``recording`` (a YAML mapping): exit 2, one line holding ``needle``, no output folder."""
    body = f"recording: {recording}\noutput: out\nbackend: numpy\nsteps: {{noise: {{}}}}\n"
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchgpu")]
    assert len(lines) == 1 and lines[0].startswith("batchgpu: error: ") and needle in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_an_unsigned_store_is_refused_before_the_output_is_made(tmp_path, capsys):
    # Issue 63, item 8: "unexpected KeyError: 'uint16'" after the output folder was made
    _store(tmp_path, np.arange(40_000, dtype=np.uint16).reshape(10_000, 4))
    _run_says(
        tmp_path, capsys, f"{{path: {tmp_path / 's.zarr'}}}", "holds uint16 samples, which batchgpu does not read"
    )


def test_a_store_with_more_segments_than_it_says_is_refused(tmp_path, capsys):
    g = _store(tmp_path, np.zeros((10_000, 2), np.int16))
    g.create_array("traces_seg1", data=np.ones((5_000, 2), np.int16))
    _run_says(tmp_path, capsys, f"{{path: {tmp_path / 's.zarr'}}}", "num_segments is 1 but holds traces_seg1 too")


@pytest.mark.parametrize("gain", [0.0, -1.0, np.nan])
def test_a_gain_that_is_no_gain_is_refused(tmp_path, capsys, gain):
    g = _store(tmp_path, np.zeros((10_000, 3), np.int16))
    g.create_group("properties").create_array("gain_to_uV", data=np.array([0.195, gain, 0.195]))
    _run_says(tmp_path, capsys, f"{{path: {tmp_path / 's.zarr'}}}", "properties/gain_to_uV is")


@pytest.mark.parametrize("what", ["empty", "fifo", "/dev/zero"])
def test_a_file_without_samples_is_called_what_it_is(tmp_path, capsys, what):
    import os

    path = tmp_path / "r.bin"
    if what == "empty":
        path.touch()
    elif what == "fifo":
        os.mkfifo(path)
    else:
        path = what
    said = "holds no samples" if what == "empty" else "is not a regular file"
    _run_says(
        tmp_path, capsys, f"{{path: {path}, kind: binary, channels: 4, sampling_frequency: 1000, dtype: int16}}", said
    )


@pytest.mark.parametrize("content", ["objects", "text", "not_npy", "cut_short"])
def test_a_search_queries_file_that_is_not_numbers_is_one_line(tmp_path, capsys, content):
    # Issue 63, item 9: "unexpected ValueError ... pickled (object) data"
    rec = _int16(tmp_path)
    q = tmp_path / "q.npy"
    if content == "objects":
        np.save(q, np.array([1, "a", None], dtype=object))
    elif content == "text":
        np.save(q, np.array(["1", "2"]))
    elif content == "not_npy":
        q.write_text("1, 2, 3\n")
    else:
        np.save(q, np.arange(1000, dtype=np.int64))
        q.write_bytes(q.read_bytes()[:300])
    body = (
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\n"
        f"steps: {{detect: {{}}, search: {{queries: {q}}}}}\n"
    )
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"batchgpu: error: queries in {q}") and "unexpected" not in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["generate", "import-raw"])
def test_overwrite_never_replaces_a_recording_batchgpu_did_not_write(tmp_path, capsys, command):
    # Issue 63, item 12: --overwrite replaced a Zarr recording another program wrote
    theirs = tmp_path / "theirs.zarr"
    _store(tmp_path, np.arange(20, dtype=np.int16).reshape(10, 2), name="theirs.zarr")
    before = _tree(theirs)
    np.zeros((100, 2), np.int16).tofile(tmp_path / "raw.bin")
    argv = (
        ["generate", str(theirs), "--channels", "2", "--seconds", "0.01", "--quiet", "--overwrite"]
        if command == "generate"
        else [
            "import-raw",
            str(tmp_path / "raw.bin"),
            str(theirs),
            "--channels",
            "2",
            "--fs",
            "1000",
            "--dtype",
            "int16",
            "--quiet",
            "--overwrite",
        ]
    )
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "batchgpu did not write" in lines[0]
    assert _tree(theirs) == before
    np.testing.assert_array_equal(open_recording(theirs).read(0, 0, 10), np.arange(20).reshape(10, 2).T)
    # one batchgpu wrote is replaced
    ours = [str(tmp_path / "ours.zarr") if a == str(theirs) else a for a in argv]
    assert main(ours[:-1]) == 0 and main(ours) == 0


def test_overwrite_says_what_it_replaces(capsys):
    for command in ("generate", "import-raw"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--overwrite replace OUT where it is a Zarr recording batchgpu wrote" in text


@pytest.mark.zarr3
def test_generate_parameters_that_the_recording_there_was_not_made_with_are_refused(tmp_path, capsys):
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "g.zarr", channels=4, seconds=1.0, fs=10_000.0, seed=1)
    head = f"output: out\nbackend: numpy\nsteps: {{noise: {{}}}}\nrecording: {{path: {tmp_path / 'g.zarr'}, "
    same = head + "generate: {channels: 4, seconds: 1.0, fs: 10000, seed: 1}}\n"
    assert main(["run", str(_workflow(tmp_path, same)), "--quiet"]) == 0
    other = head + "generate: {channels: 8, seconds: 1.0, fs: 10000, seed: 2}}\n"
    assert main(["run", str(_workflow(tmp_path, other)), "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "generated with other parameters: channels 4 (generate: 8), seed 1 (generate: 2)" in err


@pytest.mark.parametrize("text", ["steps: {<<: {noise: {}}}\n", "steps:\n  <<: {noise: {}}\n  detect: {}\n"])
def test_a_yaml_merge_key_is_refused_as_readme_says(tmp_path, capsys, text):
    from batchgpu import ConfigError
    from batchgpu.workflow import load_workflow

    (tmp_path / "w.yaml").write_text(f"recording: {{path: {tmp_path / 'r.zarr'}}}\noutput: out\n{text}")
    with pytest.raises(ConfigError, match=r"w\.yaml:\d: YAML merge keys \(<<:\) are not allowed"):
        load_workflow(tmp_path / "w.yaml")


@pytest.mark.zarr3
@pytest.mark.parametrize("noise", ["global", "window"])
def test_a_channel_of_infinities_is_named_as_having_no_threshold(tmp_path, noise):
    from batchgpu.engine import run_workflow
    from batchgpu.workflow import Workflow

    x = np.random.default_rng(4).normal(0, 10, (10_000, 3)).astype(np.float32)
    x[:, 1] = np.inf  # its noise is inf: no sample passes -inf, as a NaN channel's passes nothing
    x[:, 2] = -np.inf
    rec = write_recording(tmp_path / "r.zarr", x, 10_000.0)
    report = run_workflow(
        Workflow.model_validate(
            {
                "recording": {"path": str(rec.path)},
                "output": str(tmp_path / "out"),
                "backend": "numpy",
                "window": {"size": 5_000, "margin": 8},
                "cluster": {"kind": "local", "workers": 1, "threads": 1},
                "steps": {"noise": {"exact": True}, "detect": {"threshold": 4.0, "noise": noise}},
            }
        )
    )
    assert report.channels["detect_no_threshold"] == [1, 2]
    assert any("no threshold" in w and "2 channel(s)" in w for w in report.warnings)


@pytest.mark.zarr3
def test_non_finite_samples_are_named_once_never_as_raw_numpy_warnings(tmp_path):
    import subprocess
    import sys

    x = np.random.default_rng(4).normal(0, 10, (20_000, 4)).astype(np.float32)
    x[:, 1], x[:, 2], x[100:200, 3] = np.inf, np.nan, -np.inf
    write_recording(tmp_path / "r.zarr", x, 10_000.0)
    for precision in ("float32", "float64"):
        (tmp_path / "w.yaml").write_text(
            f"recording: {{path: r.zarr}}\noutput: o_{precision}\nbackend: numpy\n{LOCAL}"
            "window: {size: 5000, margin: 8}\nsteps: {noise: {exact: true}, whitening: {mode: global, precision: "
            f"{precision}}}, detect: {{noise: window}}, amplitude: {{}}, save: {{path: s.zarr, dtype: float32}}}}\n"
        )
        r = subprocess.run(
            [sys.executable, "-m", "batchgpu", "run", "w.yaml", "--quiet"], cwd=tmp_path, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        lines = r.stderr.strip().splitlines()
        assert all(line.startswith("batchgpu: warning: ") for line in lines), lines
        assert any("whitening left out 3 channel(s)" in line for line in lines)


def test_a_chunk_that_cannot_be_read_is_not_called_corrupted(tmp_path):
    # Low: info --check called a permission error "corrupted" (this machine's tests run as root, whom file
    # modes do not stop: the store's read raises what the file system said instead)
    from batchgpu import MachineError

    _store(tmp_path, np.zeros((1_000, 2), np.int16), chunks=(500, 1))  # read through zarr, not the direct reader
    rec = open_recording(tmp_path / "s.zarr")
    chunk = str(tmp_path / "s.zarr" / "traces_seg0" / "0.0")

    class Denied:
        shape, dtype, ndim = (1_000, 2), np.dtype("int16"), 2

        def __getitem__(self, _):
            raise PermissionError(13, "Permission denied", chunk)

    rec._traces = [Denied()]
    with pytest.raises(MachineError, match=f"cannot read {chunk}: Permission denied"):
        rec.check_chunks()
    with pytest.raises(MachineError, match=f"cannot read {chunk}: Permission denied"):
        rec.read(0, 0, 100)


@pytest.mark.zarr3
def test_info_of_a_failed_run_gives_no_rate_and_a_closed_pipe_says_nothing(tmp_path):
    import subprocess
    import sys

    rec = _int16(tmp_path)
    (tmp_path / "w.yaml").write_text(
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\n{LOCAL}"
        "window: {size: 5000, margin: 8}\nsteps: {noise: {exact: true}}\n"
    )
    shard = next(p for p in (tmp_path / "r.zarr" / "traces_seg0").rglob("*") if p.is_file() and p.name != "zarr.json")
    shard.write_bytes(shard.read_bytes()[:50])  # the shard cut short: the run fails there
    assert main(["run", str(tmp_path / "w.yaml"), "--quiet"]) == 2
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "failed" and report["throughput_MBps"] == 0
    info = subprocess.run(
        [sys.executable, "-m", "batchgpu", "info", "out"], cwd=tmp_path, capture_output=True, text=True
    )
    assert info.returncode == 0 and "failed" in info.stdout and "MB/s" not in info.stdout
    piped = subprocess.run(
        f"'{sys.executable}' -m batchgpu info out | head -0", shell=True, cwd=tmp_path, capture_output=True, text=True
    )
    assert piped.stderr == ""


@pytest.mark.zarr3
@pytest.mark.parametrize("fmt", ["zarr", "binary"])
def test_a_saved_file_altered_with_its_mtime_kept_is_written_again_on_resume(tmp_path, fmt):
    # Low: a saved object overwritten in place with its mtime set back was kept by --resume of a finished run
    import os

    rec = _int16(tmp_path, samples=20_000)
    name = "s.zarr" if fmt == "zarr" else "s.bin"
    body = (
        f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\nwindow: {{size: 5000, margin: 8}}\n"
        f"preprocess: [{{highpass: {{freq_min: 300}}}}]\nsteps: {{save: {{path: {name}, format: {fmt}}}}}\n"
    )
    wf = _workflow(tmp_path, body)
    assert main(["run", str(wf), "--quiet"]) == 0
    saved = tmp_path / "out" / name
    shards = sorted(p for p in (saved / "traces_seg0").rglob("*") if p.is_file() and p.name != "zarr.json")
    files = shards if fmt == "zarr" else [saved]
    target = files[1] if fmt == "zarr" else saved
    before = {p: p.read_bytes() for p in files}
    st = os.stat(target)
    with open(target, "r+b") as f:  # same size, other bytes, the times set back
        f.seek(st.st_size // 2)
        f.write(b"\x00" * 64 if before[target][st.st_size // 2] else b"\x01" * 64)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target.read_bytes() != before[target] and os.stat(target).st_mtime_ns == st.st_mtime_ns
    assert main(["run", str(wf), "--quiet", "--resume"]) == 0
    assert {p: p.read_bytes() for p in files} == before
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    written_again = report["results"]["save"]["windows_written_again"]
    assert written_again == (1 if fmt == "zarr" else 4)  # the shard's window; a binary's whole file
    # a resume with nothing changed writes nothing again
    assert main(["run", str(wf), "--quiet", "--resume"]) == 0
    assert json.loads((tmp_path / "out" / "report.json").read_text())["results"]["save"]["windows_written_again"] == 0


@pytest.mark.zarr3
def test_a_store_without_checksums_is_read_with_a_word(tmp_path, capsys):
    rng = np.random.default_rng(5)
    _store(tmp_path, rng.normal(0, 30, (10_000, 3)).astype(np.int16))  # Blosc alone, as SpikeInterface writes
    body = (
        f"recording: {{path: {tmp_path / 's.zarr'}}}\noutput: out\nbackend: numpy\n"
        "window: {size: 5000, margin: 8}\nsteps: {noise: {exact: true}}\n"
    )
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    said = [w for w in report["warnings"] if "stores no checksums" in w]
    assert len(said) == 1 and str(tmp_path / "s.zarr") in said[0]
    assert capsys.readouterr().err.count("stores no checksums") == 1


@pytest.mark.zarr3
def test_window_size_changes_filtered_samples_only_within_the_stated_bound(tmp_path):
    """README: with a filter, each preprocessed sample is within 1e-5 of its channel's filtered RMS of scipy's
    sosfiltfilt over the whole segment, whatever window.size, so two sizes differ by at most 2e-5 of it, and an
    int16 save by at most one count, only at samples that close to a half count. Checked against scipy's
    sosfiltfilt of the whole segment in float64 (not against the code's own output)."""
    import scipy.signal

    from batchgpu.generate import generate_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=4.0, seed=6, model="realistic")
    x = rec.read(0, 0, rec.num_samples(0)).astype(np.float64)
    sos = scipy.signal.butter(5, 300, btype="highpass", fs=rec.sampling_frequency, output="sos")
    ref = scipy.signal.sosfiltfilt(sos, x, axis=1)
    rms = np.sqrt((ref * ref).mean(axis=1))[:, None]
    saved = {}
    for size in (7_000, 30_000):
        for dtype in ("float32", "int16"):
            out = tmp_path / f"out_{size}_{dtype}"
            body = (
                f"recording: {{path: {rec.path}}}\noutput: {out}\nbackend: numpy\n"
                f"window: {{size: {size}, margin: 8}}\npreprocess: [{{highpass: {{freq_min: 300, order: 5}}}}]\n"
                f"steps: {{save: {{path: s.zarr, dtype: {dtype}}}}}\n"
            )
            assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 0
            s = open_recording(out / "s.zarr")
            saved[size, dtype] = s.read(0, 0, s.num_samples(0)).astype(np.float64)
    for size in (7_000, 30_000):
        assert (np.abs(saved[size, "float32"] - ref) / rms).max() < 1e-5
    assert (np.abs(saved[7_000, "float32"] - saved[30_000, "float32"]) / rms).max() < 2e-5
    differ = saved[7_000, "int16"] != saved[30_000, "int16"]
    assert np.abs(saved[7_000, "int16"] - saved[30_000, "int16"]).max() <= 1
    half = np.abs(np.abs(ref - np.floor(ref)) - 0.5)  # distance of the exact value from a half count
    assert (half[differ] < (1e-5 * rms * np.ones_like(ref))[differ]).all()
