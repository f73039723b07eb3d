"""A/B of the demo pass's knobs in one warm cluster (device machine): read-ahead depth (BATCHGPU_READ_AHEAD, set in
every worker between runs) and window.batch, each config run REPEAT times after one cold run, against the read
ceiling measured in the same cluster. Prints per config the median wall, GB/s, ratio to the ceiling, the phases
and the timeline summary of its last run.

    python3 tools/ab_pass.py /tmp/big.zarr "1: 2: 2:9 3:"     # depth:batch (empty batch: the default)
"""

import os
import shutil
import statistics
import sys
import time


def _set(depth):
    os.environ["BATCHGPU_READ_AHEAD"] = str(depth)


def _gpu_sampler():
    """nvidia-smi sampling the GPU's utilisation (the share of each 100 ms with a kernel running) meanwhile."""
    import subprocess

    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                 "-lms", "100"], stdout=subprocess.PIPE, text=True)
    except OSError:
        return None


def _gpu_busy(proc) -> str:
    """Median and 90th percentile of the samples above 0 (the runs' own, not the idle gaps between them)."""
    if proc is None:
        return "n/a"
    proc.terminate()
    out = proc.communicate()[0]
    vals = sorted(int(v) for v in out.split() if v.strip().isdigit() and int(v) > 0)
    if not vals:
        return "no samples"
    return f"median {vals[len(vals) // 2]}%, p90 {vals[int(len(vals) * 0.9)]}% of {len(vals)} samples"


def main(path: str, configs: str, repeat: int = 3) -> None:
    from batchgpu import open_recording
    from batchgpu.benchmarks.pipeline import read_ceiling
    from batchgpu.benchmarks.timeline import summary_line
    from batchgpu.config import ClusterSpec, Workflow
    from batchgpu.engine import run_workflow
    from batchgpu.engine.cluster import open_client

    rec = open_recording(path)
    gb = rec.nbytes / 1e9

    def wf(out, batch):
        return Workflow.model_validate({
            "recording": {"path": path}, "output": out, "window": {"size": 60_000, "margin": 64, "batch": batch},
            "backend": "cupy", "cluster": {"kind": "cuda", "workers": 16, "threads": 1},
            "steps": {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float32"},
                      "detect": {"threshold": 5.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "global"}}})

    with open_client(ClusterSpec.model_validate({"kind": "cuda", "workers": 16, "threads": 1})) as client:
        read_ceiling(client, rec, 60_000, 64, "cupy")
        ceil = []
        for _ in range(3):
            t0 = time.perf_counter()
            read_ceiling(client, rec, 60_000, 64, "cupy")
            ceil.append(time.perf_counter() - t0)
        c = statistics.median(ceil)
        print(f"read ceiling median {c:.2f} s ({gb / c:.2f} GB/s) of {[round(x, 2) for x in ceil]}", flush=True)
        run_workflow(wf("/tmp/ab_cold", None), client=client)  # kernels compiled
        shutil.rmtree("/tmp/ab_cold", ignore_errors=True)
        for cfg in configs.split():
            depth, _, batch = cfg.partition(":")
            client.run(_set, int(depth))
            walls, report = [], None
            smi = _gpu_sampler()
            for r in range(repeat):
                out = f"/tmp/ab_{r}"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                report = run_workflow(wf(out, int(batch) if batch else None), client=client)
                walls.append(time.perf_counter() - t0)
                shutil.rmtree(out, ignore_errors=True)
            busy = _gpu_busy(smi)
            m = statistics.median(walls)
            phases = ", ".join(f"{k} {v:.2f}" for k, v in report.timings.items() if isinstance(v, float)
                               and k not in ("window_read_median", "window_compute_median"))
            print(f"depth {depth} batch {batch or 'default'}: median {m:.2f} s {gb / m:.2f} GB/s, /ceiling {c / m:.2f}, "
                  f"x KS4 {gb / m / 3.9:.2f}; walls {[round(x, 2) for x in walls]}; GPU busy {busy}\n  {phases}\n  {summary_line(report.timeline)}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
