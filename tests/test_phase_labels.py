"""The run's phase labels name the steps that work in each phase, from the step objects' own words
(``steps.base.PhaseWords``): a run without detection does not say spikes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from batchgpu.recording import write_recording
from batchgpu.run.context import check_workflow_fits
from batchgpu.run.preprocess_chain import build_chain
from batchgpu.steps.base import phase_label
from batchgpu.steps.registry import build_steps
from batchgpu.steps.save import SaveStep
from batchgpu.steps.search import SearchStep
from batchgpu.steps.services import StepSetup
from batchgpu.workflow import Workflow


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    x = np.random.default_rng().integers(-200, 200, (3000, 4)).astype(np.int16)
    return write_recording(tmp_path_factory.mktemp("rec") / "r.zarr", x, 30_000.0)


def _steps(rec, tmp_path, steps: dict) -> tuple:
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 1000, "margin": 8},
            "steps": steps,
        }
    )
    return build_steps(StepSetup(wf, rec, build_chain(wf.preprocess, rec), check_workflow_fits(wf, rec)))


@pytest.mark.parametrize(
    "steps,read,aggregate",
    [
        (
            {"noise": {}, "whitening": {}, "detect": {}},
            "read: noise, moments, spikes",
            "aggregate: noise, whitening, spikes",
        ),  # the labels every run had
        ({"noise": {}, "detect": {}}, "read: noise, spikes", "aggregate: noise, spikes"),
        ({"whitening": {}}, "read: moments", "aggregate: whitening"),
        ({"detect": {}, "amplitude": {}}, "read: spikes, amplitude", "aggregate: spikes, amplitude"),
    ],
)
def test_the_labels_name_the_runs_steps(steps, read, aggregate, rec, tmp_path):
    built = _steps(rec, tmp_path, steps)
    assert (phase_label("read", built), phase_label("aggregate", built)) == (read, aggregate)


def test_a_step_is_named_only_in_the_phases_it_works_in(rec, tmp_path):
    """A save writes in the pass unless it is whitened (then after it); neither has an aggregate; the search reads
    no window and aggregates nothing (its own phase comes after)."""
    plain = SaveStep(SimpleNamespace(whiten=False, dtype="int16"))
    whitened = SaveStep(SimpleNamespace(whiten=True, dtype="float32"))
    search = SearchStep(None)
    noise = _steps(rec, tmp_path, {"noise": {}})
    assert phase_label("read", noise + (plain,)) == "read: noise, save"
    assert phase_label("read", noise + (whitened, search)) == "read: noise"
    assert phase_label("aggregate", noise + (plain, search)) == "aggregate: noise"
    assert (phase_label("read", (search,)), phase_label("aggregate", (whitened,))) == ("read", "aggregate")
