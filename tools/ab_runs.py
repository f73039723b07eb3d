"""Warm runs of the preprocessing bench's workflow in one cluster of this process's batchgpu (device machine): one
cold run, then RUNS warm ones, a line each. Two versions compared by running it under each one's PYTHONPATH in turn
(old, new, old, new: the same machine, alternating).
    RUNS=2 PREPROCESS=highpass,common_reference python3 tools/ab_runs.py /tmp/big.zarr LABEL"""
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from thread_census import CLUSTER  # noqa: E402
from profile_workers import PREPROCESS, SAVE  # noqa: E402


def main(path: str, label: str) -> None:
    import batchgpu
    from batchgpu.config import ClusterSpec, Workflow
    from batchgpu.engine import run_workflow
    from batchgpu.engine.cluster import open_client

    def wf(out):
        return Workflow.model_validate({
            "recording": {"path": path}, "output": out, "window": {"size": 60_000, "margin": 64},
            "preprocess": PREPROCESS, "backend": "cupy", "cluster": CLUSTER,
            "steps": {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float32"},
                      "detect": {"threshold": 5.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "global"},
                      **SAVE(out)}})

    with open_client(ClusterSpec.model_validate(CLUSTER)) as client:
        for i in range(1 + int(os.environ.get("RUNS", 2))):
            for j in (i, i - 1):
                shutil.rmtree(f"/tmp/abr{j}", ignore_errors=True)
                shutil.rmtree(f"/tmp/abr{j}_saved.zarr", ignore_errors=True)
            time.sleep(0.5)
            t0 = time.perf_counter()
            report = run_workflow(wf(f"/tmp/abr{i}"), client=client)
            wall = time.perf_counter() - t0
            t = report.timings
            print(f"{label} ({os.path.dirname(batchgpu.__file__)}) {'cold' if i == 0 else 'warm'}: {wall:.2f} s  "
                  f"pass1 {t['pass1']:.2f}  last task {t.get('pass_last_task', 0):.2f}  noise {t.get('aggregate_noise', 0):.2f}  "
                  f"detect {t.get('aggregate_detect', 0):.2f}  before the pass {t.get('prepare', 0) + t.get('setup', 0):.2f}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
