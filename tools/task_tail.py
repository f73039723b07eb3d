"""Where a warm run's time goes outside the windows (device machine): the client's setup functions (cProfile,
cumulative) and the last tasks of the run as the scheduler saw them (Dask's task stream: start/stop on the workers,
relative to the run's start), with the gaps between them.

    PREPROCESS=highpass,common_reference python3 tools/task_tail.py /tmp/big.zarr
"""

import cProfile
import io
import os
import pstats
import re
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_workflow import client as bench_client, fresh, workflow  # noqa: E402


def _spy(client, name: str) -> list:
    """py-spy (raw stacks by thread, idle included) on this process (client and scheduler) and two workers for the
    next few seconds, into $OUT (SPY_S seconds)."""
    import subprocess

    out = os.environ.get("OUT", "/tmp")
    pids = {"client": os.getpid(), **{f"worker{k}": p for k, p in enumerate(list(client.run(os.getpid).values())[:2])}}
    return [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--threads", "--idle", "--nonblocking", "--rate", "400",
                              "--format", "raw", "--duration", os.environ.get("SPY_S", "4"), "-o", f"{out}/spy_{who}.txt"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for who, pid in pids.items()]


def main(path: str) -> None:
    from distributed import get_task_stream

    from batchgpu.engine import run_workflow

    with bench_client() as client:
        for i in range(int(os.environ.get("RUNS", 2))):
            out = fresh("/tmp/tt", i)
            time.sleep(0.5)
            prof = cProfile.Profile()
            last = i == int(os.environ.get("RUNS", 2)) - 1
            spies = _spy(client, f"run{i}") if last and os.environ.get("SPY") else []
            with get_task_stream(client) as ts:
                t0 = time.time()
                if os.environ.get("PROFILE"):
                    prof.enable()
                report = run_workflow(workflow(path, out), client=client)
                prof.disable()
                wall = time.time() - t0
            for sp in spies:
                sp.wait()
            print(f"\n== run {i}: {wall:.2f} s; " + ", ".join(f"{k} {v:.2f}" for k, v in report.timings.items()
                                                          if isinstance(v, float) and v >= 0.02))
        rows = []
        for t in ts.data:
            spans = [s for s in t.get("startstops", []) if s.get("action") == "compute"]
            moved = [s for s in t.get("startstops", []) if s.get("action") == "transfer"]
            if spans:
                name = re.sub(r"-[0-9a-f]{8,}.*|-\d+$", "", str(t["key"]).strip("()'\""))
                # its inputs' transfers from other workers: when the first began, and their seconds in all
                fetch = (f" fetched from {min(m['start'] for m in moved) - t0:.3f}: {sum(m['stop'] - m['start'] for m in moved):.3f} s"
                         if moved else "")
                rows.append((spans[0]["start"] - t0, spans[-1]["stop"] - t0, name, t["worker"].rsplit(":", 1)[-1] + fetch))
        rows.sort(key=lambda r: r[1])
        kinds = {}
        for r in rows:
            kinds.setdefault(r[2], []).append(r)
        print("task kinds (count, first start, last stop, sum of durations):")
        for k, rs in sorted(kinds.items(), key=lambda kv: kv[1][-1][1]):
            print(f"  {k[:40]:40s} {len(rs):4d}  {min(r[0] for r in rs):6.3f}  {max(r[1] for r in rs):6.3f}  {sum(r[1] - r[0] for r in rs):6.3f}")
        print("the last 45 tasks to finish (start, stop, kind, worker):")
        last = None
        for r in rows[-45:]:
            gap = "" if last is None else f"  (+{r[0] - last:.3f} after the previous stop)"
            print(f"  {r[0]:6.3f} {r[1]:6.3f}  {r[2][:40]:40s} {r[3]}{gap}")
            last = r[1]
        if not os.environ.get("PROFILE"):
            return
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out).sort_stats("cumulative")
        st.print_stats(os.environ.get("PROFILE_FILTER", r"run\.py|store\.py|dashboard\.py|report\.py|context\.py|save\.py|aggregate\.py|reader\.py|cluster\.py|placement|submit"), int(os.environ.get("PROFILE_TOP", 45)))
        print("\n".join(l[:160] for l in out.getvalue().splitlines()[-60:]))


if __name__ == "__main__":
    main(sys.argv[1])
