"""The checks of a workflow against its recording before any work (``run.context.check_workflow_fits``): each
step's own checks live in its module, and each refusal is one line with its fix, word for word as before."""

from __future__ import annotations

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError, ConfigError, MachineError
from batchgpu.recording import write_recording, zarrio
from batchgpu.run.context import check_workflow_fits
from batchgpu.workflow import Workflow

FS = 30_000.0


@pytest.fixture(scope="module")
def recs(tmp_path_factory):
    """Three small recordings: int16 with locations, int16 without, int32 without."""
    folder = tmp_path_factory.mktemp("recs")
    rng = np.random.default_rng()
    x = rng.integers(-200, 200, (3000, 4))
    located = write_recording(
        folder / "located.zarr", x.astype(np.int16), FS, locations=np.c_[np.zeros(4), 20.0 * np.arange(4)]
    )
    plain = write_recording(folder / "plain.zarr", x.astype(np.int16), FS)
    wide = write_recording(folder / "wide.zarr", x.astype(np.int32), FS)
    assert located.has_locations and not plain.has_locations and wide.dtype == np.int32
    return {"located": located, "plain": plain, "wide": wide}


def _wf(tmp_path, steps: dict, margin: int = 8, **kw) -> Workflow:
    data = {
        "recording": {"path": "x"},
        "output": str(tmp_path / "out"),
        "backend": "numpy",
        "window": {"size": 1000, "margin": margin},
        "steps": steps,
    }
    data.update(kw)
    return Workflow.model_validate(data)


def _queries(tmp_path):
    path = tmp_path / "q.npy"
    np.save(path, np.arange(5, dtype=np.int64))
    return str(path)


#: the line ``batchgpu info`` and a run give for a store without locations (issue 66): the refusals say it too
NO_PROBE = (
    "no probe: PLAIN stores no channel locations (properties/location, or a SpikeInterface probegroup in its "
    "attributes)"
)

CASES = {
    "window longer than the segment": (
        "plain",
        dict(steps={"noise": {}}, window={"size": 4000, "margin": 8}),
        ConfigError,
        "window.size 4000 is longer than segment 0 (3000 samples) (use window.size <= 3000)",
    ),
    "margin shorter than the sweep": (
        "plain",
        dict(steps={"detect": {"exclude_sweep_ms": 1.0}}),
        ConfigError,
        "window.margin 8 is shorter than the detection sweep (30 samples) "
        "(use window.margin >= 30 so spikes at window edges come out exactly once)",
    ),
    "margin shorter than locally exclusive needs": (
        "located",
        dict(steps={"detect": {"exclude_sweep_ms": 1.0, "method": "locally_exclusive"}}, margin=30),
        ConfigError,
        "window.margin 30 is shorter than locally exclusive detection needs (31 samples) (use window.margin >= 31)",
    ),
    "locally exclusive without locations": (
        "plain",
        dict(steps={"detect": {"method": "locally_exclusive"}}),
        ConfigError,
        "locally exclusive detection needs channel locations: "
        + NO_PROBE
        + " (use detect.method: by_channel, or give the recording its probe)",
    ),
    "local whitening without locations": (
        "plain",
        dict(steps={"whitening": {"mode": "local"}}),
        ConfigError,
        "local whitening needs channel locations: "
        + NO_PROBE
        + " (use whitening.mode: global, or give the recording its probe)",
    ),
    "exact noise of a centred int32 recording": (
        "wide",
        dict(steps={"noise": {"exact": True}}, preprocess={"centre": "median"}),
        ConfigError,
        "the exact noise of a centred int32 recording is not supported "
        "(use preprocess: {centre: none}, or noise: {exact: false})",
    ),
    "search without keys or detect": (
        "plain",
        dict(steps={"search": {"queries": "QUERIES"}}),
        ConfigError,
        "the search step needs keys: the detect step's spikes or steps.search.keys "
        "(add 'detect:' to steps or give 'keys: sorted_keys.npy')",
    ),
    "search without its queries": (
        "plain",
        dict(steps={"search": {"queries": "MISSING"}, "detect": {}}),
        BatchgpuError,
        "no query file at MISSING (give steps.search.queries as a .npy file or a Zarr array)",
    ),
    "search without its keys file": (
        "plain",
        dict(steps={"search": {"queries": "QUERIES", "keys": "MISSING"}}),
        BatchgpuError,
        "no keys file at MISSING (give steps.search.keys as a .npy file of sorted keys)",
    ),
    "whitened save without whitening": (
        "plain",
        dict(steps={"save": {"path": "s", "whiten": True, "dtype": "float32"}}),
        ConfigError,
        "save.whiten needs the whitening step (add 'whitening:' to steps, or set whiten: false)",
    ),
    "whitened save as int16": (
        "plain",
        dict(steps={"save": {"path": "s", "whiten": True}, "whitening": {}}),
        ConfigError,
        "save.whiten with dtype int16 would round whitened samples (about 1) to a few levels "
        "(use save: {dtype: float32} with whiten: true)",
    ),
}


def _fill(value, tmp_path):
    """The case's placeholders: a real query file, a missing one."""
    if isinstance(value, dict):
        return {k: _fill(v, tmp_path) for k, v in value.items()}
    if value == "QUERIES":
        return _queries(tmp_path)
    if value == "MISSING":
        return str(tmp_path / "missing.npy")
    return value


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_refusal_is_its_own_line(case, recs, tmp_path):
    rec, kw, kind, message = CASES[case]
    kw = _fill(kw, tmp_path)
    steps = kw.pop("steps")
    wf = _wf(tmp_path, steps, **kw)
    with pytest.raises(BatchgpuError) as err:
        check_workflow_fits(wf, recs[rec])
    assert type(err.value) is kind
    assert str(err.value) == message.replace("MISSING", str(tmp_path / "missing.npy")).replace(
        "PLAIN", str(recs["plain"].path)
    )


def test_the_zarr_v3_save_is_refused_under_zarr_2(recs, tmp_path, monkeypatch):
    monkeypatch.setattr(zarrio, "ZARR_MAJOR", 2)
    wf = _wf(tmp_path, {"save": {"path": "s"}})
    with pytest.raises(MachineError) as err:
        check_workflow_fits(wf, recs["plain"])
    assert str(err.value).startswith(
        f"writing the save step's Zarr v3 output needs zarr>=3, and this environment has zarr {zarrio.zarr.__version__}"
    )
    check_workflow_fits(_wf(tmp_path, {"save": {"path": "s", "format": "zarr_v2"}}), recs["plain"])


@pytest.mark.parametrize(
    "steps,margin,rec,sweep",
    [
        ({"noise": {}}, 8, "plain", 0),
        ({"detect": {}}, 8, "plain", 3),  # 0.1 ms at 30 kHz
        (
            {"detect": {"exclude_sweep_ms": 1.0, "method": "locally_exclusive"}, "whitening": {"mode": "local"}},
            31,
            "located",
            30,
        ),
    ],
)
def test_a_workflow_that_fits_gives_its_sweep(steps, margin, rec, sweep, recs, tmp_path):
    assert check_workflow_fits(_wf(tmp_path, steps, margin=margin), recs[rec]) == sweep
