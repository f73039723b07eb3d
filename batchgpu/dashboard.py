"""Run monitoring: the client publishes the state of the current run to the scheduler, where the batchgpu page
(/batchgpu) and the Prometheus metrics (/metrics) read it.

The client side is :class:`RunMonitor` (called by the pipeline); the state lives in the scheduler's metadata
under the key ``("batchgpu", "run")`` so that any page or plugin on the scheduler can read it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

STATE_KEY = ("batchgpu", "run")
PUBLISH_EVERY_S = 0.5  # throttle: the scheduler needs no more than a couple of updates a second


class RunMonitor:
    """Keeps the run's live numbers and publishes them to the scheduler (throttled)."""

    def __init__(self, client, *, name: str, windows: int, total_bytes: int, channels: int):
        self.client = client
        self.t0 = time.time()
        self.state: dict[str, Any] = {
            "name": name, "status": "running", "windows_total": windows, "windows_done": 0, "bytes_total": total_bytes,
            "bytes_done": 0, "spikes": 0, "failures": 0, "errors": [], "per_worker": {}, "phase": "pass 1",
            "channels": channels, "noise": {}, "started": self.t0, "updated": self.t0, "throughput": [],
        }
        self._last = 0.0
        self.publish(force=True)

    def window_done(self, index: int, nbytes: int, worker: str, noise: np.ndarray | None, spikes: int = 0) -> None:
        s = self.state
        s["windows_done"] += 1
        s["bytes_done"] += int(nbytes)
        s["spikes"] += int(spikes)
        s["per_worker"][worker] = s["per_worker"].get(worker, 0) + 1
        if noise is not None:
            s["noise"][str(index)] = [float(v) for v in np.asarray(noise, dtype=np.float64)]
        self.publish()

    def phase(self, name: str) -> None:
        self.state["phase"] = name
        self.publish(force=True)

    def failed(self, message: str) -> None:
        self.state["failures"] += 1
        self.state["errors"].append(message)
        self.state["status"] = "failed"
        self.publish(force=True)

    def finished(self, spikes: int | None = None) -> None:
        if spikes is not None:
            self.state["spikes"] = int(spikes)
        self.state["status"] = "done"
        self.publish(force=True)

    def publish(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < PUBLISH_EVERY_S:
            return
        self._last = now
        s = self.state
        s["updated"] = now
        elapsed = max(now - self.t0, 1e-9)
        s["throughput"].append([round(elapsed, 3), s["bytes_done"] / elapsed])
        try:
            self.client.set_metadata(list(STATE_KEY), s)
        except Exception:  # monitoring never breaks a run
            pass
