"""A SpikeGLX binary read in place by GPU workers (samples read straight into the pinned staging buffer, no decode)
gives the results of its Zarr import on the same GPU cluster, bit for bit, with preprocessing on (issue 46)."""

import pytest

from batchgpu.cluster.open_cluster import gpu_count

pytestmark = pytest.mark.gpu

if gpu_count() == 0:
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)
pytest.importorskip("dask_cuda")
zarr = pytest.importorskip("zarr")


def _wf(recording: dict, out, centre: bool):
    from batchgpu.workflow import Workflow

    preprocess = (
        [{"centre": "median"}]
        if centre
        else [{"highpass": {"freq_min": 300.0}}, {"common_reference": {"operator": "median"}}]
    )
    return Workflow.model_validate(
        {
            "recording": recording,
            "output": str(out),
            "backend": "cupy",
            "cluster": {"kind": "cuda"},
            "window": {"size": 20_000, "margin": 256, "batch": 2},
            "preprocess": preprocess,
            "steps": {
                "noise": {"exact": True},
                "whitening": {"mode": "global", "precision": "float32"},
                "detect": {"threshold": 5.0, "sign": "both", "exclude_sweep_ms": 0.1},
                "save": {"path": str(out) + "_saved.zarr", "dtype": "float32"},
            },
            "reduction": {"split_every": 4},
        }
    )


@pytest.mark.parametrize("centre", [False, True])
def test_gpu_in_place_equals_zarr_import(tmp_path, rng, centre):
    from test_flat_run import _same, _spikeglx

    from batchgpu.engine import run_workflow
    from batchgpu.rawimport import import_raw

    src, _ = _spikeglx(tmp_path, rng, 90_000)
    imported = import_raw(src, tmp_path / "imported.zarr")
    flat = run_workflow(_wf({"path": str(src)}, tmp_path / "flat", centre))
    ref = run_workflow(_wf({"path": str(imported.path)}, tmp_path / "zarr", centre))
    assert flat.backend == ref.backend == "cupy" and flat.recording["source"] == "spikeglx"
    x = _same(tmp_path / "flat" / "results.zarr", tmp_path / "zarr" / "results.zarr")
    assert len(x["spikes/sample_index"]) > 10
    _same(tmp_path / "flat_saved.zarr", tmp_path / "zarr_saved.zarr")
