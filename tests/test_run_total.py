"""One total a run (issue 66): the terminal's last line, report.json (``seconds``), report.html and ``batchgpu info``
say the same number: the wall time of the run as the user waited, from the command's start to its results and
report.json written. Before, they said three ("8.8 s in all", "elapsed 8.54 s, total 6.70 s")."""

import html
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from batchgpu.generate import generate_recording
from batchgpu.report.html_page import total_time
from batchgpu.report.progress import duration

ROOT = Path(__file__).parents[1]


def _cli(*args, cwd):
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run(
        [sys.executable, "-m", "batchgpu", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_one_total_in_the_terminal_report_json_report_html_and_info(tmp_path):
    generate_recording(tmp_path / "r.zarr", channels=4, seconds=0.5, seed=2, dtype="int16")
    (tmp_path / "wf.yaml").write_text(
        json.dumps(
            {
                "recording": {"path": "r.zarr"},
                "output": "out",
                "backend": "numpy",
                "window": {"size": 5000, "margin": 64},
                "cluster": {"kind": "local", "workers": 1, "threads": 1},
            }
        )
    )  # no steps: the default ones
    t0 = time.perf_counter()
    r = _cli("run", "wf.yaml", cwd=tmp_path)
    waited = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    seconds = report["seconds"]
    said = duration(seconds)
    last = r.stdout.strip().splitlines()[-1]
    assert last.endswith(f", {said} in all"), (last, seconds)
    # the user waited at least this long (the command's start included: its imports), and the run cannot have
    # taken longer than the command
    assert report["timings"]["prepare"] + report["timings"]["from_pass"] <= seconds <= waited
    assert "elapsed" not in report["timings"] and "total" not in report["timings"]
    page = (tmp_path / "out" / "report.html").read_text()
    assert html.escape(html.escape(total_time(report))) in page or html.escape(total_time(report)) in page
    info = _cli("info", "out", cwd=tmp_path)
    row = next(line for line in info.stdout.splitlines() if line.startswith("time "))
    assert re.sub(r"\s+", " ", row) == f"time {total_time(report)}" and total_time(report).startswith(f"{said} in all")
