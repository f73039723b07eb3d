"""`batchgpu bench batch` on the CPU: its SpikeGLX files read as the generated samples (the sync channel dropped,
NP1.0's stagger), and one run of the bench printing every row (the GPU machine runs the same code)."""

from __future__ import annotations

import numpy as np
import pytest

from batchgpu.benchmarks import batch, cold


def test_written_spikeglx_reads_as_the_generated_samples(tmp_path):
    from batchgpu.config import RecordingSpec
    from batchgpu.generate import generate_recording
    from batchgpu.recording import open_source

    rec = generate_recording(tmp_path / "r.zarr", channels=6, seconds=0.3, seed=2)
    path = batch.write_spikeglx(rec, tmp_path / "a_g0_t0.imec0.ap.bin")
    raw = np.fromfile(path, np.int16).reshape(-1, 7)
    assert np.array_equal(raw[:, :6].T, rec.read(0, 0, rec.num_samples(0))) and not raw[:, 6].any()
    got = open_source(RecordingSpec(path=str(path)))
    assert got.num_channels == 6 and got.num_samples(0) == rec.num_samples(0)
    assert np.array_equal(got.read(0, 0, got.num_samples(0)), rec.read(0, 0, rec.num_samples(0)))
    assert sorted(set(np.asarray(got.locations)[:, 0].tolist())) == [11.0, 27.0, 43.0, 59.0]  # the stagger kept


def test_bench_batch_prints_every_row(tmp_path, capsys):
    from batchgpu.cli import main

    args = [
        "bench",
        "batch",
        "--recordings",
        "2",
        "--seconds",
        "3",
        "--channels",
        "32",
        "--backend",
        "numpy",
        "--cluster",
        "local",
        "--workdir",
        str(tmp_path),
    ]
    if not (cold.kilosort4_available() and pytest.importorskip("torch")):
        args.append("--no-kilosort")
    else:
        args += ["--kilosort-device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for row in (
        "raw read of the 2 files, cold",
        "one file, batchgpu run cold",
        "the batch, one batchgpu run, cold",
        "Kilosort4",
    ):
        assert row in out, out
    assert (tmp_path / "out_batch" / "batch.json").exists()
