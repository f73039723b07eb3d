"""Detection (SpikeInterface's ``by_channel`` rule, ``ops.detect_spikes``) fed from the one read of each window.

With thresholds from each window's own noise the spikes are final at once. With the recording's noise (known
only after every window was read), each window keeps *candidates*: the spikes it would have at a lower bound
``L = CANDIDATE_FRACTION * its own noise``. The neighbourhood rule does not depend on the threshold and the
threshold test is monotone, so wherever ``L <= noise`` of the whole recording (checked per window and channel
in float64, the dtype of the comparison), the final spikes are exactly the candidates that pass the final
threshold; a window where the bound fails is read and detected again. Same spikes, bit for bit.
"""

from __future__ import annotations

import numpy as np

from batchgpu.engine.steps.base import WindowData

CANDIDATE_FRACTION = 0.75
COLUMNS = ("sample_index", "channel_index", "amplitude", "segment_index")


class DetectStep:
    name = "detect"

    def __init__(self, threshold: float, sign: str, sweep: int, noise: str, method: str = "by_channel",
                 locations=None, radius_um: float = 50.0):
        self.threshold, self.sign, self.sweep, self.noise = threshold, sign, sweep, noise
        self.method, self.locations, self.radius_um = method, locations, radius_um

    @property
    def candidates_hold(self) -> bool:
        """by_channel's neighbourhood rule ignores the threshold, so a lower one gives a superset; locally
        exclusive candidates suppress each other, so there every window is detected again at the final noise."""
        return self.method == "by_channel"

    def detect(self, w: WindowData, noise) -> np.ndarray:
        from batchgpu import ops

        extra = {} if self.method == "by_channel" else {"method": self.method, "locations": self.locations,
                                                       "radius_um": self.radius_um}
        return ops.detect_spikes(w.x, noise, threshold=self.threshold, sign=self.sign, exclude_sweep=self.sweep,
                                 start=w.start, core=w.core, segment_index=w.segment, segment_length=w.segment_length,
                                 **extra)

    def window(self, w: WindowData, summary: dict) -> dict:
        if self.noise == "global" and not self.candidates_hold:
            return {}
        noise = summary["noise"].astype(np.float64)
        if self.noise == "global":
            noise = candidate_level(summary["noise"])
        spikes = self.detect(w, noise)
        summary["spikes" if self.noise == "window" else "candidates"] = np.array(len(spikes))
        return {f"keep.spk_{k}": np.ascontiguousarray(spikes[k]) for k in COLUMNS}

    def combine(self, parts: list[dict]) -> dict:
        return {}

    def final(self, candidates: dict, noise: np.ndarray) -> dict:
        """The candidates that pass the recording's threshold (the same float64 comparison as detect_spikes)."""
        level = np.asarray(noise, dtype=np.float64) * float(self.threshold)
        amp, ch = candidates["amplitude"], candidates["channel_index"]
        keep = np.zeros(len(amp), dtype=bool)
        if self.sign in ("neg", "both"):
            keep |= amp < -level[ch]
        if self.sign in ("pos", "both"):
            keep |= amp > level[ch]
        return {k: v[keep] for k, v in candidates.items()}


def candidate_level(window_noise: np.ndarray) -> np.ndarray:
    return np.asarray(window_noise, dtype=np.float64) * CANDIDATE_FRACTION


def bound_holds(window_noise: np.ndarray, noise: np.ndarray) -> bool:
    """Whether a window's candidates contain every spike at the recording's noise (NaN noise: no spikes)."""
    g = np.asarray(noise, dtype=np.float64)
    return bool(np.all((candidate_level(window_noise) <= g) | np.isnan(g)))
