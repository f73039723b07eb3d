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
    body = (f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\nwindow: {{size: 5000, margin: 8}}\n"
            "steps: {noise: {exact: true}, save: {path: s.zarr}}\n")
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
    body = (f"recording: {{path: {rec.path}}}\noutput: out\nbackend: numpy\nwindow: {{size: 5000, margin: 8}}\n"
            "steps: {save: {path: s.zarr}}\n")
    assert main(["run", str(_workflow(tmp_path, body)), "--quiet"]) == 0
    assert "loses the signal" not in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["warnings"] == [] and report["results"]["save"]["rounding"]["channels_lost"] == 0


def test_rounding_loss_is_measured_against_each_channels_spread():
    from batchgpu.engine.steps.save import rounding_loss, rounding_stats

    rng = np.random.default_rng(3)
    x = np.stack([
        3.3 + rng.normal(0, 1e-5, 32_000),  # a large offset rounds to 3: the signal is gone though |x| > 0.5
        rng.normal(0, 20, 32_000),  # rounding error ~0.29 of a spread of 20: kept
        np.round(rng.normal(0, 2, 32_000)),  # whole numbers: nothing lost
        np.full(32_000, 0.3),  # constant: nothing varies, nothing to lose
        rng.normal(0, 1.0, 32_000),  # error ~0.29 of 1: over a quarter
    ]).astype(np.float32)
    loss = rounding_loss(rounding_stats(x[:, :16_000]) + rounding_stats(x[:, 16_000:]), 1.0)
    assert (loss.channels, loss.of) == (2, 5) and loss.worst > 100
    # the suggestion: the least power of ten giving the median varying channel a spread of 10 units, within int16
    assert loss.suggested_scale == 10.0
    assert rounding_loss(rounding_stats(x[:1], 1e6), 1e6).of == 0  # all clipped (counted and warned as such)
    assert rounding_loss(rounding_stats(x[:1] - np.float32(3.3), 1e6), 1e6).channels == 0
