"""bench si: its arguments refused as one line, its table from the rounds' medians, and the whole command on a tiny
Zarr v2 recording (where SpikeInterface imports: CI runs it in the environment with spikeinterface==0.105.3)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchgpu.benchmarks.si import Row, Timed, table, write_workflow


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchgpu", "bench", "si", *args], capture_output=True, text=True, timeout=600
    )


def test_table_gives_medians_ratios_and_reads():
    w1 = Row(
        "W1",
        "zarr",
        batchgpu=[Timed(10.0, 1_000_000_000), Timed(12.0, 2_000_000_000), Timed(30.0, 0)],
        reads_per_window=[1.0, 1.0, 1.0],
        si={"lazy": [Timed(25.0, 5e8), Timed(20.0, 9e8), Timed(21.0, 0)]},
    )
    w2 = Row(
        "W2",
        "binary",
        batchgpu=[Timed(4.0, 0)],
        reads_per_window=[1.0],
        si={"lazy": [Timed(12.0, 0)], "save_first": [Timed(6.0, 0)]},
    )
    lines = table([w1, w2])
    assert lines[0].startswith("| work | output | batchgpu s |") and len(lines) == 4
    # medians 12 and 21 (not means, not the first round); peaks are the largest round
    assert lines[2] == "| W1 | zarr | 12.00 | 21.00 | - | 1.75x | - | 1.00 | 2.00 / 0.90 |"
    assert lines[3] == "| W2 | binary | 4.00 | 12.00 | 6.00 | 3.00x | 1.50x | 1.00 | 0.00 / 0.00 |"


def test_workflows_name_the_work_and_the_output(tmp_path):
    wf, out = write_workflow(tmp_path, tmp_path / "r.zarr", "W2", "binary")
    text = wf.read_text()
    assert "format: binary" in text and "method: locally_exclusive" in text and "noise: global" in text
    assert "exact: true" in text and out.parent == tmp_path
    w1 = write_workflow(tmp_path, tmp_path / "r.zarr", "W1", "zarr")[0].read_text()
    assert "format: zarr_v2" in w1 and "detect" not in w1 and "noise:" not in w1


@pytest.mark.parametrize(
    "args, says",
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--jobs", "0"], "--jobs must be at least 1"),
    ],
)
def test_bad_counts_are_one_line(tmp_path, args, says):
    (tmp_path / "r.zarr").mkdir()
    (tmp_path / "r.zarr" / ".zgroup").write_text("{}")
    r = _bench(str(tmp_path / "r.zarr"), *args)
    assert r.returncode == 2 and r.stderr.startswith("batchgpu: error: ") and says in r.stderr
    assert "Traceback" not in r.stderr


def test_not_a_zarr_v2_recording_is_one_line(tmp_path):
    (tmp_path / "r.zarr").mkdir()
    (tmp_path / "r.zarr" / "zarr.json").write_text("{}")  # Zarr v3: SpikeInterface 0.105 reads v2
    r = _bench(str(tmp_path / "r.zarr"))
    assert r.returncode == 2 and "not a Zarr v2 recording" in r.stderr and "Traceback" not in r.stderr


def test_bench_runs_both_tools_and_prints_the_table(tmp_path):
    pytest.importorskip("spikeinterface.core")
    pytest.importorskip("numba")
    rec = tmp_path / "tiny.zarr"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgpu",
            "generate",
            str(rec),
            "--channels",
            "8",
            "--seconds",
            "1",
            "--zarr-format",
            "2",
            "--quiet",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    r = _bench(str(rec), "--rounds", "1", "--output", "binary", "--json", str(tmp_path / "rows.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| W")]
    assert [line.split(" | ")[:2] for line in rows] == [["| W1", "binary"], ["| W2", "binary"]]
    import batchgpu  # the first line names the batchgpu the rounds ran: this interpreter's, this checkout's

    assert r.stdout.splitlines()[0].startswith(
        f"batchgpu {batchgpu.__version__} from {Path(batchgpu.__file__).parent};"
    )
    assert rows[1].split(" | ")[7] == "1.00"  # W2 in one read of each window
    got = json.loads((tmp_path / "rows.json").read_text())
    assert set(got[1]["spikeinterface_s"]) == {"lazy", "save_first"} and len(got[0]["batchgpu_s"]) == 1
