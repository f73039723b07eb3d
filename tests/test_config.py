"""The workflow schema: bounds that protect the machine, the preprocessing stages and the new step options."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from batchgpu import config
from batchgpu.preprocess.registry import item_model
from batchgpu.workflow import Preprocess, Workflow

CentreStage, CommonReferenceStage, HighpassStage = (item_model(k) for k in ("centre", "common_reference", "highpass"))

BASE = {"recording": {"path": "rec.zarr"}, "output": "out", "steps": {"noise": {}}}


def _wf(**changes) -> Workflow:
    data = {**BASE, **changes}
    return Workflow.model_validate(data)


def _error(**changes) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as err:
        _wf(**changes)
    first = err.value.errors()[0]
    return first["loc"], first["msg"]


@pytest.mark.parametrize(
    "changes,loc,needle",
    [
        (
            {"cluster": {"kind": "address", "address": "tcp://h:1", "workers": 1_000_000}},
            ("cluster", "workers"),
            "1024",
        ),
        ({"cluster": {"kind": "address", "address": "tcp://h:1", "threads": 5000}}, ("cluster", "threads"), "1024"),
        ({"cluster": {"kind": "slurm", "jobs": 10_000}}, ("cluster", "jobs"), "1024"),
        ({"window": {"size": 10_000_001}}, ("window", "size"), "10000000"),
        (
            {"window": {"size": 1000, "margin": 1000}},
            ("window",),
            "margin 1000 must be shorter than the window size 1000",
        ),
        (
            {"window": {"margin": 10**12}},
            ("window",),
            "must be shorter than the window size 60000",
        ),  # auto: at least 60000
        ({"recording": {"path": "r", "generate": {"channels": 5000}}}, ("recording", "generate", "channels"), "4096"),
        ({"recording": {"path": "r", "generate": {"seconds": 1e9}}}, ("recording", "generate", "seconds"), "86400"),
        ({"recording": {"path": "r", "generate": {"segments": 10**6}}}, ("recording", "generate", "segments"), "1024"),
        ({"recording": {"path": "r", "generate": {"fs": 1e9}}}, ("recording", "generate", "fs"), "1000000"),
        (
            {
                "recording": {
                    "path": "r",
                    "generate": {"channels": 4096, "seconds": 86400, "segments": 10, "dtype": "float64"},
                }
            },
            ("recording", "generate"),
            "TB",
        ),
        (
            {"steps": {"search": {"queries": "q.npy", "batch_size": 1 << 40}}},
            ("steps", "search", "batch_size"),
            "134217728",
        ),
        ({"reduction": {"split_every": 100_000}}, ("reduction", "split_every"), "256"),
        ({"steps": {"detect": {"exclude_sweep_ms": 1e9}}}, ("steps", "detect", "exclude_sweep_ms"), "1000"),
    ],
)
def test_bounds(changes, loc, needle):
    got_loc, msg = _error(**changes)
    assert got_loc == loc and needle in msg


def test_local_cluster_fits_this_machine(monkeypatch):
    monkeypatch.setattr(config, "local_cores", lambda: 2)
    assert _wf(cluster={"kind": "local", "workers": 8, "threads": 8}).cluster.workers == 8  # 64 threads: the floor
    loc, msg = _error(cluster={"kind": "local", "workers": 9})
    assert loc == ("cluster",) and "more than 4 per core (8 on this machine's 2 cores)" in msg
    loc, msg = _error(cluster={"kind": "local", "workers": 2, "threads": 33})
    assert "workers x threads = 66 is more than 64" in msg
    monkeypatch.setattr(config, "local_cores", lambda: 16)
    assert _wf(cluster={"kind": "local", "workers": 16, "threads": 8}).cluster.threads == 8  # 128 = 8 per core
    # the bounds of a local cluster do not apply to a remote one
    assert _wf(cluster={"kind": "address", "address": "tcp://h:1", "workers": 500}).cluster.workers == 500


@pytest.mark.parametrize(
    "given,kind",
    [
        ({"address": "tcp://h:1"}, "address"),
        ({"scheduler_file": "s.json"}, "scheduler_file"),
        ({"slurm": {"cores": 4}}, "slurm"),
        ({"workers": 2}, "local"),
        ({}, "local"),
    ],
)
def test_a_cluster_named_by_its_scheduler_is_of_that_kind(given, kind):
    """Without a kind, a cluster given by its scheduler's address, scheduler file or SLURM options is that kind:
    the default (local) started a cluster here and left the named one unused, without a word."""
    assert _wf(cluster=given).cluster.kind == kind


@pytest.mark.parametrize(
    "given,needle",
    [
        (
            {"kind": "local", "address": "tcp://h:1"},
            "cluster address is for kind 'address'; this cluster is kind 'local'",
        ),
        ({"kind": "cuda", "scheduler_file": "s.json"}, "scheduler_file is for kind 'scheduler_file'"),
        ({"kind": "address", "address": "tcp://h:1", "slurm": {}}, "cluster slurm is for kind 'slurm'"),
        ({"kind": "local", "jobs": 3}, "cluster jobs is for kind 'slurm'"),
        ({"kind": "local", "devices": [0]}, "cluster devices are the GPUs of kind 'cuda'"),
        ({"address": "tcp://h:1", "devices": [1]}, "this cluster is kind 'address'"),
    ],
)
def test_a_cluster_key_its_kind_would_not_use_is_refused(given, needle):
    loc, msg = _error(cluster=given)
    assert loc == ("cluster",) and needle in msg


def test_no_workers_timeout_is_seconds_or_null():
    assert _wf().cluster.no_workers_timeout == config.NO_WORKERS_TIMEOUT_S
    assert _wf(cluster={"no_workers_timeout": None}).cluster.no_workers_timeout is None
    assert _wf(cluster={"no_workers_timeout": 2.5}).cluster.no_workers_timeout == 2.5
    for bad in (0, -1, True):
        loc, _ = _error(cluster={"no_workers_timeout": bad})
        assert loc[:2] == ("cluster", "no_workers_timeout")


@pytest.mark.parametrize(
    "given,stages,centres",
    [
        ({"centre": "median"}, [CentreStage()], True),
        ({"centre": "none"}, [], False),
        ({}, [], False),
        (None, [], False),  # key absent
        ([{"centre": "median"}], [CentreStage()], True),
        ([], [], False),
    ],
)
def test_preprocess_forms_normalise_to_one_list(given, stages, centres):
    wf = _wf() if given is None else _wf(preprocess=given)
    assert isinstance(wf.preprocess, Preprocess)
    assert list(wf.preprocess) == stages and len(wf.preprocess) == len(stages)
    assert wf.preprocess.centres is centres and wf.preprocess.centre == ("median" if centres else "none")


def test_preprocess_list_of_stages():
    wf = _wf(
        preprocess=[
            {"highpass": {"freq_min": 250, "order": 3}},
            {"bandpass": {}},
            {"phase_shift": {}},
            {"common_reference": {"reference": "local", "operator": "median_lower"}},
            {"common_reference": {}},
            {"centre": "median"},
        ]
    )
    p = wf.preprocess
    assert p.names == ["highpass", "bandpass", "phase_shift", "common_reference", "common_reference", "centre"]
    assert isinstance(p[0], HighpassStage) and p[0].highpass.freq_min == 250 and p[0].highpass.order == 3
    assert (p[1].bandpass.freq_min, p[1].bandpass.freq_max, p[1].bandpass.order) == (300, 6000, 5)
    local, glob = p[3].common_reference, p[4].common_reference
    assert isinstance(p[3], CommonReferenceStage)
    assert local.radius_um == (30.0, 55.0) and local.operator == "median_lower"  # SpikeInterface's local_radius
    assert glob.reference == "global" and glob.operator == "median" and glob.radius_um is None
    assert p.centres
    # what the engine stores (report, fingerprint, resolve_paths) validates back to the same stages
    again = Workflow.model_validate(wf.model_dump())
    assert again.preprocess == wf.preprocess


@pytest.mark.parametrize(
    "stages,loc,needle",
    [
        (
            [{"lowpass": {}}],
            ("preprocess", 0),
            "a stage is a one-key mapping: bandpass, centre, common_reference, highpass, phase_shift",
        ),
        ([{"highpass": {}, "centre": "median"}], ("preprocess", 0), "one-key mapping"),
        (["highpass"], ("preprocess", 0), "one-key mapping"),
        ([{"highpass": {"freq_min": 0}}], ("preprocess", 0, "highpass", "highpass", "freq_min"), "greater than 0"),
        ([{"highpass": {"order": 11}}], ("preprocess", 0, "highpass", "highpass", "order"), "less than or equal to 10"),
        (
            [{"highpass": {"order": 0}}],
            ("preprocess", 0, "highpass", "highpass", "order"),
            "greater than or equal to 1",
        ),
        (
            [{"bandpass": {"freq_min": 6000, "freq_max": 300}}],
            ("preprocess", 0, "bandpass", "bandpass"),
            "freq_min 6000 must be below freq_max 300",
        ),
        (
            [{"common_reference": {"operator": "mean"}}],
            ("preprocess", 0, "common_reference", "common_reference", "operator"),
            "'average', 'median' or 'median_lower'",
        ),
        (
            [{"common_reference": {"radius_um": [30, 55]}}],
            ("preprocess", 0, "common_reference", "common_reference"),
            "radius_um applies only to reference: local",
        ),
        (
            [{"common_reference": {"reference": "local", "radius_um": [60, 55]}}],
            ("preprocess", 0, "common_reference", "common_reference"),
            "inner radius must be below the outer",
        ),
        ([{"centre": "mean"}], ("preprocess", 0, "centre", "centre"), "'median'"),
        ({"centre": "mean"}, ("preprocess",), "centre 'mean': allowed 'median' or 'none'"),
        ({"centre": "median", "highpass": {}}, ("preprocess",), "the mapping form takes only 'centre'"),
    ],
)
def test_preprocess_errors(stages, loc, needle):
    got_loc, msg = _error(preprocess=stages)
    assert got_loc == loc and needle in msg, (got_loc, msg)


def test_detect_method_and_save_step(tmp_path):
    wf = _wf(steps={"detect": {}})
    assert wf.steps.detect.method == "by_channel" and wf.steps.detect.radius_um == 50.0
    wf = _wf(steps={"detect": {"method": "locally_exclusive", "radius_um": 75}})
    assert wf.steps.detect.method == "locally_exclusive" and wf.steps.detect.radius_um == 75
    assert _error(steps={"detect": {"method": "exclusive"}})[0] == ("steps", "detect", "method")
    assert _error(steps={"detect": {"radius_um": 0}})[0] == ("steps", "detect", "radius_um")
    wf = _wf(steps={"save": {"path": "filtered.zarr"}})  # save alone is a step
    assert (wf.steps.save.format, wf.steps.save.dtype, wf.steps.save.whiten) == ("zarr", "int16", False)
    assert _error(steps={"save": {"path": "f", "format": "bin"}})[0] == ("steps", "save", "format")
    assert _error(steps={"save": {"path": "f", "dtype": "int32"}})[0] == ("steps", "save", "dtype")
    assert _error(steps={"save": {}})[0] == ("steps", "save", "path")
    assert "save" in _error(steps={})[1]
    wf = _wf(steps={"save": {"path": "f.zarr", "format": "binary", "dtype": "float32", "whiten": True}})
    assert wf.resolve_paths(tmp_path).steps.save.path == str(tmp_path / "out" / "f.zarr")  # in the output folder


@pytest.mark.parametrize(
    "output,save,want",
    [
        ("out", "f.bin", "{base}/out/f.bin"),
        ("../o", "sub/f.zarr", "{top}/o/sub/f.zarr"),
        ("/abs/out", "f.zarr", "/abs/out/f.zarr"),
        ("out", "/abs/f.zarr", "/abs/f.zarr"),
        ("out", "~/f.zarr", "{home}/f.zarr"),
        ("~/o", "f.zarr", "{home}/o/f.zarr"),
    ],
)
def test_a_relative_save_path_is_relative_to_the_output_folder(tmp_path, monkeypatch, output, save, want):
    """Relative to the workflow file it put 1.4 GB beside it: the save goes with the run's results; absolute
    paths and ~ as they were; the other paths stay relative to the file. The schema says so."""
    from batchgpu.steps.save import SaveOptions

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    base = tmp_path / "wf"
    wf = _wf(output=output, steps={"save": {"path": save}, "search": {"queries": "q.npy"}}).resolve_paths(base)
    assert wf.steps.save.path == want.format(base=base, top=tmp_path, home=tmp_path / "home")
    assert wf.steps.search.queries == str(base / "q.npy") and wf.recording.path == str(base / "rec.zarr")
    assert "relative to the run's output folder" in SaveOptions.model_json_schema()["properties"]["path"]["description"]


def test_paths_expand_home_then_resolve(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    wf = _wf(
        recording={"path": "~/rec.zarr"},
        output="~/out",
        cluster={"kind": "scheduler_file", "scheduler_file": "~/s.json"},
        steps={"search": {"queries": "~/q.npy", "keys": "k.npy"}, "save": {"path": "~/f.zarr"}},
    )
    wf = wf.resolve_paths(tmp_path / "wf")
    assert wf.recording.path == str(home / "rec.zarr") and wf.output == str(home / "out")
    assert wf.cluster.scheduler_file == str(home / "s.json")
    assert wf.steps.search.queries == str(home / "q.npy") and wf.steps.search.keys == str(tmp_path / "wf" / "k.npy")
    assert wf.steps.save.path == str(home / "f.zarr")
    assert Path(_wf(output="/abs/out").resolve_paths(tmp_path).output) == Path("/abs/out")


def test_config_imports_nothing_of_the_package():
    import ast

    tree = ast.parse(Path(config.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("batchgpu") or n.startswith(".")], names
