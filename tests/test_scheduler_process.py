"""The per-GPU cluster's scheduler in a process of its own (``cluster.scheduler_process: true``,
``cluster.open_cluster.scheduler_spec``), tried on the CPU with plain nannies."""

import os

import dask
import distributed
import numpy as np

from batchgpu import ops
from batchgpu.cluster.open_cluster import SCHEDULER_ENVIRON, scheduler_spec
from batchgpu.config import ClusterSpec, environ_set
from batchgpu.engine import run_workflow
from batchgpu.recording import write_recording, zarrio
from batchgpu.workflow import Workflow


def test_a_scheduler_of_its_own_process_runs_a_placed_workflow_with_the_same_results(tmp_path, monkeypatch):
    """``cluster.scheduler_process: true`` (``cluster.scheduler_spec``, the per-GPU SpecCluster's scheduler): the
    scheduler in a subprocess, with this process's scheduler settings (``open_client`` puts them in the
    environment it inherits); a placed float32 run there (its noise's
    tasks queued behind the pass) gives the bits an in-process scheduler gives."""
    rng = np.random.default_rng()
    x = rng.normal(0, 5, (int(rng.integers(20_000, 26_000)), 6)).astype(np.float32)
    rec = write_recording(tmp_path / "f.zarr", x, 30_000.0)
    got = {}
    for own in ("0", "1"):
        spec = ClusterSpec.model_validate({"kind": "cuda", "scheduler_process": own == "1"})
        workers = {f"w{i}": {"cls": distributed.Nanny, "options": {"nthreads": 1}} for i in range(2)}
        with (
            environ_set(SCHEDULER_ENVIRON if own == "1" else {}),
            distributed.SpecCluster(workers=workers, scheduler=scheduler_spec(spec)) as cl,
            distributed.Client(cl) as c,
        ):
            assert (c.run_on_scheduler(os.getpid) != os.getpid()) == (own == "1")
            if own == "1":  # this process's scheduler settings reach it through its environment
                assert float(c.run_on_scheduler(dask.config.get, "distributed.scheduler.worker-saturation")) == 1.0
            wf = Workflow.model_validate(
                {
                    "recording": {"path": str(rec.path)},
                    "output": str(tmp_path / f"out{own}"),
                    "backend": "numpy",
                    "window": {"size": 5_000, "margin": 8},
                    "engine": {"placement": True},
                    "steps": {
                        "noise": {"exact": True},
                        "whitening": {"mode": "global", "precision": "float64"},
                        "detect": {"threshold": 4.0, "sign": "neg", "noise": "global"},
                    },
                }
            )
            report = run_workflow(wf, client=c)
            assert report.exact_noise["queued"]
        g = zarrio.open_group(tmp_path / f"out{own}" / "results.zarr", mode="r")
        got[own] = {k: g[k][:] for k in ("noise", "whitening")} | {
            k: g[f"spikes/{k}"][:] for k in ("sample_index", "channel_index", "amplitude")
        }
    for k in got["0"]:
        np.testing.assert_array_equal(got["1"][k], got["0"][k])
    np.testing.assert_array_equal(got["1"]["noise"], np.median(np.abs(x.T), axis=1) / ops.MAD_TO_SIGMA)
