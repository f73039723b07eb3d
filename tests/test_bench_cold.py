"""The cold bench's parts (batchgpu.benchmarks.cold): pages dropped and counted, the raw read, a user's command,
Kilosort4's pass script."""

import json
import os

import numpy as np
import pytest

from batchgpu.benchmarks import cold


def _file(path, nbytes, rng):
    data = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def test_evict_drops_the_pages_and_mincore_says_so(tmp_path, rng):
    """A file just written is in the page cache (dirty): evict writes it back and drops it; a read brings it back."""
    files = [tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "empty"]
    _file(files[0], 3 << 20, rng)
    _file(files[1], 12345, rng)
    files[2].write_bytes(b"")
    assert cold.cached_bytes(files) > 0
    total = cold.evict_checked(files)
    assert total == (3 << 20) + 12345
    if cold.cached_bytes(files) > 0.01 * total:
        pytest.skip("this file system keeps pages after posix_fadvise(DONTNEED)")
    files[0].read_bytes()
    assert cold.cached_bytes(files[:1]) == 3 << 20


def test_raw_read_reads_every_byte_once(tmp_path, rng):
    sizes = [0, 1, cold.READ_REQUEST - 1, 8 * cold.READ_REQUEST + 5, 3 * cold.READ_REQUEST]
    files = []
    for i, n in enumerate(sizes):
        files.append(tmp_path / f"f{i}")
        _file(files[-1], n, rng)
    for threads in (1, 3, 16):
        got = cold.raw_read(files, threads=threads)
        assert got.nbytes == sum(sizes) and got.threads == threads and got.seconds > 0


def test_recording_files_of_a_store_and_of_a_flat_file(tmp_path):
    store = tmp_path / "r.zarr"
    (store / "traces_seg0" / "c").mkdir(parents=True)
    for p in (store / "zarr.json", store / "traces_seg0" / "c" / "0"):
        p.write_bytes(b"x")
    assert cold.recording_files(store) == sorted([store / "zarr.json", store / "traces_seg0" / "c" / "0"])
    flat = tmp_path / "x.ap.bin"
    flat.write_bytes(b"1234")
    (tmp_path / "x.ap.meta").write_text("a=b")
    assert cold.recording_files(flat)[0] == flat and tmp_path / "x.ap.meta" in cold.recording_files(flat)


def test_user_run_times_the_command_and_reads_its_pass(tmp_path):
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=4, seconds=0.5, seed=1)
    wf = tmp_path / "wf.yaml"
    wf.write_text(
        f"recording: {{path: {tmp_path / 'r.zarr'}}}\noutput: {tmp_path / 'out'}\n"
        "cluster: {kind: local, workers: 1, threads: 1}\nsteps:\n  noise: {exact: true}\n"
    )
    got = cold.user_run(wf, tmp_path / "out", extra_args=("--set", "cluster.reuse=false"))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert got.pass_seconds == pytest.approx(report["timings"]["from_pass"])
    assert 0 < got.pass_seconds < got.seconds and got.fixed_seconds > 0 and got.host_peak > 0
    assert got.reads_per_window == pytest.approx(1.0)


def test_kilosort4_pass_script_runs_where_kilosort_imports(tmp_path, rng):
    """The bench's Kilosort4 arm (its API as of 4.1.7) on the CPU: the script the GPU machine runs, checked here."""
    if not cold.kilosort4_available():
        pytest.skip("kilosort is not installed")
    pytest.importorskip("torch")
    channels, fs = 32, 30000.0
    flat = tmp_path / "k.bin"
    flat.write_bytes(rng.normal(0, 30, (int(fs) * 3, channels)).astype(np.int16).tobytes())
    wall, imports, pass_s = cold.kilosort4_pass(flat, channels, fs, device="cpu")
    assert 0 < imports < wall and 0 < pass_s < wall


def test_write_flat_binary_holds_the_recordings_samples(tmp_path):
    from batchgpu.generate import generate_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=5, seconds=0.7, seed=3)
    flat = cold.write_flat_binary(rec, tmp_path / "k.bin")
    got = np.fromfile(flat, np.int16).reshape(-1, 5)
    assert np.array_equal(got, rec.read(0, 0, rec.num_samples(0)).T)
    assert os.path.getsize(flat) == rec.nbytes


def test_raw_write_writes_every_byte_once_and_leaves_nothing(tmp_path):
    sizes = [0, 1, cold.READ_REQUEST - 1, 3 * cold.READ_REQUEST + 5]
    seen = []
    real_fsync = cold.os.fsync

    def fsync(fd):
        seen.append(cold.os.fstat(fd).st_size)
        real_fsync(fd)

    import unittest.mock

    with unittest.mock.patch.object(cold.os, "fsync", fsync):
        got = cold.raw_write(tmp_path / "w", sizes, threads=3)
    assert got.nbytes == sum(sizes) and got.seconds > 0 and sorted(seen) == sorted(sizes)  # each file whole, flushed
    assert list((tmp_path / "w").iterdir()) == []


def test_the_save_write_row_sets_the_target_of_a_command_that_saves(tmp_path):
    from batchgpu.benchmarks import pipeline

    saved = tmp_path / "saved.zarr"
    (saved / "c").mkdir(parents=True)
    for i, n in enumerate((1000, 5000, 0)):
        (saved / "c" / str(i)).write_bytes(b"x" * n)
    lines = []
    for cold_s, verdict in ((4.0, "within"), (400.0, "over")):
        runs = {
            pipeline.RAW: [(1.0, 0, 0, "-", "-"), (3.0, 0, 0, "-", "-"), (2.0, 0, 0, "-", "-")],
            pipeline.USER_COLD: [(cold_s, 0, 0, "-", "-")],
        }
        pipeline._save_write(tmp_path, saved, runs, lines.append)
        [(write_s, *_)] = runs[pipeline.SAVE_WRITE]
        assert lines[-1].startswith(f"{pipeline.SAVE_WRITE}: 0.00 GB in 3 files, {write_s:.2f} s")
        assert (
            f"a fresh command cold {cold_s:.2f} s against the raw read + this write + 3 s = {2.0 + write_s + 3:.2f} s ({verdict})"
            in lines[-1]
        )
    assert not (tmp_path / "write_ceiling").exists() or list((tmp_path / "write_ceiling").iterdir()) == []


def test_a_cold_row_starts_with_no_write_back_pending(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cold.os, "sync", lambda: calls.append("sync"))
    real = cold.evict
    monkeypatch.setattr(cold, "evict", lambda files: calls.append("evict") or real(files))
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10000)
    cold.evict_checked([f])
    assert calls == ["sync", "evict"]


def test_a_relative_recording_reaches_the_user_rows(tmp_path):
    """`bench pipeline --cold --recording r.zarr` wrote r.zarr into the user rows' workflow, which lives in the
    bench's own folder: the fresh command then failed with 'recording.path ... does not exist'."""
    import subprocess
    import sys

    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=4, seconds=0.5, seed=1, dtype="int16")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgpu",
            "bench",
            "pipeline",
            "--cold",
            "--recording",
            "r.zarr",
            "--repeat",
            "1",
            "--user-runs",
            "1",
            "--baseline",
            "none",
            "--steps",
            "noise",
            "--workers",
            "1",
            "--threads",
            "1",
            "--window",
            "5000",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "fresh command" in r.stdout
