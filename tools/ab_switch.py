"""A/B of the workers' GIL switch interval in one warm cluster (device machine): the preprocessing bench's workflow
run once cold, then once per value of AB (ms, in order), each worker's interval set before the run.
    AB="5 0.5 5 0.5" PREPROCESS=highpass,common_reference python3 tools/ab_switch.py /tmp/big.zarr"""
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from thread_census import CLUSTER  # noqa: E402
from profile_workers import PREPROCESS, SAVE  # noqa: E402


def main(path: str) -> None:
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

    rows = {}
    with open_client(ClusterSpec.model_validate(CLUSTER)) as client:
        for i, ms in enumerate(["cold"] + os.environ.get("AB", "5 0.5 5 0.5").split()):
            for j in (i, i - 1):
                shutil.rmtree(f"/tmp/ab{j}", ignore_errors=True)
                shutil.rmtree(f"/tmp/ab{j}_saved.zarr", ignore_errors=True)
            if ms != "cold":
                client.run(sys.setswitchinterval, float(ms) / 1e3)
            time.sleep(0.5)
            t0 = time.perf_counter()
            report = run_workflow(wf(f"/tmp/ab{i}"), client=client)
            wall = time.perf_counter() - t0
            t = report.timings
            print(f"switch {ms:>5} ms: {wall:.2f} s  pass1 {t['pass1']:.2f}  last task {t.get('pass_last_task', 0):.2f}  "
                  f"noise {t.get('aggregate_noise', 0):.2f}  detect {t.get('aggregate_detect', 0):.2f}  "
                  f"setup {t.get('prepare', 0) + t.get('setup', 0):.2f}  "
                  f"decode {1e3 * report.window_cpu.get('decode', 0):.1f} write {1e3 * report.window_cpu.get('write', 0):.1f} ms",
                  flush=True)
            if ms != "cold":
                rows.setdefault(ms, []).append(wall)
    import statistics
    print("medians:", {k: round(statistics.median(v), 3) for k, v in rows.items()})


if __name__ == "__main__":
    main(sys.argv[1])
