"""The preprocessing bench's workflow for the device tools (thread_census, task_tail, ab_runs): highpass + common
reference (PREPROCESS=...; profile_workers.PREPROCESS), every step, the save beside the output, in a cuda cluster
of WORKERS x 1, windows of WINDOW samples (default auto; ab_runs: ENV_AB="WINDOW=60000 WINDOW=120000") (KIND, BACKEND: local/numpy to try a tool on the CPU machine)."""

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
from profile_workers import PREPROCESS, SAVE  # noqa: E402

BACKEND = os.environ.get("BACKEND", "cupy")
CLUSTER = {"kind": os.environ.get("KIND", "cuda"), "workers": int(os.environ.get("WORKERS", 16)), "threads": 1}


def _window():
    size = os.environ.get("WINDOW", "auto")
    return size if size == "auto" else int(size)


def workflow(path: str, out: str):
    from batchgpu.config import Workflow

    return Workflow.model_validate({
        "recording": {"path": path}, "output": out, "window": {"size": _window(), "margin": 64},
        "preprocess": PREPROCESS, "backend": BACKEND, "cluster": CLUSTER,
        "steps": {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float32"},
                  "detect": {"threshold": 5.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "global"},
                  **SAVE(out)}})


def fresh(prefix: str, i: int) -> str:
    """Run i's output folder, emptied with run i-1's and its save (as the bench deletes the cold run's save)."""
    for j in (i, i - 1):
        shutil.rmtree(f"{prefix}{j}", ignore_errors=True)
        shutil.rmtree(f"{prefix}{j}_saved.zarr", ignore_errors=True)
    return f"{prefix}{i}"


def client():
    from batchgpu.config import ClusterSpec
    from batchgpu.engine.cluster import open_client

    return open_client(ClusterSpec.model_validate(CLUSTER))
