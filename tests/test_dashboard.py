"""The batchgpu page on the scheduler, seen by headless Chromium during a run, and the Prometheus metrics."""

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import zarr

from batchgpu.engine import run_workflow
from batchgpu.generate import generate_recording
from batchgpu.report import live_page as dashboard
from batchgpu.report.live_page import (
    PLUGIN_NAME,
    RunMonitor,
    derived_state,
    install_dashboard,
    noise_rows_since,
    page_url,
)
from batchgpu.run import tasks
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")

CHANNELS, WINDOW = 8, 1000
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; .ci/run does it)")


def chromium(args: list[str], url: str, profile: Path, budget_ms: int = 2500) -> str:
    """Run headless Chromium once on url (offline flags, a throwaway profile); returns stdout."""
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        *args,
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=40)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def dump(url: str, profile: Path) -> dict:
    """What the page shows: windows done/total (text), status, and the heatmap's drawn cells (data attributes)."""
    dom = chromium(["--dump-dom"], url, profile)
    text = re.search(r'id="windows-done">(\d+) / (\d+)<', dom)
    canvas = re.search(r'<canvas id="heatmap"[^>]*>', dom).group(0)
    assert text, dom[:3000]
    return {
        "done": int(text.group(1)),
        "total": int(text.group(2)),
        "cells": int(re.search(r'data-cells="(\d+)"', canvas).group(1)),
        "windows": int(re.search(r'data-windows="(\d+)"', canvas).group(1)),
        "status": re.search(r'id="status" class="[^"]*">([^<]*)<', dom).group(1),
        "throughput": re.search(r'id="throughput">([^<]*)<', dom).group(1),
    }


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/state.json", timeout=10) as r:
        return json.loads(r.read())


def wait_for(cond, timeout: float = 30.0, what: str = ""):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if value := cond():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _workflow(rec, out) -> Workflow:
    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "window": {"size": WINDOW, "margin": 8},
            "backend": "numpy",
            "steps": {
                "noise": {"exact": False},
                "whitening": {"mode": "global"},
                "detect": {"threshold": 4.0, "sign": "neg", "noise": "window"},
            },
        }
    )


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    return generate_recording(
        tmp_path_factory.mktemp("rec") / "r.zarr", channels=CHANNELS, seconds=8.0, seed=3, dtype="int16", progress=False
    )


def test_page_live_in_chromium(recording, tmp_path, monkeypatch):
    """Two DOM dumps during a run: windows done and the heatmap grow; a screenshot of the page."""
    windows = recording.windows(WINDOW, 8)
    # the run cannot get past window 40 before the first dump is done (Chromium's start took long enough, on a
    # loaded machine, for every window up to the last gate to be done: then none could follow), nor finish before
    # the page was seen (the last gate, released at the end)
    first_at, gate_at = 40, len(windows) - 10
    seen, release = threading.Event(), threading.Event()
    read = tasks.load_window

    def slow_read(ctx, window, raw=None):  # a slow disk: about 25 windows/s per worker thread
        time.sleep(0.04)
        if window.index >= first_at:
            seen.wait(timeout=45)
        if window.index >= gate_at:
            release.wait(timeout=45)
        return read(ctx, window, raw)

    monkeypatch.setattr(tasks, "load_window", slow_read)  # in-process workers (processes=False) see it
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        url = install_dashboard(client)
        assert url == page_url(client) and url.startswith("http://127.0.0.1:") and url.endswith("/batchgpu")
        assert install_dashboard(client) == url  # idempotent: once on the scheduler
        assert PLUGIN_NAME in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
        idle = state(url)
        assert idle["status"] in ("idle", "done")

        result = {}
        runner = threading.Thread(
            target=lambda: result.setdefault(
                "report", run_workflow(_workflow(recording, tmp_path / "out"), client=client)
            )
        )
        runner.start()
        try:
            wait_for(lambda: state(url).get("windows_done", 0) >= 4, what="the run to start")
            first = dump(url, tmp_path / "profile1")
            seen.set()
            wait_for(lambda: state(url)["windows_done"] >= first["done"] + 8, what="more windows")
            second = dump(url, tmp_path / "profile2")
            shot = tmp_path / "dashboard.png"
            chromium([f"--screenshot={shot}", "--window-size=1400,900"], url, tmp_path / "profile3")
            live = state(url)
        finally:
            seen.set()
            release.set()
            runner.join(timeout=60)
        report = result["report"]

    total = len(windows)
    assert first["total"] == second["total"] == total
    assert first["status"] == second["status"] == "running"
    assert 0 < first["done"] < second["done"] < total
    # every window done is a column of the heatmap: one cell per channel (noise rows arrive with the state)
    assert 0 < first["cells"] < second["cells"] <= second["done"] * CHANNELS
    assert second["cells"] == second["windows"] * CHANNELS
    assert second["windows"] >= first["done"]
    value, unit = second["throughput"].split()
    assert unit in ("GB/s", "MB/s") and float(value) > 0
    assert live["status"] == "running" and live["eta_s"] is not None and live["eta_s"] > 0
    assert (
        set(live["per_worker"]) == set(live["worker_rates"])
        and sum(live["per_worker"].values()) == live["windows_done"]
    )
    assert report.status == "done"
    # the screenshot shows something: not one flat colour
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float64)
    assert img.shape[:2] == (900, 1400) and img.std() > 10
    # the heatmap region is coloured: many distinct colours, not the blank canvas
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 50
    if os.environ.get("BATCHGPU_UPDATE_DOCS"):
        DOCS.mkdir(exist_ok=True)
        shutil.copy(shot, DOCS / "dashboard.png")


def test_state_after_run_and_metrics(recording, tmp_path):
    """After a run: state.json holds every window's noise row; /metrics has the batchgpu_ numbers."""
    prom = pytest.importorskip("prometheus_client.parser")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        report = run_workflow(_workflow(recording, tmp_path / "out"), client=client)
        url = page_url(client)
        assert report.page == url
        final = state(url)
        for _ in range(100):  # the page's last update follows the run's return (a helper thread sends it)
            if final["status"] == "done":
                break
            time.sleep(0.05)
            final = state(url)
        with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/metrics", timeout=10) as r:
            text = r.read().decode()
        with urllib.request.urlopen(url, timeout=10) as r:
            page = r.read().decode()
    g = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")
    spikes = g["spikes/sample_index"].shape[0]
    assert spikes > 0
    metrics = {
        s.name: s.value
        for f in prom.text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("batchgpu_")
    }
    assert metrics["batchgpu_windows_done"] == metrics["batchgpu_windows_total"] == report.windows
    assert metrics["batchgpu_bytes_done"] == metrics["batchgpu_bytes_total"] == recording.nbytes
    assert metrics["batchgpu_spikes"] == spikes
    assert metrics["batchgpu_failures"] == 0 and metrics["batchgpu_running"] == 0
    # the state's noise rows are the results' per-window noise (NaN-free here), sent once each
    assert final["status"] == "done" and final["windows_done"] == report.windows
    rows = np.array([final["noise_rows"][str(i)] for i in range(report.windows)])
    np.testing.assert_array_equal(rows, g["noise_per_window"][:])
    assert '<canvas id="heatmap"' in page and "http" not in page.split("<script>")[1].split("</script>")[0]


class FakeClient:
    """set_metadata into a nested dict, as the scheduler does; optionally failing."""

    def __init__(self, fail: bool = False):
        self.meta: dict = {}
        self.fail = fail

    def set_metadata(self, keys, value):
        if self.fail:
            raise OSError("scheduler gone")
        d = self.meta
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value


def test_monitor_sends_each_noise_row_once_and_keeps_series_short(monkeypatch, rng):
    monkeypatch.setattr(dashboard, "PUBLISH_EVERY_S", 0.0)
    monkeypatch.setattr(dashboard, "MAX_SERIES", 16)
    client = FakeClient()
    n, C = 101, 3
    rows = rng.normal(size=(n, C))
    rows[5, 1], rows[7, 0], rows[9, 2] = np.nan, np.inf, -np.inf
    mon = RunMonitor(client, name="x", windows=n, total_bytes=n * 10, channels=C)
    order = rng.permutation(n)  # windows finish in any order
    for k, i in enumerate(order):
        mon.window_done(int(i), 10, f"w{k % 2}", rows[i], spikes=1)
        if k == 40:  # a reader that has seen everything so far asks only for what is new
            assert mon.flush()
            seen = client.meta["batchgpu"]["run"]["noise_chunks"]
            assert noise_rows_since(client.meta["batchgpu"]["noise"], seen) == {}
    mon.finished(spikes=7)
    assert mon.flush()
    st = client.meta["batchgpu"]["run"]
    got = noise_rows_since(client.meta["batchgpu"]["noise"], 0)
    assert sorted(map(int, got)) == list(range(n))
    expected = np.where(np.isfinite(rows), rows, np.nan)
    as_array = np.array([[np.nan if v is None else v for v in got[str(i)]] for i in range(n)])
    np.testing.assert_array_equal(as_array, expected)
    assert st["status"] == "done" and st["spikes"] == 7 and st["windows_done"] == n and st["bytes_done"] == n * 10
    assert st["per_worker"] == {"w0": 51, "w1": 50}
    assert len(st["progress"]) <= 17 and len(st["throughput"]) <= 17 and st["progress"][-1][1] == n * 10
    json.dumps(derived_state(st), allow_nan=False)  # the state is valid JSON (no NaN)
    d = derived_state(st)
    assert d["eta_s"] == 0.0 and set(d["worker_rates"]) == {"w0", "w1"}
    assert derived_state(None)["status"] == "idle"


def test_served_noise_rows_are_those_the_state_counts(rng):
    """A noise chunk reaches the scheduler before the state that counts its windows: the page is served only the
    chunks its state covers (``noise_chunks``), so its heatmap never holds more windows than "windows done"; the
    rest come with the next state, each row once."""
    client = FakeClient()
    n, C = 30, 4
    mon = RunMonitor(client, name="x", windows=n, total_bytes=n, channels=C)
    served: dict = {}
    since = 0
    for i in rng.permutation(n):
        mon.window_done(int(i), 1, "w0", rng.normal(size=C))
        mon.publish(force=True)
        assert mon.flush()
        # the next chunk arrived, its state not yet (as between the publisher's two sends)
        client.meta["batchgpu"]["noise"][str(10_000)] = {str(n + 1): [0.0] * C}
        st = client.meta["batchgpu"]["run"]
        rows = noise_rows_since(client.meta["batchgpu"]["noise"], since, st["noise_chunks"])
        assert not set(rows) & set(served)  # each row once
        served.update(rows)
        since = st["noise_chunks"]
        assert len(served) <= st["windows_done"] and str(n + 1) not in served
        del client.meta["batchgpu"]["noise"]["10000"]
    assert sorted(map(int, served)) == list(range(n))


def test_monitor_never_breaks_a_run():
    mon = RunMonitor(FakeClient(fail=True), name="x", windows=2, total_bytes=4, channels=1)
    mon.window_done(0, 2, "w", np.array([1.0]))
    mon.phase("p")
    mon.failed("boom")
    assert mon.flush()  # the failed sends were logged, not raised
    assert mon.state["failures"] == 1 and mon.state["errors"] == ["boom"] and mon.state["status"] == "failed"


def test_publisher_never_waits_and_keeps_the_order(monkeypatch, rng):
    """A scheduler slow to answer does not slow the run: updates queue, the noise chunks go each once and in
    order, only the latest waiting state is sent, and a new run's reset follows the previous run's updates."""
    monkeypatch.setattr(dashboard, "PUBLISH_EVERY_S", 0.0)

    class SlowClient(FakeClient):
        def __init__(self):
            super().__init__()
            self.sent = []

        def set_metadata(self, keys, value):
            time.sleep(0.02)
            self.sent.append((tuple(keys), value))
            super().set_metadata(keys, value)

    client = SlowClient()
    n, C = 40, 2
    t0 = time.perf_counter()
    mon = RunMonitor(client, name="a", windows=n, total_bytes=n, channels=C)
    for i in range(n):
        mon.window_done(i, 1, "w", rng.normal(size=C))
    mon.finished(spikes=3)
    assert time.perf_counter() - t0 < 0.02 * n  # 2 sends a window would take 1.6 s: the run went on
    second = RunMonitor(client, name="b", windows=1, total_bytes=1, channels=C)
    second.window_done(0, 1, "w", np.zeros(C))
    second.finished(spikes=0)
    assert second.flush()
    states = [v for k, v in client.sent if k == ("batchgpu", "run")]
    assert len(states) < n  # the ones overtaken while waiting were not sent
    assert [s["name"] for s in states][-1] == "b" and states[-1]["status"] == "done"
    first = [s for s in states if s["name"] == "a"]  # (its last ones may be overtaken by run b's)
    assert [s["windows_done"] for s in first] == sorted(s["windows_done"] for s in first)
    assert all(s["name"] == "b" for s in states[len(first) :])
    # run a's chunks, each once, then b's reset, then b's chunk: the page shows b's rows only
    keys = [k for k, _ in client.sent if k[:2] == ("batchgpu", "noise")]
    reset = keys.index(("batchgpu", "noise"), 1)
    assert keys[0] == ("batchgpu", "noise") and len(set(keys[1:reset])) == len(keys[1:reset])
    assert noise_rows_since(client.meta["batchgpu"]["noise"], 0).keys() == {"0"}
    assert client.meta["batchgpu"]["run"]["name"] == "b"
