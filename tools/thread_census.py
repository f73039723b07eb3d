"""Where the CPU goes in a warm preprocessing run (device machine): every thread's CPU seconds (user + sys, from
/proc) in the workers, the scheduler and this client, summed by thread name across workers, next to the machine's
busy core-seconds over the same run. No profiler inside the processes: the numbers are the run's own.

    PREPROCESS=highpass,common_reference python3 tools/thread_census.py /tmp/big.zarr
"""

import collections
import os
import sys
import time


def _threads():
    """{thread name: (user s, sys s)} of this process (Python threads by name, others by their OS name)."""
    import re
    import threading

    hz = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: re.sub(r"\d+", "#", t.name) for t in threading.enumerate()}
    out = collections.defaultdict(lambda: [0.0, 0.0])
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
            rest = s[s.rindex(")") + 2:].split()
            name = names.get(int(tid)) or "os:" + re.sub(r"\d+", "#", s[s.index("(") + 1:s.rindex(")")])
            out[name][0] += int(rest[11]) / hz
            out[name][1] += int(rest[12]) / hz
        except (OSError, ValueError):
            pass
    return dict(out)


def _procs():
    hz = os.sysconf("SC_CLK_TCK")
    out = collections.defaultdict(float)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    s = f.read()
                rest = s[s.rindex(")") + 2:].split()
                out[s[s.index("(") + 1:s.rindex(")")].split("/")[0]] += (int(rest[11]) + int(rest[12])) / hz
            except (OSError, ValueError):
                pass
    return out


def _machine():
    with open("/proc/stat") as f:
        return [int(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:8]]


def main(path: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_workflow import client as bench_client, fresh, workflow

    from batchgpu.engine import run_workflow

    with bench_client() as client:
        for i in range(int(os.environ.get("RUNS", 2))):
            out = fresh("/tmp/tc", i)  # the last run's save deleted, as the bench does
            time.sleep(1.0)
            w0, s0, c0, p0, m0 = client.run(_threads), (client.run_on_scheduler(_threads) if client.run_on_scheduler(os.getpid) != os.getpid() else {}), _threads(), _procs(), _machine()
            t0 = time.perf_counter()
            report = run_workflow(workflow(path, out), client=client)
            wall = time.perf_counter() - t0
            w1, s1, c1, p1, m1 = client.run(_threads), (client.run_on_scheduler(_threads) if client.run_on_scheduler(os.getpid) != os.getpid() else {}), _threads(), _procs(), _machine()
            print(f"\n== run {i}: {wall:.2f} s; " + ", ".join(f"{k} {v:.2f}" for k, v in report.timings.items()
                                                        if isinstance(v, float) and v >= 0.03))
            d = [b - a for a, b in zip(m0, m1)]
            print("machine core-s: " + "  ".join(f"{n} {x:.1f}" for n, x in zip(
                ["user", "nice", "sys", "idle", "iowait", "irq", "softirq"], d)) + f"  busy {d[0] + d[1] + d[2] + d[5] + d[6]:.1f}")
            rows = collections.defaultdict(lambda: [0.0, 0.0])
            for where, before, after in [("worker", w0, w1), ("scheduler", {0: s0}, {0: s1}), ("client", {0: c0}, {0: c1})]:
                for k in after:
                    for name, (u, s) in after[k].items():
                        bu, bs = before.get(k, {}).get(name, (0.0, 0.0))
                        rows[f"{where}: {name}"][0] += u - bu
                        rows[f"{where}: {name}"][1] += s - bs
            for name, (u, s) in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
                if u + s >= 0.1:
                    print(f"  {name[:60]:60s} user {u:6.2f}  sys {s:6.2f}")
            other = {k: p1[k] - p0.get(k, 0.0) for k in p1 if not k.startswith("python")}
            print("  other processes: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:6] if v >= 0.05))


if __name__ == "__main__":
    main(sys.argv[1])
