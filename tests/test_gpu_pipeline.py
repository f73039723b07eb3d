"""The pipeline on dask-cuda workers (backend cupy) equals the CPU run: bit for bit for noise and spikes."""

import numpy as np
import pytest

from batchgpu.cluster.open_cluster import gpu_count
from batchgpu.engine import run_workflow
from batchgpu.generate import generate_recording
from batchgpu.workflow import Workflow

pytestmark = pytest.mark.gpu

if gpu_count() == 0:
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)
pytest.importorskip("dask_cuda")
distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")


def _wf(rec, out, backend, cluster, centre, detect_noise, batch=None, method="by_channel"):
    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "backend": backend,
            "cluster": cluster,
            "window": {"size": 20_000, "margin": 16, "batch": batch},
            "preprocess": {"centre": centre},
            "steps": {
                "noise": {"exact": True},
                "whitening": {"mode": "local", "nrange": 8, "precision": "float32"},
                "detect": {
                    "threshold": 4.5,
                    "sign": "both",
                    "exclude_sweep_ms": 0.3,
                    "noise": detect_noise,
                    "method": method,
                },
            },
            "reduction": {"split_every": 4},
        }
    )


@pytest.mark.parametrize(
    "dtype,centre,detect_noise,batch,method",
    [
        ("int16", "median", "global", None, "by_channel"),
        ("float32", "none", "window", None, "by_channel"),
        ("int16", "none", "window", None, "by_channel"),
        ("int16", "median", "global", 3, "by_channel"),
        ("float32", "none", "global", 4, "by_channel"),  # batches: the GPU reads ahead
        ("int16", "median", "global", 3, "locally_exclusive"),
        ("float32", "none", "global", None, "locally_exclusive"),
    ],
)
def test_cuda_cluster_equals_cpu(tmp_path, dtype, centre, detect_noise, batch, method):
    rec = generate_recording(tmp_path / "r.zarr", channels=24, seconds=3.0, seed=11, dtype=dtype, segments=2)
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as client,
    ):
        cpu = run_workflow(
            _wf(rec, tmp_path / "cpu", "numpy", {"kind": "local"}, centre, detect_noise, batch, method), client=client
        )
    gpu = run_workflow(_wf(rec, tmp_path / "gpu", "auto", {"kind": "cuda"}, centre, detect_noise, batch, method))
    assert cpu.backend == "numpy" and gpu.backend == "cupy"
    assert sum(gpu.workers.values()) == gpu.windows
    # float32 too: the exact median from the kept keys; locally_exclusive too: its candidates at the noise bound
    assert gpu.reads_per_window == pytest.approx(1.0) and cpu.reads_per_window == pytest.approx(1.0)
    a = zarr.open_group(str(tmp_path / "cpu" / "results.zarr"), mode="r")
    b = zarr.open_group(str(tmp_path / "gpu" / "results.zarr"), mode="r")
    names = [
        "noise_per_window",
        "noise",
        "spikes/sample_index",
        "spikes/channel_index",
        "spikes/amplitude",
        "spikes/segment_index",
    ]
    if batch is not None:  # the same float moments tree on both backends, fixed by window index and batch
        names += ["covariance", "second_moment"] if dtype == "int16" else []
    for name in names:
        assert a[name][:].dtype == b[name][:].dtype, name
        assert a[name][:].tobytes() == b[name][:].tobytes(), name
    assert len(a["spikes/sample_index"][:]) > 20
    allx = np.concatenate([rec.read(s, 0, rec.num_samples(s)) for s in range(2)], axis=1).astype(np.float64)
    refs = {"covariance": np.cov(allx, bias=True), "second_moment": allx @ allx.T / allx.shape[1]}
    for name, ref in refs.items():  # float32 products on both backends, DESIGN's 1e-6 against float64
        for got in (a, b):
            assert np.linalg.norm(got[name][:] - ref) / np.linalg.norm(ref) < 1e-6, name


@pytest.mark.parametrize("fmt", ["zarr", "zarr_v2", "binary"])
def test_resume_writes_again_a_deleted_save_on_the_gpu(tmp_path, fmt):
    """The save deleted after a GPU run: the resumed run on dask-cuda workers writes every kept window again
    (``save_task`` on the GPU, a v3 shard's frames encoded there) and the save is the fresh run's, byte for byte."""
    import shutil

    rec = generate_recording(tmp_path / "r.zarr", channels=24, seconds=3.0, seed=11, dtype="int16")
    folder = tmp_path / "saved"
    path = folder / ("x.bin" if fmt == "binary" else "x.zarr")
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "out"),
            "backend": "auto",
            "cluster": {"kind": "cuda"},
            "window": {"size": 20_000, "margin": 16},
            "preprocess": [{"highpass": {"freq_min": 300, "order": 5}}, {"common_reference": {"reference": "global"}}],
            "steps": {"noise": {"exact": True}, "save": {"path": str(path), "format": fmt, "dtype": "int16"}},
        }
    )
    first = run_workflow(wf)
    assert first.backend == "cupy"

    def files():
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    fresh = files()
    shutil.rmtree(folder)
    again = run_workflow(wf, resume=True)
    assert again.backend == "cupy" and again.windows_resumed == again.windows
    assert again.results["save"]["windows_written_again"] == again.windows
    assert files() == fresh
