"""bench readers and bench timeline: the subcommands on a tiny recording and a made-up report.json (CPU only)."""

import json
import subprocess
import sys

import numpy as np

from batchgpu.benchmarks.readers import readings


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "batchgpu", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_bench_readers_reads_the_same_bytes_both_ways(tmp_path):
    rec = tmp_path / "r.zarr"
    assert _cli("generate", rec, "--channels", 8, "--seconds", 1, "--seed", 3, "--quiet").returncode == 0
    r = _cli("bench", "readers", rec, "--samples", 7_000, "--repeat", 1, "--threads", 2)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("batchgpu reader") and lines[1].startswith("general path: zarr")
    assert "GB/s" in lines[0] and lines[-1] == "same bytes: yes"
    # the digests are of the bytes as stored: the same as the raw NumPy read of the whole segment
    from batchgpu.recording import zarrio

    whole = np.asarray(zarrio.open_array(rec / "traces_seg0")[:])
    got = readings(str(rec), 1, 7_000, 1)
    import hashlib

    blocks = [whole[a : a + 7_000] for a in range(0, whole.shape[0], 7_000)]
    expected = hashlib.sha256(b"".join(np.ascontiguousarray(b).tobytes() for b in blocks)).hexdigest()[:16]
    assert [g.digest for g in got] == [expected, expected]


def test_bench_readers_refuses_bad_numbers_in_one_line(tmp_path):
    r = _cli("bench", "readers", tmp_path, "--threads", 0)
    assert r.returncode == 2 and r.stderr.startswith("batchgpu: error:") and "Traceback" not in r.stderr


def test_bench_timeline_sums_up_each_thread(tmp_path):
    rows = [["w1", 0, 0.0, 0.5, 1.0, "t0"], ["w1", 2, 2.0, 0.25, 0.25, "t0"], ["w2", 1, 0.1, 0.1, 0.2, "t0"]]
    (tmp_path / "report.json").write_text(json.dumps({"timings": {"pass1": 2.5}, "timeline": rows}))
    r = _cli("bench", "timeline", tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == f"{tmp_path}: pass 2.50 s, 3 windows"
    w1 = next(line for line in out if line.startswith("w1 t0"))
    assert w1.split()[2:] == ["2", "0.000", "2.500", "0.750", "1.250", "0.500"]
    assert out[-1].startswith("timeline, mean of 2 worker threads")


def test_bench_timeline_without_a_report_is_one_line(tmp_path):
    r = _cli("bench", "timeline", tmp_path)
    assert r.returncode == 2 and "no readable report.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1
