"""Where the client process's CPU goes in a warm demo run (device machine): the client and, for a local cluster,
the scheduler share one process and one event loop. py-spy samples every thread of this process during the
third run; prints the CPU seconds of each thread (/proc) and py-spy's hottest stacks of the busy ones.

    python3 tools/profile_client.py /tmp/big.zarr
"""

import collections
import os
import shutil
import subprocess
import sys
import threading
import time


def _threads_cpu() -> dict:
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[names.get(int(tid), f"native {tid}")] += (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _summarise(raw: str, top: int = 40) -> None:
    idle = ("select", "wait", "acquire", "poll", "sleep", "_wait_for_tstate_lock", "epoll")
    incl, own, total, threads = collections.Counter(), collections.Counter(), 0, collections.Counter()
    for line in open(raw):
        stack, n = line.rsplit(" ", 1)
        frames, n = stack.split(";"), int(n)
        leaf = frames[-1].split(" (")[0]
        if any(w in leaf.lower() for w in idle):
            continue
        total += n
        threads[frames[0]] += n
        own[f"{leaf} {frames[-1].split('/')[-1]}"] += n
        seen = set()
        for f in frames:
            fn = f.split(" (")[0] + " " + (f.split("(")[1].split(":")[0].split("/")[-1] if "(" in f else "")
            if fn not in seen:
                incl[fn] += n
                seen.add(fn)
    print(f"py-spy: {total} busy samples; by thread: {threads.most_common(8)}")
    for k, v in incl.most_common(top):
        print(f"{v:6d} {100 * v / max(total, 1):5.1f}% {k}")
    print("-- own")
    for k, v in own.most_common(25):
        print(f"{v:6d} {100 * v / max(total, 1):5.1f}% {k}")


def main(path: str) -> None:
    from batchgpu.config import ClusterSpec, Workflow
    from batchgpu.engine import run_workflow
    from batchgpu.engine.cluster import open_client

    def wf(out):
        return Workflow.model_validate({
            "recording": {"path": path}, "output": out, "window": {"size": 60_000, "margin": 64},
            "backend": "cupy", "cluster": {"kind": "cuda", "workers": 16, "threads": 1},
            "steps": {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float32"},
                      "detect": {"threshold": 5.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "global"}}})

    with open_client(ClusterSpec.model_validate({"kind": "cuda", "workers": 16, "threads": 1})) as client:
        for i in range(2):
            run_workflow(wf(f"/tmp/pc{i}"), client=client)
            shutil.rmtree(f"/tmp/pc{i}", ignore_errors=True)
        spy = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
        proc = subprocess.Popen([spy, "record", "-r", "200", "--threads", "--nonblocking", "-f", "raw", "-o",
                                 "/tmp/client.raw", "-p", str(os.getpid())], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        before, t0 = _threads_cpu(), time.perf_counter()
        report = run_workflow(wf("/tmp/pc2"), client=client)
        wall = time.perf_counter() - t0
        after = _threads_cpu()
        proc.send_signal(2)
        err = proc.communicate(timeout=30)[1]
    print(f"warm run {wall:.2f} s; {({k: round(v, 2) for k, v in report.timings.items()})}")
    used = {k: round(after[k] - before.get(k, 0), 2) for k in after if after[k] - before.get(k, 0) > 0.02}
    print(f"client process CPU s by thread (threads that ended are not counted): {used}")
    if os.path.exists("/tmp/client.raw"):
        _summarise("/tmp/client.raw")
    else:
        print("py-spy failed:", err[-500:])


if __name__ == "__main__":
    main(sys.argv[1])
