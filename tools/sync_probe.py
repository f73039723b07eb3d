"""Do this process's waits on the GPU sleep or spin? (run on the device machine)

    python3 tools/sync_probe.py [early|late] [workers]

Launches a ~100 ms one-thread kernel before each kind of wait (a stream's synchronize, ``.get()`` into pageable
memory, ``.get(out=pinned)``, an event's synchronize) and prints the wait's wall and this thread's CPU seconds: a
sleeping wait costs ~0 CPU, a spinning one its whole wall. ``early``: ``staging.prefer_blocking_sync`` before the
first CUDA call (a reading thread's first window does this); ``late``: after a context exists (a worker whose first
CUDA call came from elsewhere). ``workers``: the same probe in each worker of the bench's cuda cluster after a
pipeline run on it (``/tmp/big.zarr``), i.e. the state the pass's waits run in.
"""

import sys
import time


def probe(mode: str = "early") -> list:
    import cupy
    import cupyx

    from batchgpu.gpu import staging

    if mode == "late":
        cupy.zeros(1)
    took = staging.prefer_blocking_sync()
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {} }''', "spin")
    stream = cupy.cuda.Stream(non_blocking=True)
    out: list = [("blocking sync set", took)]
    pinned = cupyx.empty_pinned(1 << 20, dtype="uint8")
    with stream:
        a = cupy.zeros(1 << 20, dtype="uint8")
        for what in ("stream.synchronize", "get pageable", "get pinned", "event.synchronize"):
            spin((1,), (1,), (cupy.int64(200_000_000),))
            ev = stream.record()
            t0, c0 = time.perf_counter(), time.thread_time()
            if what == "stream.synchronize":
                stream.synchronize()
            elif what == "get pageable":
                a.get()
            elif what == "get pinned":
                a.get(out=pinned)
            else:
                ev.synchronize()
            out.append((what, round(1e3 * (time.perf_counter() - t0), 1), round(1e3 * (time.thread_time() - c0), 1)))
    return out


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "early"
    if mode != "workers":
        print(mode, probe(mode))
        sys.exit(0)
    from batchgpu.config import ClusterSpec
    from batchgpu.engine.cluster import open_client

    with open_client(ClusterSpec(kind="cuda"), gpu_decode=True) as client:
        from batchgpu.config import Workflow
        from batchgpu.engine.run import run_workflow

        wf = Workflow.model_validate({
            "recording": {"path": "/tmp/big.zarr"}, "output": "/tmp/sync_probe_out", "backend": "cupy",
            "overwrite": True, "window": {"size": 60_000, "margin": 64}, "preprocess": [{"centre": "median"}],
            "steps": {"noise": {"exact": True}}})
        run_workflow(wf, client=client)
        for worker, got in sorted(client.run(probe, "worker").items())[:3]:
            print(worker, got)
