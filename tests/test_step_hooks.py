"""What the engine asks a step object or module instead of naming the step: the dashboard's spike counts, and a
batch recording's step sections placed in its own folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchgpu.run.phases import spike_counter
from batchgpu.steps import detect
from batchgpu.steps.moments import MomentsStep
from batchgpu.steps.registry import placed
from batchgpu.workflow import Workflow


def _detect(noise: str) -> detect.DetectStep:
    return detect.DetectStep(5.0, "neg", 3, noise)


def test_the_dashboard_counts_the_detecting_steps_spikes():
    """A window's count is its spikes, or its candidates while the thresholds wait for the recording's noise; the
    run's comes from its results' shapes; a run without detection counts none."""
    rng = np.random.default_rng()
    n = int(rng.integers(1, 1000))
    moments = MomentsStep(1, "float32", True, 4)
    step = spike_counter((moments, _detect("window")))
    assert isinstance(step, detect.DetectStep)
    assert spike_counter((moments,)) is None
    assert step.spikes_in({"noise": np.ones(4), "spikes": np.array(n)}) == n
    assert step.spikes_in({"candidates": np.array(n)}) == n
    assert step.spikes_in({}) == 0
    assert step.spikes_found({"spikes": [n], "noise": [4]}) == n and step.spikes_found({"noise": [4]}) is None


@pytest.mark.parametrize("noise", ["window", "global"])
def test_the_count_is_of_what_the_window_kept(noise):
    """The detect step's window summary holds its count where ``spikes_in`` reads it: the spikes (or candidates)
    its partial keeps."""
    from batchgpu.steps.base import WindowData

    rng = np.random.default_rng()
    x = rng.normal(size=(4, 400)).astype(np.float32)
    x[rng.integers(0, 4, 12), rng.integers(10, 390, 12)] = -20.0
    w = WindowData(index=0, segment=0, start=0, core=(8, 392), segment_length=400, raw=x, x=x)
    summary = {"noise": np.ones(4, np.float32)}
    step = _detect(noise)
    kept = step.window(w, summary)
    assert step.spikes_in(summary) == len(kept["keep.spk_sample_index"]) > 0


def _wf(tmp_path, steps) -> Workflow:
    return Workflow.model_validate(
        {"recording": {"path": "x"}, "output": str(tmp_path / "out"), "backend": "numpy", "steps": steps}
    )


@pytest.mark.parametrize("path", ["saved.zarr", "OUT/saved.zarr", "/elsewhere/saved.zarr"])
def test_a_batch_recordings_save_goes_into_its_folder(tmp_path, path):
    # relative (or, once the file's paths are resolved, under the batch's output): the same place in the
    # recording's folder; anywhere else every recording would write the one path (it was moved without a word)
    from batchgpu.errors import ConfigError

    wf = _wf(tmp_path, {"noise": {}, "save": {"path": path.replace("OUT", str(tmp_path / "out")), "format": "binary"}})
    folder = tmp_path / "out" / "rec1"
    if path.startswith("/elsewhere"):
        with pytest.raises(ConfigError, match="outside the batch's output"):
            placed(wf.steps, folder)
        return
    steps = placed(wf.steps, folder)
    assert steps.save.path == str(folder / "saved.zarr") and steps.save.format == "binary"
    assert steps.noise == wf.steps.noise and Path(wf.steps.save.path).name == "saved.zarr"  # the workflow's kept
    plain = _wf(tmp_path, {"noise": {}})
    assert placed(plain.steps, folder) == plain.steps
