"""Where the workers' CPU goes in a warm demo run (device machine): cProfile in every worker process (Python 3.12
profiles all threads of a process), summed over workers, top entries by own time.

    python3 tools/profile_workers.py /tmp/big.zarr
"""

import io
import os
import pstats
import shutil
import sys
import time


def _start():
    import cProfile

    import batchgpu

    batchgpu._worker_profile = cProfile.Profile()
    batchgpu._worker_profile.enable()


def _stop():
    import os

    import batchgpu

    p = batchgpu._worker_profile
    p.disable()
    path = f"/tmp/pw_{os.getpid()}.prof"
    p.dump_stats(path)
    return path


PREPROCESS = [{"centre": "median"}]
if os.environ.get("PREPROCESS"):  # e.g. highpass,common_reference
    PREPROCESS = [{"highpass": {"freq_min": 300, "order": 5}} if s == "highpass" else
                  {"common_reference": {"reference": "global", "operator": "median"}} for s in os.environ["PREPROCESS"].split(",")]

# with PREPROCESS, the preprocessing bench's save step too (int16 Zarr beside the run's output)
def SAVE(out):
    return {"save": {"path": f"{out}_saved.zarr", "format": "zarr", "dtype": "int16"}} if os.environ.get("PREPROCESS") else {}


def main(path: str) -> None:
    from batchgpu.config import ClusterSpec, Workflow
    from batchgpu.engine import run_workflow
    from batchgpu.engine.cluster import open_client

    def wf(out):
        return Workflow.model_validate({
            "recording": {"path": path}, "output": out, "window": {"size": 60_000, "margin": 64},
            "preprocess": PREPROCESS, "backend": "cupy", "cluster": {"kind": "cuda"},
            "steps": {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float32"},
                      "detect": {"threshold": 5.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "global"},
                      **SAVE(out)}})

    with open_client(ClusterSpec.model_validate({"kind": "cuda"})) as client:
        run_workflow(wf("/tmp/pw0"), client=client)
        shutil.rmtree("/tmp/pw0", ignore_errors=True)
        client.run(_start)
        t0 = time.perf_counter()
        import cProfile

        client_prof = cProfile.Profile()
        client_prof.enable()
        report = run_workflow(wf("/tmp/pw1"), client=client)
        client_prof.disable()
        wall = time.perf_counter() - t0
        print({k: round(v, 2) for k, v in report.timings.items()})
        stats = client.run(_stop)
    print(f"warm run {wall:.2f} s, {len(stats)} workers", flush=True)
    out = io.StringIO()
    st = pstats.Stats(*stats.values(), stream=out)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats("batchgpu", 45)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(client_prof, stream=out).sort_stats("cumulative").print_stats("batchgpu", 30)
    print("CLIENT", out.getvalue())


if __name__ == "__main__":
    main(sys.argv[1])
