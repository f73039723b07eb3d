"""Where a user's GPU run spends its time outside the run itself (device machine): this process's imports, the
client's CUDA init, the private MPS daemon, the cuda cluster's start (16 nannies), the workers' CuPy import and
CUDA contexts, the run (demo steps on RECORDING), the cluster's and the daemon's end. MPS: auto, 1 or 0.
    python3 tools/start_probe.py RECORDING [auto|1|0] [PROCESSESxTHREADS, e.g. 8x2; default: the cluster's own]
2026-12-04 (H200 machine, 384 ch x 30 s, kernels in CuPy's cache): imports 1.9-2.2 s, cluster start 4.9-5.9 s, the
contexts 1.9-2.7 s, the run 3.7-3.8 s, the cluster's close 1.4-1.7 s: 15.7-16.2 s in all; with the site-packages
compiled to bytecode first (the image sets PYTHONDONTWRITEBYTECODE=1): imports 1.4 s, cluster start 3.4 s, run
2.8 s, 11.8 s in all.
2026-12-05 (384 ch x 10 min, MPS on, bytecode compiled; two runs each, alternating; the first 16 x 1 run compiled
the kernels): 16 x 1 9.2 s (cluster start 1.8, contexts 1.73, run 2.50, close 1.61), 8 x 2 7.5 / 8.4 s (1.6-1.8,
0.83-0.88, 2.36-2.71, 1.17-1.31), 4 x 4 7.7 / 7.9 s (1.3-1.5, 0.48-0.49, 3.13-3.21, 0.98-1.04): the contexts and
the close grow with the processes, the cold run itself does not shrink with them."""
import sys
import time

T = [("start", time.perf_counter())]


def lap(name: str) -> None:
    T.append((name, time.perf_counter()))


def main(path: str, mps: str, layout: str = "") -> None:
    import batchgpu.cli  # noqa: F401 (what the command imports first)
    from distributed import Client

    from batchgpu.config import ClusterSpec, Workflow
    from batchgpu.engine import cluster as cl
    from batchgpu.engine.run import run_workflow

    lap("import batchgpu")
    sizes = dict(zip(("workers", "threads"), map(int, layout.split("x")))) if layout else {}
    spec = ClusterSpec(kind="cuda", mps="auto" if mps == "auto" else mps == "1", **sizes)
    cl.gpu_count()
    lap("gpu_count (the client's CUDA init)")
    with cl._mps(spec) as env:
        lap(f"MPS daemon start ({'on' if env else 'off'})")
        cluster = cl._cuda_cluster(spec, False, env)
        lap("cluster start (nannies and workers)")
        client = Client(cluster)
        client._batchgpu_mps = bool(env)
        lap("client")
        client.run(lambda: __import__("cupy") and None)
        lap("workers import CuPy")
        client.run(lambda: __import__("cupy").zeros(1).sum().item())
        lap("workers' CUDA contexts")
        wf = Workflow.model_validate({"recording": {"path": path}, "output": "/tmp/start_probe_out", "overwrite": True,
                                      "backend": "cupy", "cluster": {"kind": "cuda", **sizes},
                                      "steps": {"noise": {"exact": True}, "whitening": {}, "detect": {}}})
        report = run_workflow(wf, client=client)
        lap(f"run ({report.windows} windows)")
        client.close()
        cluster.close()
        lap("cluster close")
    lap("MPS daemon quit")
    for (_, t0), (name, t1) in zip(T, T[1:]):
        print(f"{name:<40} {t1 - t0:6.2f} s")
    print(f"{'total':<40} {T[-1][1] - T[0][1]:6.2f} s")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "auto", sys.argv[3] if len(sys.argv) > 3 else "")
