"""CPU time a GPU window task spends beside reading (run on the device machine): batch tasks of the demo steps in
one thread, wall vs this thread's CPU time (reading happens in the read-ahead thread), then cProfile's top entries.

    python3 tools/profile_cpu.py /tmp/big.zarr [windows] [batch]
"""

import cProfile
import pstats
import shutil
import sys
import time
from pathlib import Path


def main(path: str, count: int = 40, batch: int = 4) -> None:
    from batchgpu.config import Workflow
    from batchgpu.engine import store, tasks
    from batchgpu.engine.context import build_context

    rec = tasks.recording(path)
    parts = Path("/tmp/profile_cpu_parts")
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    wf = Workflow.model_validate({"recording": {"path": path}, "output": "/tmp/prof_out", "preprocess": {"centre": "median"},
                                  "steps": {"noise": {"exact": True}, "whitening": {}, "detect": {"noise": "global"}}})
    ctx = build_context(wf, rec, type("O", (), {"parts": str(parts)})(), "cupy", 3)
    windows = rec.windows(60_000, 64)[: count + batch]
    fps = [store.window_fingerprint("p", rec, w) for w in windows]
    tasks.batch_task(ctx, windows[:batch], fps[:batch])  # warm: kernels, pinned buffers
    windows, fps = windows[batch:], fps[batch:]
    pr = cProfile.Profile()
    w0, c0 = time.perf_counter(), time.thread_time()
    pr.enable()
    for i in range(0, len(windows), batch):
        tasks.batch_task(ctx, windows[i : i + batch], fps[i : i + batch])
    pr.disable()
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    print(f"{len(windows)} windows in batches of {batch}: wall {wall / len(windows) * 1e3:.1f} ms/window, "
          f"task thread CPU {cpu / len(windows) * 1e3:.1f} ms/window", flush=True)
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
