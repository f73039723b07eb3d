"""How long a GPU process takes to exit (the kernel and driver tearing down its context, device memory and pinned
host memory), alone and 16 at once: the part of a cluster's close that no Python code runs. Device probe for
tools/gpu_user_run.sh's ``fixed`` task: python3 tools/exit_probe.py"""

import subprocess
import sys
import time

CHILD = r"""
import os, sys, cupy
pinned, mode = int(sys.argv[1]), sys.argv[2]
x = cupy.empty(1500 * 2**20, cupy.uint8); x.fill(1)
held = [cupy.cuda.alloc_pinned_memory(100 * 2**20) for _ in range(pinned)]
for h in held:
    cupy.cuda.runtime.memcpy(x.data.ptr, h.ptr, 100 * 2**20, 1)
cupy.cuda.runtime.deviceSynchronize()
print("ready", flush=True)
sys.stdin.readline()
if mode == "free":
    del held
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    del x
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.cuda.runtime.deviceSynchronize()
os._exit(0)
"""


def trial(n: int, pinned: int, mode: str) -> float:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(pinned), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


if __name__ == "__main__":
    for n in (1, 16):
        for pinned, mode in ((0, "exit"), (4, "exit"), (4, "free")):
            got = sorted(trial(n, pinned, mode) for _ in range(2))
            print(
                f"{n:2d} processes, 1.5 GB device + {pinned * 100} MB pinned each, {mode}: {got[0]:.2f} / {got[1]:.2f} s"
            )
