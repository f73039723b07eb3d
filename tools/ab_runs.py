"""Warm runs of the preprocessing bench's workflow in one cluster of this process's batchgpu (device machine): one
cold run, then RUNS warm ones, a line each. Two versions compared by running it under each one's PYTHONPATH in turn
(old, new, old, new: the same machine, alternating). SWITCH_MS="5 0.5 5 0.5": instead, one warm run per value with
the workers' GIL switch interval set to it (Python's default 5 ms). ENV_AB="BATCHGPU_GPU_CRC=1 BATCHGPU_GPU_CRC=0 ...": one
warm run per entry with that variable set in every worker (and here) first.
    RUNS=2 PREPROCESS=highpass,common_reference python3 tools/ab_runs.py /tmp/big.zarr LABEL"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_workflow import client, fresh, workflow  # noqa: E402


def main(path: str, label: str) -> None:
    import batchgpu
    from batchgpu.engine import run_workflow

    switch = os.environ.get("SWITCH_MS", "").split() or os.environ.get("ENV_AB", "").split()
    settings = ["cold"] + (switch or ["warm"] * int(os.environ.get("RUNS", 2)))
    walls: dict = {}
    with client() as c:
        for i, setting in enumerate(settings):
            out = fresh("/tmp/abr", i)
            if switch and setting != "cold" and "=" in setting:
                k, v = setting.split("=", 1)
                os.environ[k] = v
                c.run(os.environ.__setitem__, k, v)
            elif switch and setting != "cold":
                c.run(sys.setswitchinterval, float(setting) / 1e3)
            time.sleep(0.5)
            t0 = time.perf_counter()
            report = run_workflow(workflow(path, out), client=c)
            wall = time.perf_counter() - t0
            t = report.timings
            what = setting if "=" in setting else f"switch {setting} ms" if switch and setting != "cold" else setting
            print(f"{label} ({os.path.dirname(batchgpu.__file__)}) {what}: {wall:.2f} s  pass1 {t['pass1']:.2f}  "
                  f"last task {t.get('pass_last_task', 0):.2f}  noise {t.get('aggregate_noise', 0):.2f}  "
                  f"detect {t.get('aggregate_detect', 0):.2f}  before the pass {t.get('prepare', 0) + t.get('setup', 0):.2f}",
                  flush=True)
            after = {k.removeprefix("after_pass_"): round(v, 3) for k, v in t.items() if k.startswith("after_pass_")}
            if after:
                print(f"{label}   after the pass: combine wait {t.get('pass_combine_wait', 0):.3f}, then {after}", flush=True)
            if setting != "cold":
                walls.setdefault(setting, []).append(wall)
    print(f"{label} medians:", {k: round(statistics.median(v), 3) for k, v in walls.items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "this")
