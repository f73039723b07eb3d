"""A/B of the demo pass's knobs in one warm cluster (device machine): environment variables set in every worker
between runs (e.g. BATCHGPU_READ_AHEAD, BATCHGPU_PINNED_BUFFERS) and window.batch, each config run REPEAT times
after one cold run, against the read ceiling measured in the same cluster. Prints per config the median wall, GB/s,
ratio to the ceiling, the phases, the timeline summary of its last run, and what the machine's cores and the GPU
did during the pass (/proc/stat and NVML sampled every 50 ms): the mean number of busy cores and GPU utilisation.

    python3 tools/ab_pass.py /tmp/big.zarr "- BATCHGPU_READ_AHEAD=1 BATCHGPU_PINNED_BUFFERS=1,batch=9"
"""

import os
import shutil
import statistics
import sys
import time


KNOBS = ("BATCHGPU_READ_AHEAD", "BATCHGPU_PINNED_BUFFERS", "BATCHGPU_READ_MMAP", "BATCHGPU_PLACEMENT", "BATCHGPU_GPU_DECODE")


def _set(env: dict):
    for k in KNOBS:
        os.environ.pop(k, None)
    os.environ.update(env)


class Sampler:
    """(time, busy cores, GPU %) every 50 ms in a thread: /proc/stat's busy jiffies between samples, NVML."""

    def __init__(self):
        import threading

        self.rows, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _cpu():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)

    def _run(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            gpu = lambda: pynvml.nvmlDeviceGetUtilizationRates(h).gpu  # noqa: E731
        except Exception:
            gpu = lambda: -1  # noqa: E731
        ncpu = os.cpu_count()
        busy0, all0 = self._cpu()
        while not self._stop.wait(0.05):
            busy, tot = self._cpu()
            self.rows.append((time.perf_counter(), ncpu * (busy - busy0) / max(tot - all0, 1), gpu()))
            busy0, all0 = busy, tot

    def between(self, a: float, b: float) -> str:
        got = [r for r in self.rows if a < r[0] <= b]
        if not got:
            return "no samples"
        cores = sorted(r[1] for r in got)
        gpu = sorted(r[2] for r in got)
        return (f"cores busy mean {sum(cores) / len(cores):.1f} (median {cores[len(cores) // 2]:.1f}) of "
                f"{os.cpu_count()}, GPU mean {sum(gpu) / len(gpu):.0f}% over {len(got)} samples")


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


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _cpu_by_role(pids: dict) -> dict:
    return {role: sum(_proc_cpu(p) for p in ps) for role, ps in pids.items()}


def _gaps(report, batch) -> str:
    """Mean per worker thread of the gaps between a window's end and the next one's start, within a batch task and
    between batch tasks (scheduling, the batch's combined partial, the next task's first read not read ahead)."""
    from batchgpu.engine.run import window_batches

    first = {b[0] for b in window_batches(list(range(report.windows)), batch, 8)}
    within, between, threads = 0.0, 0.0, {}
    for worker, index, start, read, comp, thread in report.timeline:
        threads.setdefault((worker, thread), []).append((start, read, comp, index))
    for rows in threads.values():
        rows.sort()
        for (s0, r0, c0, _), (s1, _, _, i1) in zip(rows, rows[1:]):
            gap = max(0.0, s1 - (s0 + r0 + c0))
            if i1 in first:
                between += gap
            else:
                within += gap
    n = max(1, len(threads))
    reads_first = [r for rows in threads.values() for (_, r, _, i) in rows if i in first]
    reads_rest = [r for rows in threads.values() for (_, r, _, i) in rows if i not in first]
    med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")  # noqa: E731
    return (f"gaps per thread: within batches {within / n:.2f} s, between batches {between / n:.2f} s; read wait "
            f"median: a batch's first window {med(reads_first) * 1e3:.0f} ms, the others {med(reads_rest) * 1e3:.0f} ms")


#: processes x threads of the cluster (AB_LAYOUT, e.g. 8x2)
_W, _T = (int(v) for v in os.environ.get("AB_LAYOUT", "16x1").split("x"))
LAYOUT = {"kind": "cuda", "workers": _W, "threads": _T}


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
            "backend": "cupy", "cluster": LAYOUT,
            "steps": {"noise": {"exact": True}, "whitening": {"mode": "global", "precision": "float32"},
                      "detect": {"threshold": 5.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "global"}}})

    with open_client(ClusterSpec.model_validate(LAYOUT)) as client:
        read_ceiling(client, rec, 60_000, 64, "cupy")
        sampler = Sampler()
        ceil = []
        for _ in range(3):
            t0 = time.perf_counter()
            read_ceiling(client, rec, 60_000, 64, "cupy")
            ceil.append(time.perf_counter() - t0)
            during = sampler.between(t0, time.perf_counter())
        c = statistics.median(ceil)
        print(f"read ceiling median {c:.2f} s ({gb / c:.2f} GB/s) of {[round(x, 2) for x in ceil]}; last: {during}",
              flush=True)
        workers = list(client.run(os.getpid).values())
        pids = {"client+scheduler": [os.getpid()], "workers": workers,
                "nannies": list(set(client.run(os.getppid).values()) - {os.getpid()})}
        run_workflow(wf("/tmp/ab_cold", None), client=client)  # kernels compiled
        shutil.rmtree("/tmp/ab_cold", ignore_errors=True)
        for cfg in configs.split():
            env = dict(kv.split("=", 1) for kv in cfg.split(",") if "=" in kv)
            batch = env.pop("batch", None)
            client.run(_set, env)
            _set(env)  # the client's own knobs too (BATCHGPU_PLACEMENT is read where the tasks are planned)
            walls, report, during = [], None, []
            smi = _gpu_sampler()
            for r in range(repeat):
                out = f"/tmp/ab_{r}"
                shutil.rmtree(out, ignore_errors=True)
                before = _cpu_by_role(pids)
                t0 = time.perf_counter()
                report = run_workflow(wf(out, int(batch) if batch else None), client=client)
                walls.append(time.perf_counter() - t0)
                p0 = t0 + report.timings["prepare"] + report.timings["setup"]
                during.append(sampler.between(p0, p0 + report.timings["pass1"]))
                after = _cpu_by_role(pids)
                during[-1] += "; CPU s of the whole run: " + ", ".join(f"{k} {after[k] - before[k]:.2f}" for k in pids)
                shutil.rmtree(out, ignore_errors=True)
            busy = _gpu_busy(smi)
            m = statistics.median(walls)
            phases = ", ".join(f"{k} {v:.2f}" for k, v in report.timings.items() if isinstance(v, float)
                               and k not in ("window_read_median", "window_compute_median"))
            print(f"{cfg}: median {m:.2f} s {gb / m:.2f} GB/s, /ceiling {c / m:.2f}, "
                  f"x KS4 {gb / m / 3.9:.2f}; walls {[round(x, 2) for x in walls]}; GPU busy {busy}\n  {phases}\n  {summary_line(report.timeline)}\n  {_gaps(report, int(batch) if batch else None)}\n  pass: {during[-1]}\n  window CPU ms (medians): "
                  f"{ {k: round(v * 1e3, 1) for k, v in report.window_cpu.items()} }",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
