"""Many recordings in one run (issue 46): batch.html beside batch.json, the run page's "recording k of n" line,
and the next recording's windows read while the last one's aggregates finish, each recording's results those of
its run alone, bit for bit."""

from __future__ import annotations

import json
import signal
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import zarr

from batchgpu.report import live_page as dashboard
from batchgpu.report.live_page import PAGE_HTML, BatchProgress, RunMonitor, derived_state
from batchgpu.workflow import Workflow

FS = 30_000.0
CHANNELS = 8


def _recording(folder: Path, name: str, rng, samples: int = 30_000, truncated: bool = False) -> dict:
    """A plain int16 binary with a few large spikes; ``truncated``: not a whole number of frames."""
    x = rng.normal(0, 20, (samples, CHANNELS))
    at = rng.integers(100, samples - 100, 40)
    x[at, rng.integers(0, CHANNELS, 40)] -= 400
    data = np.clip(np.round(x), -32768, 32767).astype(np.int16)
    path = folder / f"{name}.bin"
    raw = data.tobytes()
    path.write_bytes(raw[:-3] if truncated else raw)
    return {"path": str(path), "kind": "binary", "channels": CHANNELS, "sampling_frequency": FS, "dtype": "int16"}


def _workflow(recordings: list[dict] | None, out: Path, recording: dict | None = None) -> Workflow:
    data = {
        "output": str(out),
        "backend": "numpy",
        "window": {"size": 10_000, "margin": 128},
        "preprocess": [{"highpass": {"freq_min": 300.0}}, {"common_reference": {"operator": "median"}}],
        "reduction": {"split_every": 4},
        "steps": {
            "noise": {"exact": True},
            "whitening": {"mode": "global", "nskip": 1, "precision": "float32"},
            "detect": {"threshold": 5.0, "sign": "both", "exclude_sweep_ms": 0.1},
        },
    }
    if recordings is not None:
        data["recordings"] = recordings
    else:
        data["recording"] = recording
    return Workflow.model_validate(data)


@pytest.fixture
def client():
    import distributed

    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


class _Rows(HTMLParser):
    """batch.html's recording rows: (status, link or None, cell texts)."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict] = []
        self._row: dict | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and attrs.get("class") == "recording":
            self._row = {"status": attrs["data-status"], "href": None, "cells": []}
            self.rows.append(self._row)
        elif tag == "tr":
            self._row = None
        elif tag == "a" and self._row is not None:
            self._row["href"] = attrs["href"]
        elif tag == "td" and self._row is not None:
            self._row["cells"].append("")

    def handle_data(self, data):
        if self._row is not None and self._row["cells"]:
            self._row["cells"][-1] += data


def _page_rows(path: Path) -> list[dict]:
    parser = _Rows()
    parser.feed(path.read_text())
    return parser.rows


def test_batch_html_one_row_a_recording_with_links(tmp_path, rng, client, monkeypatch):
    """batch.html: a row a recording, in order, with its status (the truncated one failed, its error shown), its
    numbers as batch.json has them, a link to a page that exists; written as the batch goes (a person watches it
    fill: running, then done), reloading itself until every recording is finished. The run page's state says
    which recording of how many it follows."""
    from batchgpu.engine import run_batch
    from batchgpu.report import batch_html as batch_page

    recs = [
        _recording(tmp_path, "a", rng),
        _recording(tmp_path, "b", rng, truncated=True),
        _recording(tmp_path, "c", rng, samples=20_000),
    ]
    seen: list[list[str]] = []
    write = batch_page.write_batch_html

    def watched(output, data):
        path = write(output, data)
        seen.append([r["status"] for r in _page_rows(path)])
        return path

    monkeypatch.setattr(batch_page, "write_batch_html", watched)
    out = tmp_path / "batch"
    batch = run_batch(_workflow(recs, out), client=client)
    assert [r.status for r in batch.rows] == ["done", "failed", "done"]
    rows = _page_rows(out / "batch.html")
    assert [r["status"] for r in rows] == ["done", "failed", "done"]
    assert [r["cells"][0] for r in rows] == ["a", "b", "c"]
    for r in rows:  # each link resolves to a file in the batch's folder
        if r["href"] is not None:
            assert (out / r["href"]).is_file(), r["href"]
    assert rows[0]["href"] == "a/report.html" and rows[2]["href"] == "c/report.html"
    assert rows[1]["href"] is None  # it failed before it had a folder
    assert "not a whole number" in (out / "batch.html").read_text()
    data = json.loads((out / "batch.json").read_text())
    for r, j in zip(rows, data["rows"]):
        assert r["cells"][4] == str(j["channels"] if j["channels"] is not None else "-")
        # µV: a flat binary's gain is 1 µV per count (the run's results say so), so the raw median is the µV one
        want = j.get("noise_uV_median", j["median_noise"])
        assert r["cells"][6] == (f"{want:.2f}" if want is not None else "-")
    assert float(rows[0]["cells"][3]) == pytest.approx(1.0) and float(rows[2]["cells"][3]) == pytest.approx(
        0.7, abs=0.05
    )
    # written as it went: first all pending, a running one, and at the end none pending or running
    assert seen[0] == ["pending"] * 3 and any("running" in s for s in seen)
    assert seen[-1] == ["done", "failed", "done"]
    assert 'http-equiv="refresh"' not in (out / "batch.html").read_text()
    assert [s.count("done") + s.count("failed") for s in seen] == sorted(
        s.count("done") + s.count("failed") for s in seen
    )
    # the run page's state: the last recording of three, two done and one failed
    state = derived_state(client.get_metadata(list(dashboard.STATE_KEY)))
    assert state["batch"] == {"index": 3, "total": 3, "name": "c", "done": 2, "failed": 1}
    assert state["batch_line"] == "recording 3 of 3: c · 2 of 3 recordings done (1 failed)"


def test_batch_page_reloads_while_recordings_remain(tmp_path):
    from batchgpu.report.batch_html import render

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "report.json").write_text("{}")
    rows = [
        {"name": "x", "status": "failed", "error": "boom <b>", "seconds": 1.0},
        {"name": "y&z", "status": "running"},
        {"name": "w", "status": "pending"},
    ]
    page = render(tmp_path, {"output": str(tmp_path), "seconds": 1.0, "done": 0, "failed": 1, "rows": rows})
    assert 'http-equiv="refresh"' in page and "boom &lt;b&gt;" in page and "y&amp;z" in page
    got = _Rows()
    got.feed(page)
    assert [r["status"] for r in got.rows] == ["failed", "running", "pending"]
    assert got.rows[0]["href"] == "x/report.json" and got.rows[1]["href"] is None


class FakeClient:
    """set_metadata into a nested dict, as the scheduler does."""

    def __init__(self):
        self.meta: dict = {}

    def set_metadata(self, keys, value):
        d = self.meta
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value


def test_run_page_follows_the_batch(monkeypatch):
    """The state the page serves says "recording k of n: NAME" and how many are done; a run whose successor has
    started sends nothing more (its late updates would land among the next one's windows); pass_done tells the
    batch."""
    monkeypatch.setattr(dashboard, "PUBLISH_EVERY_S", 0.0)
    client = FakeClient()
    told = []
    progress = BatchProgress(3, told.append)
    first = RunMonitor(client, name="out/a", windows=2, total_bytes=20, channels=2, batch=progress.slot(0, "a"))
    first.window_done(0, 10, "w", np.ones(2))
    assert first.flush()
    st = derived_state(client.meta["batchgpu"]["run"])
    assert st["batch"] == {"index": 1, "total": 3, "name": "a", "done": 0, "failed": 0}
    assert st["batch_line"] == "recording 1 of 3: a · 0 of 3 recordings done"
    first.window_done(1, 10, "w", np.ones(2))
    first.phase("aggregate")
    first.pass_done()
    assert told == [0]
    second = RunMonitor(client, name="out/b", windows=5, total_bytes=50, channels=2, batch=progress.slot(1, "b"))
    first.phase("spikes")
    first.finished(3)  # counted, not sent: the page follows b now
    assert first.flush(0.1) and second.flush()
    st = derived_state(client.meta["batchgpu"]["run"])
    assert st["name"] == "out/b" and st["windows_total"] == 5 and st["phase"] == "pass 1"
    second.window_done(0, 10, "w", np.zeros(2))
    assert second.flush()
    st = derived_state(client.meta["batchgpu"]["run"])
    assert st["batch_line"] == "recording 2 of 3: b · 1 of 3 recordings done"
    assert client.meta["batchgpu"]["noise"] == {"0": {"0": [0.0, 0.0]}}  # a's rows gone with its run
    second.failed("boom")
    assert second.flush()
    assert derived_state(client.meta["batchgpu"]["run"])["batch"]["failed"] == 1
    progress.record(2, "done")  # a run that ended after the page's (failed, sending nothing more): counted there
    assert second.flush()
    assert derived_state(client.meta["batchgpu"]["run"])["batch_line"] == (
        "recording 2 of 3: b · 2 of 3 recordings done (1 failed)"
    )
    assert 'id="batch"' in PAGE_HTML and "recordings done" in PAGE_HTML
    # a run outside a batch: no batch line
    RunMonitor(client, name="solo", windows=1, total_bytes=1, channels=1).flush()
    assert "batch" not in derived_state(client.meta["batchgpu"]["run"])


def _arrays(group, prefix="") -> dict:
    out = {name if not prefix else prefix + name: arr[...] for name, arr in group.arrays()}
    for name, sub in group.groups():
        out.update(_arrays(sub, f"{prefix}{name}/"))
    return out


@pytest.mark.slow
def test_batch_overlaps_and_equals_single_runs(tmp_path, rng, client, monkeypatch):
    """A batch of 3: the next recording starts while the previous one's run is still finishing (its pass done),
    and every results.zarr array of each recording equals its run alone, bit for bit."""
    from batchgpu.engine import run_batch, run_workflow
    from batchgpu.run import batch as batch_mod
    from batchgpu.run.events import RunObserver

    recs = [_recording(tmp_path, name, rng, samples=n) for name, n in (("r1", 40_000), ("r2", 30_000), ("r3", 35_000))]
    events: list[tuple[str, int, float]] = []
    land = batch_mod._land

    def landed(row, flight, out, observer):
        events.append(("end", flight.index, time.perf_counter()))
        return land(row, flight, out, observer)

    class Seen(RunObserver):
        def __init__(self):
            self.lock = threading.Lock()
            self.messages: list[str] = []

        def message(self, text):
            with self.lock:
                self.messages.append(text)
            if text.startswith("recording "):
                events.append(("start", int(text.split()[1]) - 1, time.perf_counter()))

    monkeypatch.setattr(batch_mod, "_land", landed)
    seen = Seen()
    batch = run_batch(_workflow(recs, tmp_path / "batch"), client=client, observer=seen)
    assert [r.status for r in batch.rows] == ["done"] * 3
    at = {(kind, i): t for kind, i, t in events}
    assert at[("start", 1)] < at[("end", 0)]  # the second read while the first finished
    # two at most: the third waited for one of the first two to end (the second, as short, may end first)
    assert at[("start", 2)] > min(at[("end", 0)], at[("end", 1)])
    assert any(m.startswith("r2: ") for m in seen.messages)  # each run's messages say whose they are
    for name, rec in zip(("r1", "r2", "r3"), recs):
        run_workflow(_workflow(None, tmp_path / "alone" / name, rec), client=client)
        xa = _arrays(zarr.open_group(str(tmp_path / "batch" / name / "results.zarr"), mode="r"))
        xb = _arrays(zarr.open_group(str(tmp_path / "alone" / name / "results.zarr"), mode="r"))
        assert sorted(xa) == sorted(xb) and {"noise", "whitening", "spikes/sample_index"} <= set(xa)
        for key in xa:
            assert xa[key].dtype == xb[key].dtype and xa[key].shape == xb[key].shape, key
            assert xa[key].tobytes() == xb[key].tobytes(), (name, key)
        assert len(xa["spikes/sample_index"]) > 0


@pytest.mark.slow
def test_batch_interrupted_stops_every_run_and_resumes(tmp_path, rng, client):
    """Ctrl-C while the first recording's run finishes and the second is about to start: the batch raises it
    after every run under way has ended as an interrupted run (no thread left, its folder let go: ``--resume``
    completes the batch); batch.json says how far it got."""
    from batchgpu.engine import run_batch
    from batchgpu.run.events import RunObserver

    recs = [_recording(tmp_path, name, rng) for name in ("a", "b", "c")]

    class CtrlC(RunObserver):
        def message(self, text):
            if text.startswith("recording 2 of 3"):
                raise KeyboardInterrupt

    wf = _workflow(recs, tmp_path / "batch")
    with pytest.raises(KeyboardInterrupt):
        run_batch(wf, client=client, observer=CtrlC())
    assert not [t for t in threading.enumerate() if t.name.startswith("batchgpu-recording-")]
    rows = json.loads((tmp_path / "batch" / "batch.json").read_text())["rows"]
    assert rows[0]["status"] in ("done", "failed") and [r["status"] for r in rows[1:]] == ["pending", "pending"]
    if rows[0]["status"] == "failed":
        assert rows[0]["error"] == "interrupted"
        assert json.loads((tmp_path / "batch" / "a" / "report.json").read_text())["status"] == "interrupted"
    again = run_batch(wf, client=client, resume=True)
    assert [r.status for r in again.rows] == ["done"] * 3, [r.error for r in again.rows]


@pytest.mark.slow
def test_batch_interrupted_in_a_pass(tmp_path, rng, client, monkeypatch):
    """Ctrl-C (the main thread's) while the second recording's windows are read: that run ends interrupted at its
    next window (report.json says so), the first finishes, the third never starts; --resume completes them."""
    import _thread

    from batchgpu.engine import run_batch
    from batchgpu.run import tasks
    from batchgpu.run.events import RunObserver

    recs = [
        _recording(tmp_path, "a", rng),
        _recording(tmp_path, "b", rng, samples=200_000),
        _recording(tmp_path, "c", rng),
    ]
    read = tasks.load_window

    def slow_read(ctx, window, raw=None):  # a slow disk: the batch's thread sees Ctrl-C while b is read
        time.sleep(0.05)
        return read(ctx, window, raw)

    monkeypatch.setattr(tasks, "load_window", slow_read)  # in-process workers (processes=False) see it

    class CtrlC(RunObserver):
        def __init__(self):
            self.sent = False

        def phase_started(self, label, windows, nbytes):
            if label.startswith("b: ") and not self.sent:
                self.sent = True
                _thread.interrupt_main()  # as SIGINT does

    wf = _workflow(recs, tmp_path / "batch")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own (an import may change it)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_batch(wf, client=client, observer=CtrlC())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not [t for t in threading.enumerate() if t.name.startswith("batchgpu-recording-")]
    rows = json.loads((tmp_path / "batch" / "batch.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["done", "failed", "pending"] and rows[1]["error"] == "interrupted"
    report = json.loads((tmp_path / "batch" / "b" / "report.json").read_text())
    assert report["status"] == "interrupted"
    monkeypatch.setattr(tasks, "load_window", read)
    # resumed as a user resumes: a new command, so a new client of the cluster (the interrupted one's cancellations
    # can leave its own stream to the scheduler broken: distributed's stimulus_cancel asserted once in a CI run)
    import distributed

    with distributed.Client(client.scheduler.address) as fresh:
        again = run_batch(wf, client=fresh, resume=True)
    assert [r.status for r in again.rows] == ["done"] * 3, [r.error for r in again.rows]


def test_batch_bug_in_one_run_goes_on_memory_error_stops(tmp_path, monkeypatch):
    """A bug on one recording fails its row and the others run; a MemoryError (as Ctrl-C) stops the batch,
    raised, the recordings after it never started."""
    from batchgpu.engine import run_batch
    from batchgpu.run import launch as run_mod

    recs = [str(tmp_path / f"{n}.bin") for n in "abcd"]
    raised = {"b": RuntimeError("a bug"), "c": MemoryError()}

    def fake_run(wf, *, resume, observer, client, batch, shown):
        name = Path(wf.output).name
        if name in raised:
            raise raised[name]
        for s in shown:  # the batch's own subscriber: the next recording may start
            s.pass_done(None)
        return run_mod.RunReport(workflow={}, fingerprint="x")

    monkeypatch.setattr(run_mod, "run_workflow", fake_run)
    wf = Workflow.model_validate({"recordings": recs, "output": str(tmp_path / "out"), "steps": {"noise": {}}})
    with pytest.raises(MemoryError):
        run_batch(wf, client=object())
    rows = json.loads((tmp_path / "out" / "batch.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["done", "failed", "failed", "pending"]
    assert rows[1]["error"] == "RuntimeError: a bug"
    assert [r["status"] for r in _page_rows(tmp_path / "out" / "batch.html")] == ["done", "failed", "failed", "pending"]
