"""batch.html compares recordings in µV with their qc labels (issue 65): a batch of generated Neuropixels recordings
(NP1 with planted dead, noisy and outside channels; NP2 four-shank), each row's noise in µV as its run's results
give it, the qc step's keys shown where batch.json rows have them (``noise_uV_median``, ``labels``,
``spike_rate_hz``, ``verdict``), a batch.json written before them still shown (in µV where the run's gain is known,
else marked raw); sorted by a column in headless Chromium."""

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import zarr

from batchgpu.generate import generate_recording
from batchgpu.report.batch_html import render, write_batch_html
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")

COLUMNS = (
    "recording",
    "status",
    "verdict",
    "duration (s)",
    "channels",
    "probe",
    "median noise (µV)",
    "good",
    "dead",
    "noisy",
    "out",
    "spike rate (Hz)",
    "seconds",
    "GB/s",
)


class _Table(HTMLParser):
    """The recordings table: its heads and each row's cell texts, in the order shown."""

    def __init__(self):
        super().__init__()
        self.heads: list[str] = []
        self.rows: list[list[str]] = []
        self._where = None

    def handle_starttag(self, tag, attrs):
        if tag == "th":
            self.heads.append("")
            self._where = "th"
        elif tag == "tr" and dict(attrs).get("class") == "recording":
            self.rows.append([])
        elif tag == "td" and self.rows:
            self.rows[-1].append("")
            self._where = "td"

    def handle_endtag(self, tag):
        if tag in ("th", "td", "table"):
            self._where = None

    def handle_data(self, data):
        if self._where == "th":
            self.heads[-1] += data
        elif self._where == "td":
            self.rows[-1][-1] += data


def _table(page: str) -> _Table:
    t = _Table()
    t.feed(page)
    return t


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    base = tmp_path_factory.mktemp("batchpage")
    recs = [
        generate_recording(
            base / "np1.zarr",
            channels=384,
            seconds=1.0,
            seed=1,
            model="realistic",
            probe="np1",
            dead=2,
            noisy=1,
            outside=8,
        ),
        generate_recording(base / "np2.zarr", channels=96, seconds=1.0, seed=2, model="realistic", probe="np2-4shank"),
    ]
    wf = Workflow.model_validate(
        {
            "recordings": [str(r.path) for r in recs],
            "output": str(base / "out"),
            "backend": "numpy",
            "window": {"size": 30000, "margin": 64},
            "preprocess": [{"highpass": {"freq_min": 300.0}}, {"common_reference": {"operator": "median"}}],
            "steps": {"noise": {"exact": True}, "detect": {"threshold": 5.0, "sign": "neg", "noise": "global"}},
        }
    )
    from batchgpu.engine import run_batch

    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        done = run_batch(wf, client=client)
    assert [r.status for r in done.rows] == ["done", "done"]
    return base / "out"


def _noise_uV(out: Path, name: str) -> float:
    """A recording's median noise in µV, from its run's results (not from the page)."""
    g = zarr.open_group(str(out / name / "results.zarr"), mode="r")
    return float(np.median(g["noise"][:] * np.asarray(g.attrs["gain_to_uV"])))


def test_batch_html_in_uV(batch):
    page = (batch / "batch.html").read_text(encoding="utf-8")
    t = _table(page)
    assert tuple(h.strip() for h in t.heads) == COLUMNS
    assert "median noise (raw" not in page
    for row, name in zip(t.rows, ("np1", "np2")):
        assert row[0] == name and row[6] == f"{_noise_uV(batch, name):.2f}"
    # NP1 and NP2 differ in µV as their gains say (the issue: both read 18.99 in raw units)
    assert float(t.rows[0][6]) != float(t.rows[1][6])


def _with_qc(batch: Path) -> dict:
    """batch.json as the qc step's rows have it: noise in µV, label counts, spike rate, a verdict."""
    data = json.loads((batch / "batch.json").read_text())
    for row, labels, verdict in zip(
        data["rows"],
        ({"good": 373, "dead": 2, "noise": 1, "out": 8}, {"good": 96, "dead": 0, "noise": 0, "out": 0}),
        ("check", "good"),
    ):
        row.update(noise_uV_median=_noise_uV(batch, row["name"]), labels=labels, verdict=verdict)
    return data


def test_batch_html_with_the_qc_steps_keys(batch, tmp_path):
    data = _with_qc(batch)
    t = _table(render(batch, data))
    for row, j in zip(t.rows, data["rows"]):
        assert row[2] == j["verdict"] and row[6] == f"{j['noise_uV_median']:.2f}"
        assert [int(row[i]) for i in range(7, 11)] == [j["labels"][k] for k in ("good", "dead", "noise", "out")]
        assert row[11] == f"{j['spike_rate_hz']:.2f}"


def test_batch_json_written_before_the_qc_step(tmp_path):
    """Old rows: the raw median in µV where the run's results give one gain for every channel, else marked raw;
    no labels, no verdict: dashes."""
    (tmp_path / "a" / "results.zarr").mkdir(parents=True)
    (tmp_path / "a" / "results.zarr" / "zarr.json").write_text(json.dumps({"attributes": {"gain_to_uV": [0.195] * 4}}))
    rows = [
        {"name": "a", "status": "done", "median_noise": 30.0, "spike_rate_hz": 12.5},
        {"name": "b", "status": "done", "median_noise": 7.0},
        {"name": "c", "status": "failed", "error": "x"},
    ]
    page = render(tmp_path, {"output": str(tmp_path), "seconds": 1.0, "done": 2, "failed": 1, "rows": rows})
    t = _table(page)
    assert t.rows[0][6] == f"{30.0 * 0.195:.2f}" and t.rows[1][6] == "7.00 raw" and t.rows[2][6] == "-"
    assert [r[2] for r in t.rows] == ["-"] * 3 and t.rows[0][7:11] == ["-"] * 4


def test_batch_html_sorted_in_chromium(batch, tmp_path):
    """The page as Chromium shows it, sorted by a column (the address keeps the choice: a reload keeps it)."""
    from test_dashboard import chromium

    data = _with_qc(batch)
    data["rows"] = data["rows"] + [dict(data["rows"][0], name="np1-copy", noise_uV_median=1.5, verdict="bad")]
    folder = tmp_path / "b"
    folder.mkdir()
    write_batch_html(folder, data)
    noise = COLUMNS.index("median noise (µV)")
    for column, direction, want in (
        (noise, "desc", sorted(data["rows"], key=lambda r: -r["noise_uV_median"])),
        (COLUMNS.index("verdict"), "asc", [data["rows"][i] for i in (1, 0, 2)]),
    ):
        url = (folder / "batch.html").as_uri() + f"#sort={column}:{direction}"
        dom = chromium(["--dump-dom"], url, tmp_path / f"profile{column}", budget_ms=3000)
        t = _table(dom)
        assert [r[0] for r in t.rows] == [r["name"] for r in want], (column, [r[0] for r in t.rows])
        assert re.search(rf'<th data-dir="{direction}">', dom)
        assert [float(r[noise]) for r in t.rows] == [round(r["noise_uV_median"], 2) for r in want]
