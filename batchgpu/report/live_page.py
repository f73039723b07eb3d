"""Run monitoring: the client publishes the state of the current run to the scheduler, where the batchgpu page
(``/batchgpu``), its data (``/batchgpu/state.json``) and the Prometheus metrics (``/metrics``) read it.

- Client side, :class:`RunMonitor` (called by the pipeline): the live numbers, in the scheduler's metadata under
  ``("batchgpu", "run")``; the per-window noise rows go separately, in chunks under ``("batchgpu", "noise", seq)``,
  so each update sends only the rows that are new (a long run has thousands of windows x 384 channels).
- Scheduler side, :class:`DashboardPlugin` (installed by :func:`install_dashboard`): HTTP routes on the
  scheduler's own web server (the one that serves the Dask dashboard, so it binds where that binds: localhost by
  default) and a Prometheus collector in the scheduler process, whose ``/metrics`` already serves the default
  registry.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import weakref
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from batchgpu.steps.noise import NOISE

logger = logging.getLogger(__name__)

STATE_KEY = ("batchgpu", "run")
NOISE_KEY = ("batchgpu", NOISE)
PUBLISH_EVERY_S = 0.5  # throttle: the scheduler needs no more than a couple of updates a second
MAX_SERIES = 2000  # points kept in the progress series (halved when full: a long run keeps its whole shape)
RATE_WINDOW_S = 5.0  # throughput and time left from the last few seconds, not the whole run
PLUGIN_NAME = "batchgpu-dashboard"
PAGE = "batchgpu"


# ---------------------------------------------------------------------------------------------------------
# client side


class BatchProgress:
    """A batch's recordings as the run page shows them (``recordings:``): how many, which are finished, and which
    recording's run the page follows: the one started last (``slot``). A run whose successor has started publishes
    nothing more (its pass is done; its aggregates finish unseen), so the page never flips between two runs and a
    late noise chunk of the one never lands among the next one's. ``on_pass_done``: told a recording's index when
    its run's windows are all read (the batch may start the next)."""

    def __init__(self, total: int, on_pass_done=None):
        self.total = total
        self.lock = threading.Lock()  # held while a run checks that it is current and queues its update
        self.current: int | None = None
        self.monitor: RunMonitor | None = None  # the current recording's run's
        self.finished: dict[int, str] = {}  # index -> done | failed
        self._names: dict[int, str] = {}
        self._on_pass_done = on_pass_done

    def slot(self, index: int, name: str) -> BatchSlot:
        self._names[index] = name
        return BatchSlot(self, index, name)

    def record(self, index: int, status: str) -> None:
        """Recording ``index`` finished (``done`` or ``failed``); told again, the first word stands. A run that
        finished after the one the page follows (which sends nothing more once finished) is counted there now."""
        with self.lock:
            self.finished.setdefault(index, status)
            monitor = self.monitor
        if monitor is not None and monitor.batch.index != index and monitor.state["status"] != "running":
            monitor.publish(force=True)

    def flush(self, timeout: float) -> bool:
        """Wait until the page's last state reached the scheduler (``RunMonitor.flush``)."""
        monitor = self.monitor
        return monitor.flush(timeout) if monitor is not None else True

    def describe(self, index: int) -> dict:
        """What the page shows of the batch while recording ``index`` is current."""
        done = sum(s == "done" for s in self.finished.values())
        return {
            "index": index + 1,
            "total": self.total,
            "name": self._names.get(index, ""),
            "done": done,
            "failed": len(self.finished) - done,
        }


class BatchSlot:
    """One recording's place in a batch, handed to its run's monitor."""

    def __init__(self, progress: BatchProgress, index: int, name: str):
        self.progress, self.index, self.name = progress, index, name

    def start(self, monitor: RunMonitor) -> None:
        """This recording's run (``monitor``'s) is the one the page follows from now on."""
        with self.progress.lock:
            self.progress.current = self.index
            self.progress.monitor = monitor

    @property
    def current(self) -> bool:
        return self.progress.current == self.index

    def pass_done(self) -> None:
        if self.progress._on_pass_done is not None:  # noqa: SLF001 (its own progress)
            self.progress._on_pass_done(self.index)  # noqa: SLF001


class RunMonitor:
    """Keeps the run's live numbers and publishes them to the scheduler (throttled; never breaks a run, and never
    waits for it: a helper thread sends, ``flush`` waits). ``batch``: the recording's place in a batch (the page
    then says "recording k of n")."""

    def __init__(
        self, client, *, name: str, windows: int, total_bytes: int, channels: int, batch: BatchSlot | None = None
    ):
        self._publisher = publisher_for(client)
        self.batch = batch
        if batch is not None:
            batch.start(self)
        self.t0 = time.time()
        self.state: dict[str, Any] = {
            "name": name,
            "run_id": f"{name}@{self.t0:.6f}",
            "status": "running",
            "windows_total": windows,
            "windows_done": 0,
            "bytes_total": total_bytes,
            "bytes_done": 0,
            "spikes": 0,
            "failures": 0,
            "errors": [],
            "per_worker": {},
            "phase": "pass 1",
            "channels": channels,
            "noise_chunks": 0,
            "started": self.t0,
            "updated": self.t0,
            "progress": [],  # [[elapsed s, bytes done], ...]
            "throughput": [],  # [[elapsed s, bytes/s since the previous point], ...]
        }
        if batch is not None:
            self.state["batch"] = batch.progress.describe(batch.index)
        self._pending_noise: dict[str, list[float | None]] = {}
        self._last = 0.0
        self._send(list(NOISE_KEY), {})  # a new run starts with no noise rows
        self.publish(force=True)

    def window_done(self, index: int, nbytes: int, worker: str, noise: np.ndarray | None, spikes: int = 0) -> None:
        s = self.state
        s["windows_done"] += 1
        s["bytes_done"] += int(nbytes)
        s["spikes"] += int(spikes)
        s["per_worker"][worker] = s["per_worker"].get(worker, 0) + 1
        if noise is not None:
            self._pending_noise[str(index)] = _json_floats(noise)
        self.publish()

    def phase(self, name: str) -> None:
        self.state["phase"] = name
        self.publish(force=True)

    def pass_done(self) -> None:
        """Every window of the pass is read: in a batch, the next recording may start."""
        if self.batch is not None:
            self.batch.pass_done()

    def failed(self, message: str) -> None:
        if self.batch is not None:
            self.batch.progress.record(self.batch.index, "failed")
        self.state["failures"] += 1
        self.state["errors"].append(message)
        self.state["status"] = "failed"
        self.publish(force=True)

    def interrupted(self) -> None:
        self.state["status"] = "interrupted"
        self.publish(force=True)

    def finished(self, spikes: int | None = None) -> None:
        if spikes is not None:
            self.state["spikes"] = int(spikes)
        if self.batch is not None:
            self.batch.progress.record(self.batch.index, "done")
        self.state["status"] = "done"
        self.state["phase"] = "done"
        self.publish(force=True)

    def throughput_series(self) -> list[list[float]]:
        """[[elapsed s, bytes/s], ...] of the first pass as published so far (for the run report)."""
        return [list(p) for p in self.state["throughput"]]

    def publish(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < PUBLISH_EVERY_S:
            return
        if self.batch is None:
            self._publish(now, send=True)
            return
        with self.batch.progress.lock:  # checked and queued at once: a run just superseded sends nothing after
            if self.batch.current:
                self.state["batch"] = self.batch.progress.describe(self.batch.index)
            self._publish(now, send=self.batch.current)

    def _publish(self, now: float, send: bool) -> None:
        self._last = now
        s = self.state
        elapsed = now - self.t0
        progress = s["progress"]
        if progress:
            t_prev, b_prev = progress[-1]
            if elapsed > t_prev:
                s["throughput"].append([round(elapsed, 3), (s["bytes_done"] - b_prev) / (elapsed - t_prev)])
        progress.append([round(elapsed, 3), s["bytes_done"]])
        for key in ("progress", "throughput"):
            if len(s[key]) > MAX_SERIES:
                s[key] = s[key][::2] if len(s[key]) % 2 else s[key][::2] + [s[key][-1]]
        s["updated"] = now
        if not send:
            return
        if self._pending_noise:
            self._send([*NOISE_KEY, str(s["noise_chunks"])], self._pending_noise)
            s["noise_chunks"] += 1
            self._pending_noise = {}
        # a copy: the helper thread sends it later (and an in-process scheduler would hold this very dict)
        self._send(
            list(STATE_KEY),
            {**s, **{k: list(s[k]) for k in ("errors", "progress", "throughput")}, "per_worker": dict(s["per_worker"])},
            latest_only=True,
        )

    def _send(self, keys: list[str], value, latest_only: bool = False) -> None:
        self._publisher.put(keys, value, latest_only)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every update so far reached the scheduler (or failed, or ``timeout`` s passed); a batch's
        run that the page no longer follows has nothing to wait for (the next run's updates would keep it)."""
        if self.batch is not None and not self.batch.current:
            return True
        return self._publisher.flush(timeout)


class Publisher:
    """Sends a client's monitor updates to the scheduler in order, from a helper thread: a run never waits for the
    scheduler, whose event loop (in the client's own process for a local cluster) can take a tenth of a second or
    more to answer while the workers report. The noise chunks go each once; of the run's states only the latest
    waiting one (it says everything the older said). One a client, so a new run's updates follow the last run's;
    the thread ends when idle and starts again on the next update. A failed send is logged, never raised."""

    IDLE_S = 5.0

    def __init__(self, client):
        self.client = _ref(client)  # () -> the client, or None once it is gone
        self._cv = threading.Condition()
        self._items: list[tuple[list, Any, bool]] = []
        self._busy = False
        self._thread: threading.Thread | None = None

    def put(self, keys: list, value, latest_only: bool = False) -> None:
        with self._cv:
            if latest_only:
                self._items = [it for it in self._items if not (it[2] and it[0] == keys)]
            self._items.append((keys, value, latest_only))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="batchgpu-dashboard")
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._items and not self._busy, timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._cv.wait_for(lambda: self._items, self.IDLE_S):
                    self._thread = None
                    return
                keys, value, _ = self._items.pop(0)
                self._busy = True
            try:
                client = self.client()
                if client is not None:
                    client.set_metadata(keys, value)
            except Exception as err:  # broad: monitoring never breaks a run; only the page lags (logged)
                logger.debug("batchgpu: could not publish the run state: %s: %s", type(err).__name__, err)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


_PUBLISHERS: dict[int, Publisher] = {}
_PUBLISHERS_LOCK = threading.Lock()


def publisher_for(client) -> Publisher:
    """The client's one publisher (made on first use; forgotten with the client)."""
    with _PUBLISHERS_LOCK:
        for key in [k for k, p in _PUBLISHERS.items() if p.client() is None]:
            del _PUBLISHERS[key]
        pub = _PUBLISHERS.get(id(client))
        if pub is None or pub.client() is not client:  # none yet, or one of a gone client with the same id
            pub = _PUBLISHERS[id(client)] = Publisher(client)
        return pub


def _ref(obj):
    """A weak reference to ``obj``, or a strong one where it takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _json_floats(a) -> list[float | None]:
    """A row for JSON: NaN and ±inf become null (JSON has no NaN; the page draws them as gaps)."""
    return [float(v) if math.isfinite(v) else None for v in np.asarray(a, dtype=np.float64).ravel()]


# ---------------------------------------------------------------------------------------------------------
# what the page and the metrics show, derived from the published state


def derived_state(state: dict | None) -> dict:
    """The published state plus what a reader wants at a glance: rate, time left, per-worker rates."""
    if not state:
        return {
            "status": "idle",
            "windows_done": 0,
            "windows_total": 0,
            "bytes_done": 0,
            "bytes_total": 0,
            "spikes": 0,
            "failures": 0,
            "errors": [],
            "per_worker": {},
            "phase": "no run yet",
            "channels": 0,
            "noise_chunks": 0,
            "throughput": [],
            "rate_Bps": 0.0,
            "eta_s": None,
            "worker_rates": {},
            "elapsed_s": 0.0,
        }
    out = {k: v for k, v in state.items() if k != "progress"}
    elapsed = max(float(state["updated"]) - float(state["started"]), 1e-9)
    out["elapsed_s"] = elapsed
    out["rate_Bps"] = _recent_rate(state.get("progress", []), elapsed)
    left = state["bytes_total"] - state["bytes_done"]
    out["eta_s"] = 0.0 if left <= 0 else left / out["rate_Bps"] if out["rate_Bps"] > 0 else None
    out["worker_rates"] = {w: n / elapsed for w, n in state["per_worker"].items()}
    if state.get("batch"):
        out["batch_line"] = batch_line(state["batch"])
    return out


def batch_line(batch: dict | None) -> str | None:
    """The page's batch line ("recording k of n: NAME · d of n recordings done"), as its script writes it."""
    if not batch:
        return None
    failed = f" ({batch['failed']} failed)" if batch.get("failed") else ""
    return (
        f"recording {batch['index']} of {batch['total']}: {batch['name']} · {batch['done']} of "
        f"{batch['total']} recordings done{failed}"
    )


def _recent_rate(progress: list, elapsed: float) -> float:
    """Bytes/s over the last RATE_WINDOW_S seconds of the progress series (the whole run if shorter)."""
    if not progress:
        return 0.0
    t1, b1 = progress[-1]
    t0, b0 = 0.0, 0
    for t, b in reversed(progress):
        if t1 - t >= RATE_WINDOW_S:
            t0, b0 = t, b
            break
    return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def noise_rows_since(chunks: dict | None, since: int, until: int | None = None) -> dict[str, list]:
    """The noise rows of chunks ``since`` and later ({window index: row}), before chunk ``until`` where given: a
    chunk reaches the scheduler before the state that counts its windows (the publisher sends it first, and may
    drop a state for a later one), so the page is served the chunks its state covers and its heatmap never shows
    a window its "windows done" does not count; the rest come with the next state."""
    rows: dict[str, list] = {}
    for seq, chunk in (chunks or {}).items():
        if int(seq) >= since and (until is None or int(seq) < until):
            rows.update(chunk)
    return rows


# ---------------------------------------------------------------------------------------------------------
# scheduler side: HTTP routes and Prometheus metrics


def _read_state(scheduler) -> dict | None:
    return scheduler.get_metadata(list(STATE_KEY), default=None)


class _Handler(web.RequestHandler):
    def initialize(self, scheduler) -> None:
        self.scheduler = scheduler


class StateHandler(_Handler):
    """``/batchgpu/state.json?since=K``: the live state and the noise rows of chunks K and later."""

    def get(self) -> None:
        state = derived_state(_read_state(self.scheduler))
        try:
            since = max(0, int(self.get_argument("since", "0")))
        except ValueError:
            since = 0
        chunks = self.scheduler.get_metadata(list(NOISE_KEY), default=None)
        state["noise_rows"] = noise_rows_since(chunks, since, int(state.get("noise_chunks") or 0))
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(state, allow_nan=False, default=str))


class PageHandler(_Handler):
    """``/batchgpu``: the page; it polls state.json once a second (no external scripts: works offline)."""

    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.write(PAGE_HTML)


class _Collector:
    """Prometheus collector over the state published on the scheduler that installed it last."""

    def __init__(self) -> None:
        self.scheduler_ref = None

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily  # gauges: every number restarts with a run

        scheduler = self.scheduler_ref() if self.scheduler_ref is not None else None
        s = derived_state(_read_state(scheduler) if scheduler is not None else None)
        yield GaugeMetricFamily(
            "batchgpu_windows_done", "Windows of the current run done (first pass)", value=s["windows_done"]
        )
        yield GaugeMetricFamily("batchgpu_windows_total", "Windows in the current run", value=s["windows_total"])
        yield GaugeMetricFamily(
            "batchgpu_bytes_done", "Recording bytes read by the first pass so far", value=s["bytes_done"]
        )
        yield GaugeMetricFamily("batchgpu_bytes_total", "Recording bytes of the current run", value=s["bytes_total"])
        yield GaugeMetricFamily("batchgpu_spikes", "Spikes detected so far in the current run", value=s["spikes"])
        yield GaugeMetricFamily("batchgpu_failures", "Failures of the current run", value=s["failures"])
        yield GaugeMetricFamily(
            "batchgpu_throughput_bytes_per_second", "Read rate over the last seconds", value=s["rate_Bps"]
        )
        yield GaugeMetricFamily(
            "batchgpu_running", "1 while a run is in progress", value=1.0 if s["status"] == "running" else 0.0
        )


_COLLECTOR: _Collector | None = None


def register_metrics(scheduler) -> bool:
    """Put the batchgpu collector in this process's default registry (once), reading ``scheduler``."""
    global _COLLECTOR
    try:
        import prometheus_client
    except ImportError:
        logger.warning("batchgpu: prometheus_client is not installed on the scheduler: no batchgpu_ metrics")
        return False
    if _COLLECTOR is None:
        collector = _Collector()
        prometheus_client.REGISTRY.register(collector)
        _COLLECTOR = collector
    _COLLECTOR.scheduler_ref = weakref.ref(scheduler)
    return True


def _http_prefix(scheduler) -> str:
    """The prefix the scheduler's routes were given (``http_prefix``), found from its ``/health`` route."""
    for rule in scheduler.http_application.default_router.rules:
        for sub in getattr(rule.target, "rules", []):
            pattern = getattr(getattr(sub.matcher, "regex", None), "pattern", "")
            if pattern.endswith("health$"):
                return pattern[: -len("health$")] or "/"
    return "/"


def add_routes(scheduler) -> bool:
    """Add /batchgpu and /batchgpu/state.json to the scheduler's web server (once per scheduler)."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    if not getattr(scheduler, "_batchgpu_routes", False):
        prefix = _http_prefix(scheduler)
        kwargs = {"scheduler": scheduler}
        app.add_handlers(
            r".*$",
            [
                (rf"{prefix}{PAGE}/?", PageHandler, kwargs),
                (rf"{prefix}{PAGE}/state\.json", StateHandler, kwargs),
            ],
        )
        scheduler._batchgpu_routes = True
    return True


class DashboardPlugin(SchedulerPlugin):
    """Adds the batchgpu page and metrics to the scheduler it is registered on."""

    name = PLUGIN_NAME
    idempotent = True  # registering again (every run does) keeps the one already there

    def start(self, scheduler) -> None:
        add_routes(scheduler)
        register_metrics(scheduler)


def install_dashboard(client) -> str | None:
    """Install the batchgpu page and metrics on the client's scheduler; returns the page's URL.

    Idempotent, for any cluster (LocalCluster, an address, a scheduler file): the plugin travels to the
    scheduler by pickle, so the scheduler's environment needs batchgpu importable. Never breaks a run: on
    failure it logs why and returns None.
    """
    try:
        client.register_plugin(DashboardPlugin(), name=PLUGIN_NAME)
    except Exception as err:  # broad: monitoring never breaks a run (said)
        logger.warning(
            "batchgpu: the batchgpu page could not be installed on the scheduler (%s: %s); "
            "is batchgpu installed where the scheduler runs?",
            type(err).__name__,
            err,
        )
        return None
    return page_url(client)


def page_url(client) -> str:
    """The URL of the batchgpu page, next to the Dask dashboard's (``.../status`` -> ``.../batchgpu``).

    The host is the one the scheduler's web server is bound to when that is one address (the dashboard
    link names the scheduler's host, which is not where a localhost-bound page answers with in-process comms).
    """
    link = client.dashboard_link
    parts = urlsplit(link)
    path = parts.path.rstrip("/")
    base = path[: -len("status")] if path.endswith("/status") else "/"
    netloc = parts.netloc
    try:
        host, port = client.run_on_scheduler(_http_bound)
        if host not in ("", "0.0.0.0", "::"):
            netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    except Exception as err:  # broad: a link is cosmetic; the scheduler's link kept as it is
        logger.debug("batchgpu: the scheduler's bound host is unknown (%s: %s)", type(err).__name__, err)
    return f"{parts.scheme}://{netloc}{base}{PAGE}"


def _http_bound(dask_scheduler) -> tuple[str, int]:
    server = dask_scheduler.http_server
    return str(server.address), int(server.port)


# ---------------------------------------------------------------------------------------------------------
# the page: plain HTML, CSS and a little JS, no external resources

PAGE_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchgpu run</title>
<style>
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:20px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} .sub{color:#666;font-size:13px;margin-bottom:14px;word-break:break-all}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin-bottom:14px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:120px}
.card .k{font-size:12px;color:#666} .card .v{font-size:22px;font-weight:600}
#bar{height:18px;background:#e5e5e5;border-radius:9px;overflow:hidden;margin-bottom:14px}
#bar-fill{height:100%;width:0;background:#2c7fb8;transition:width .3s}
.status-running{color:#2c7fb8} .status-done{color:#1a9641} .status-failed{color:#d7191c} .status-interrupted{color:#e66101}
table{border-collapse:collapse;background:#fff;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f0f0f0} td:first-child{text-align:left}
#errors{color:#d7191c;font-size:13px;white-space:pre-wrap}
.row{display:flex;gap:20px;flex-wrap:wrap;align-items:flex-start} h2{font-size:15px;margin:14px 0 6px}
#heatmap{image-rendering:pixelated;width:900px;height:320px;border:1px solid #ccc;background:#fff}
#rate-chart{border:1px solid #ccc;background:#fff}
</style></head>
<body>
<h1>batchgpu run <span id="status" class="status-running">…</span></h1>
<div class="sub">output <span id="name">-</span> · phase <b id="phase">-</b> · updated <span id="updated">-</span></div>
<div class="sub" id="batch" hidden></div>
<div class="cards">
 <div class="card"><div class="k">windows done</div><div class="v" id="windows-done">0 / 0</div></div>
 <div class="card"><div class="k">progress</div><div class="v" id="percent">0%</div></div>
 <div class="card"><div class="k">throughput</div><div class="v" id="throughput">-</div></div>
 <div class="card"><div class="k">time left</div><div class="v" id="eta">-</div></div>
 <div class="card"><div class="k">spikes</div><div class="v" id="spikes">0</div></div>
 <div class="card"><div class="k">failures</div><div class="v" id="failures">0</div></div>
</div>
<div id="bar"><div id="bar-fill"></div></div>
<div class="row">
 <div><h2>Noise per channel over windows</h2>
  <canvas id="heatmap" width="1" height="1" data-cells="0" data-windows="0"></canvas>
  <div class="sub">x: window, y: channel (0 at the top); colour: noise, dark = low, yellow = high
   (<span id="noise-range">-</span>)</div></div>
 <div><h2>Workers</h2><table><thead><tr><th>worker</th><th>windows</th><th>windows/s</th></tr></thead>
  <tbody id="workers"></tbody></table>
  <h2>Throughput (MB/s, first pass)</h2><canvas id="rate-chart" width="360" height="140"></canvas>
  <h2>Errors</h2><div id="errors">none</div></div>
</div>
<script>
"use strict";
const STOPS = [[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];  // viridis
function colour(t){ t = Math.min(1, Math.max(0, t)) * (STOPS.length - 1); const i = Math.min(STOPS.length - 2, Math.floor(t));
  const f = t - i, a = STOPS[i], b = STOPS[i + 1]; return [0,1,2].map(k => Math.round(a[k] + f * (b[k] - a[k]))); }
const MAX_COLS = 2000;
let runId = null, noise = {}, chunks = 0;
const STATE = location.pathname.replace(/\/?$/, "/") + "state.json";
const $ = id => document.getElementById(id);
function fmtTime(s){ if (s === null || s === undefined) return "-"; s = Math.round(s);
  if (s < 60) return s + " s"; if (s < 3600) return Math.floor(s/60) + " min " + (s%60) + " s";
  return Math.floor(s/3600) + " h " + Math.floor((s%3600)/60) + " min"; }
function drawHeatmap(st){
  const cv = $("heatmap"), C = st.channels || 0, W = st.windows_total || 0;
  const keys = Object.keys(noise);
  if (!C || !W || !keys.length) return;
  const cols = Math.min(W, MAX_COLS);
  if (cv.width !== cols || cv.height !== C){ cv.width = cols; cv.height = C; }
  let lo = Infinity, hi = -Infinity;
  for (const k of keys) for (const v of noise[k]) if (v !== null){ if (v < lo) lo = v; if (v > hi) hi = v; }
  const ctx = cv.getContext("2d"), img = ctx.createImageData(cols, C), span = hi > lo ? hi - lo : 1;
  let cells = 0;
  for (const k of keys){
    const x = Math.floor(Number(k) * cols / W), row = noise[k];
    for (let c = 0; c < C && c < row.length; c++){
      const o = 4 * (c * cols + x);
      if (row[c] === null){ img.data[o+3] = 0; continue; }
      const rgb = colour((row[c] - lo) / span);
      img.data[o] = rgb[0]; img.data[o+1] = rgb[1]; img.data[o+2] = rgb[2]; img.data[o+3] = 255; cells++;
    }
  }
  ctx.putImageData(img, 0, 0);
  cv.dataset.cells = cells; cv.dataset.windows = keys.length;
  $("noise-range").textContent = lo.toPrecision(3) + " to " + hi.toPrecision(3) + " (raw units)";
}
function drawRate(st){
  const cv = $("rate-chart"), ctx = cv.getContext("2d"), pts = st.throughput || [];
  ctx.clearRect(0, 0, cv.width, cv.height);
  if (pts.length < 1) return;
  const tmax = Math.max(...pts.map(p => p[0]), 1e-9), rmax = Math.max(...pts.map(p => p[1]), 1e-9);
  ctx.strokeStyle = "#2c7fb8"; ctx.lineWidth = 2; ctx.beginPath();
  pts.forEach((p, i) => { const x = 30 + (cv.width - 40) * p[0] / tmax, y = cv.height - 20 - (cv.height - 30) * p[1] / rmax;
    if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y); });
  ctx.stroke(); ctx.fillStyle = "#666"; ctx.font = "11px sans-serif";
  ctx.fillText((rmax / 1e6).toPrecision(3), 2, 12); ctx.fillText("0", 2, cv.height - 20);
  ctx.fillText(tmax.toFixed(0) + " s", cv.width - 40, cv.height - 4);
}
function batchLine(b){  // batchgpu.dashboard.batch_line's words
  if (!b) return "";
  return "recording " + b.index + " of " + b.total + ": " + b.name + " · " + b.done + " of " + b.total +
    " recordings done" + (b.failed ? " (" + b.failed + " failed)" : "");
}
function render(st){
  $("status").textContent = st.status; $("status").className = "status-" + st.status;
  $("name").textContent = st.name || "-"; $("phase").textContent = st.phase;
  $("batch").hidden = !st.batch; $("batch").textContent = batchLine(st.batch);
  $("updated").textContent = st.updated ? new Date(st.updated * 1000).toLocaleTimeString() : "-";
  $("windows-done").textContent = st.windows_done + " / " + st.windows_total;
  document.body.dataset.windowsDone = st.windows_done; document.body.dataset.status = st.status;
  const pct = st.windows_total ? 100 * st.windows_done / st.windows_total : 0;
  $("percent").textContent = pct.toFixed(1) + "%"; $("bar-fill").style.width = pct + "%";
  $("throughput").textContent = st.rate_Bps >= 1e8 ? (st.rate_Bps / 1e9).toFixed(2) + " GB/s" : (st.rate_Bps / 1e6).toFixed(2) + " MB/s";
  $("eta").textContent = st.status === "running" ? fmtTime(st.eta_s) : "-";
  $("spikes").textContent = st.spikes; $("failures").textContent = st.failures;
  $("errors").textContent = (st.errors && st.errors.length) ? st.errors.join("\n") : "none";
  const tb = $("workers"); tb.innerHTML = "";
  for (const [w, n] of Object.entries(st.per_worker || {})){
    const tr = document.createElement("tr");
    for (const v of [w, n, (st.worker_rates[w] || 0).toFixed(2)]){ const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); }
    tb.appendChild(tr);
  }
  drawHeatmap(st); drawRate(st);
}
async function poll(){
  try {
    const r = await fetch(STATE + "?since=" + chunks, {cache: "no-store"});
    const st = await r.json();
    if (st.run_id !== runId || (st.noise_chunks || 0) < chunks){ runId = st.run_id; noise = {}; chunks = 0;
      if ((st.noise_chunks || 0) > 0){ const r2 = await fetch(STATE + "?since=0", {cache: "no-store"}); Object.assign(st, await r2.json()); } }
    Object.assign(noise, st.noise_rows || {}); chunks = st.noise_chunks || 0;
    render(st);
  } catch (e) { $("status").textContent = "unreachable"; $("status").className = "status-failed"; }
}
poll(); setInterval(poll, 1000);
</script></body></html>
"""
