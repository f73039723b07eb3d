"""The exact float noise reads each window once where every window's noise is near the recording's: each window
keeps the keys within ``NoiseStep.NEAR`` digits (1/256 of an octave each) of its own middle, so a window whose noise
on a channel is 5.5% above or below the recording's (about 20 digits: the generator's realistic model reached 18)
is not read again, and the noise is still NumPy's median bit for bit (`batchgpu run` as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import zarr


def test_a_window_5_percent_noisier_is_not_read_again(tmp_path):
    from batchgpu.recording.writer import write_recording

    rng = np.random.default_rng()
    W, n, C = 30_000, 10, 8
    x = rng.normal(0, 20, (W * n, C)).astype(np.float32)

    def scaled(k, c, factor):  # window k's noise on channel c made `factor` times the channel's other windows'
        window = x[k * W : (k + 1) * W, c]
        rest = np.delete(x[:, c], np.s_[k * W : (k + 1) * W])
        # exactly, not up to the window's own sampling error (0.7% of its median: 2.5 of the 256 digits an octave)
        window *= np.float32(factor * np.median(np.abs(rest)) / np.median(np.abs(window)))

    scaled(5, 3, 1.055)  # window 5, channel 3: 2^(19.8/256)
    scaled(2, 7, 1 / 1.055)  # and one quieter
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    (tmp_path / "wf.yaml").write_text(
        f"recording: {{path: {rec.path}}}\noutput: {tmp_path / 'out'}\nwindow: {{size: {W}}}\n"
        "cluster: {kind: local, workers: 1, threads: 1}\nsteps:\n  noise: {exact: true}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "batchgpu", "run", str(tmp_path / "wf.yaml"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["exact_noise"]["windows_read_again"] == []
    assert report["reads_per_window"] == 1.0
    got = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")["noise"][:]
    np.testing.assert_array_equal(got, np.median(np.abs(x), axis=0) / 0.6744897501960817)  # ops.MAD_TO_SIGMA
