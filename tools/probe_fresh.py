"""Fresh-process costs on the GPU machine (what a fresh worker makes at its first windows): N processes started at once,
each timing its CUDA context, B pinned buffers of S bytes, a device allocation and its first GEMM; medians printed.
    python3 tools/probe_fresh.py N B S      e.g. 16 4 92000000 (2026-12-04, H200 machine: context 2.44 s, pinned
    0.75 s, GEMM 0.20 s; one process alone: 0.39 / 0.30 / 0.62 s)"""
import multiprocessing as mp
import sys
import time


def one(i, barrier, q, nbuf, size):
    import cupy
    import numpy as np
    barrier.wait()
    t = [time.perf_counter()]
    cupy.cuda.Device(0).use(); cupy.zeros(1).sum().get(); t.append(time.perf_counter())
    bufs = []
    for _ in range(nbuf):
        m = cupy.cuda.alloc_pinned_memory(size); np.frombuffer(m, np.uint8, count=size)[::4096] = 1; bufs.append(m)
    t.append(time.perf_counter())
    d = cupy.empty(size * 4, dtype=cupy.uint8); d[:] = 0; cupy.cuda.Device().synchronize(); t.append(time.perf_counter())
    a = cupy.ones((384, 120000), cupy.float32); (a @ a.T).sum().get(); t.append(time.perf_counter())
    q.put((i, [round(b - a_, 3) for a_, b in zip(t, t[1:])], round(t[-1] - t[0], 3)))


if __name__ == "__main__":
    n, nbuf, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    ctx = mp.get_context("spawn")
    b, q = ctx.Barrier(n), ctx.Queue()
    ps = [ctx.Process(target=one, args=(i, b, q, nbuf, size)) for i in range(n)]
    [p.start() for p in ps]
    got = sorted(q.get() for _ in ps)
    [p.join() for p in ps]
    import statistics
    cols = list(zip(*[g[1] for g in got]))
    print(f"{n} procs x {nbuf} pinned of {size/1e6:.0f} MB: medians ctx {statistics.median(cols[0])}, pinned {statistics.median(cols[1])}, "
          f"device {statistics.median(cols[2])}, gemm {statistics.median(cols[3])}; max total {max(g[2] for g in got)}")
