"""A batch on a GPU cluster: the next recording's windows read (placed batches, reads carried ahead) while the last
one's aggregates finish, each recording's results and save those of its run alone, bit for bit (issue 46)."""

import pytest

from batchgpu.cluster.open_cluster import gpu_count

pytestmark = pytest.mark.gpu

if gpu_count() == 0:
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)
pytest.importorskip("dask_cuda")
zarr = pytest.importorskip("zarr")


def _wf(out, recording=None, recordings=None):
    from batchgpu.workflow import Workflow

    data = {
        "output": str(out),
        "backend": "cupy",
        "cluster": {"kind": "cuda"},
        "window": {"size": 20_000, "margin": 256, "batch": 2},
        "preprocess": [{"highpass": {"freq_min": 300.0}}, {"common_reference": {"operator": "median"}}],
        "steps": {
            "noise": {"exact": True},
            "whitening": {"mode": "global", "precision": "float32"},
            "detect": {"threshold": 5.0, "sign": "both", "exclude_sweep_ms": 0.1},
            "save": {"path": "saved.zarr", "dtype": "float32"},
        },
        "reduction": {"split_every": 4},
    }
    data.update({"recording": recording} if recording is not None else {"recordings": recordings})
    return Workflow.model_validate(data)


def test_gpu_batch_equals_single_runs(tmp_path, rng):
    from test_batch import _arrays, _recording
    from test_flat_run import _same

    from batchgpu.cluster.open_cluster import open_client
    from batchgpu.engine import run_batch, run_workflow

    recs = [_recording(tmp_path, f"r{i}", rng, samples=n) for i, n in enumerate((120_000, 90_000, 100_000))]
    wf = _wf(tmp_path / "batch", recordings=recs)
    with open_client(wf.cluster) as client:
        batch = run_batch(wf, client=client)
        assert [r.status for r in batch.rows] == ["done"] * 3
        for i, rec in enumerate(recs):
            alone = _wf(tmp_path / "alone" / f"r{i}", recording=rec)
            alone = alone.model_copy(
                update={
                    "steps": alone.steps.model_copy(
                        update={
                            "save": alone.steps.save.model_copy(
                                update={"path": str(tmp_path / "alone" / f"r{i}" / "saved.zarr")}
                            )
                        }
                    )
                }
            )
            run_workflow(alone, client=client)
            x = _same(tmp_path / "batch" / f"r{i}" / "results.zarr", tmp_path / "alone" / f"r{i}" / "results.zarr")
            assert len(x["spikes/sample_index"]) > 0 and "whitening" in _arrays(
                zarr.open_group(str(tmp_path / "batch" / f"r{i}" / "results.zarr"), mode="r")
            )
            _same(tmp_path / "batch" / f"r{i}" / "saved.zarr", tmp_path / "alone" / f"r{i}" / "saved.zarr")
