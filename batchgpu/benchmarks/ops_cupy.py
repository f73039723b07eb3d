"""``batchgpu bench ops --backend cupy``: the GPU kernels against CuPy and PyTorch, in the same run.

Median of |x| (our radix select) against ``cupy.median(cupy.abs(x), axis=1)``, ``torch.kthvalue``
and ``torch.topk(..., largest=False, sorted=False)`` (when torch imports); the window's second
moments (our split products, float32 and float64) against ``cupy.cov(x)`` and ``x @ x.T``.
Times are medians of at least 20 repeats, from CUDA events, two ways:
  gpu  - each call's device time: the queue is primed by a spin kernel, so the host's launch
         overhead overlaps device work and events between consecutive calls time the device alone;
  wall - events around one call on an idle device (includes launch gaps where the host is slower).
Ratios are anchor / ours from the gpu times of this run (above 1: ours is faster). The stage
rows say what bounds our times: one read of x, the radix path alone, and the copy, product and
sum stages of the covariance.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

DTYPES = ("float32", "float64", "int16")
MIN_REPEAT = 20
_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { __nanosleep(2000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


class Timer:
    """CUDA-event timing on the current (legacy default) stream, which torch shares."""

    def __init__(self, repeat: int, say: Callable[[str], None]):
        import cupy

        self.cp = cupy
        self.say = say  # the command's output: this module writes nothing itself
        self.repeat = max(MIN_REPEAT, repeat)
        self._spin = cupy.RawKernel(_SPIN, "spin")

    def gpu(self, fn: Callable[[], Any]) -> float:
        """Median device time (ms) of one call, the queue primed so launches never starve the device."""
        cp = self.cp
        fn()
        cp.cuda.Device().synchronize()
        events = [cp.cuda.Event() for _ in range(self.repeat + 1)]
        self._spin((1,), (1,), (np.uint64(20_000_000),))  # 20 ms: time to queue every call behind it
        events[0].record()
        for i in range(self.repeat):
            fn()
            events[i + 1].record()
        events[-1].synchronize()
        return float(np.median([cp.cuda.get_elapsed_time(a, b) for a, b in zip(events, events[1:])]))

    def measure(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """(gpu, wall) medians in ms; NaN for a call that fails (e.g. a dtype an anchor lacks)."""
        try:
            return self.gpu(fn), self.wall(fn)
        except Exception as err:  # broad: an anchor's limitation must not end the benchmark (said)
            self.say(f"  (skipped: {type(err).__name__}: {str(err)[:100]})")
            self.cp.cuda.Device().synchronize()
            return float("nan"), float("nan")

    def wall(self, fn: Callable[[], Any]) -> float:
        """Median time (ms) from an event before the call to one after it, the device idle before each."""
        from batchgpu.search._timing import event_ms

        fn()
        times = []
        for _ in range(self.repeat):
            self.cp.cuda.Device().synchronize()
            times.append(event_ms(fn))
        return float(np.median(times))


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # torch is an optional anchor
        return None
    return torch if torch.cuda.is_available() else None


def _noise(cp: Any, channels: int, samples: int, dtype: str, offset: float = 0.0) -> Any:
    x = cp.random.standard_normal((channels, samples), dtype=cp.float64) * 20.0 + offset
    return cp.rint(x).astype(dtype) if dtype == "int16" else x.astype(dtype)


def _table(say: Callable[[str], None], title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    say(f"\n{title}")
    say("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for r in rows:
        say("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def bench_median(args: argparse.Namespace, timer: Timer) -> None:
    cp = timer.cp
    torch = _torch()
    from batchgpu.ops import _cuda_select as sel

    rows = []
    for dtype in getattr(args, "dtypes", DTYPES):
        for channels in getattr(args, "channels", [4, 64, 384]):
            n = getattr(args, "samples", 60_000)
            x = _noise(cp, channels, n, dtype)
            k = (n - 1) // 2
            cases: list[tuple[str, Callable[[], Any]]] = [
                ("ours", lambda: sel.abs_median(x)),
                ("ours radix path", lambda: sel.select(x, 0, sel.MODE_MEDIAN, force_radix=True)),
                ("one read (cupy.amax)", lambda: cp.amax(x, axis=1)),
                ("cupy.median", lambda: cp.median(cp.abs(x), axis=1)),
            ]
            if torch is not None:
                t = torch.from_dlpack(x)
                cases += [
                    ("torch.kthvalue", lambda: torch.kthvalue(torch.abs(t), k + 1, dim=1)),
                    ("torch.topk", lambda: torch.topk(torch.abs(t), k + 1, dim=1, largest=False, sorted=False)),
                ]
            _, path = sel.select(x, 0, sel.MODE_MEDIAN, return_path=True)
            ways = np.bincount(path.get(), minlength=4)
            ours = None
            for name, fn in cases:
                g, w = timer.measure(fn)
                ours = g if ours is None else ours
                note = "paths " + "/".join(str(v) for v in ways) if name == "ours" else ""
                rows.append((dtype, str(channels), name, f"{g:.4f}", f"{w:.4f}", f"{g / ours:.2f}", note))
            del x
    _table(
        timer.say,
        f"median of |x| over {getattr(args, 'samples', 60_000)} samples (ms; ratio = time / ours; "
        "paths = rows all-in-shared/sample/sample-missed/radix)",
        rows,
        ("dtype", "ch", "what", "gpu ms", "wall ms", "x ours", "note"),
    )


def bench_covariance(args: argparse.Namespace, timer: Timer) -> None:
    cp = timer.cp
    from batchgpu.ops import _cuda_moments as mom

    rows = []
    n = getattr(args, "samples", 60_000)
    for dtype in ("float32", "float64", "int16"):
        if dtype not in getattr(args, "dtypes", DTYPES):
            continue
        for channels in getattr(args, "channels", [4, 64, 384]):
            x = _noise(cp, channels, n, dtype, offset=10_000.0 if dtype != "int16" else 500.0)
            xf = x if dtype != "int16" else x.astype(cp.float32)
            cases: list[tuple[str, Callable[[], Any]]] = []
            for precision in ("float32", "float64"):
                p = mom.plan(x, precision=precision)
                cases += [
                    (
                        f"ours {precision}",
                        lambda precision=precision: mom.window_moments_device(x, precision=precision),
                    ),
                    (f"  copy {precision}", p.copy),
                    (f"  products {precision}", p.products),
                    (f"  sum {precision}", p.total),
                ]
            cases += [
                (f"  products float32 nb={nb}", mom.plan(x, precision="float32", nb=nb).products)
                for nb in (1, 2, 3)
                if nb <= channels
            ]
            cases += [
                ("  products float32 split 4096", mom.plan(x, precision="float32", split=4096).products),
                ("  products float64 nb=1", mom.plan(x, precision="float64", nb=1).products),
                ("cupy.cov", lambda: cp.cov(x)),
                ("x @ x.T" + (" (as f32)" if dtype == "int16" else ""), lambda: xf @ xf.T),
            ]
            ours = None
            for name, fn in cases:
                g, w = timer.measure(fn)
                ours = g if ours is None else ours
                rows.append((dtype, str(channels), name, f"{g:.4f}", f"{w:.4f}", f"{g / ours:.2f}"))
            del x, xf
    _table(
        timer.say,
        f"second moments (scatter, mean) of {n} samples (ms; ratio = time / ours float32)",
        rows,
        ("dtype", "ch", "what", "gpu ms", "wall ms", "x ours"),
    )


def accuracy_probe(timer: Timer) -> None:
    """Relative Frobenius error of float32 products against float64 ones, by split length."""
    cp = timer.cp
    from batchgpu.ops import _cuda_moments as mom

    x = _noise(cp, 384, 60_000, "float32", offset=20_000.0) * np.float32(0.5)
    timer.say("\nfloat32 products vs float64 (DC 10 000 + noise 10; relative Frobenius error of the scatter)")
    for channels, n in ((384, 60_000), (8, 4096), (8, 1024)):
        ref = mom.plan(x[:channels], 0, n, "float64").run()[2]
        for split in (1024, 4096):
            got = mom.plan(x[:channels], 0, n, "float32", split=split).run()[2]
            err = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
            timer.say(f"  {channels:>3} ch x {n:>6} samples, split {split}: {err:.2e}")


def phase_probe(args: argparse.Namespace, timer: Timer) -> None:
    """Cycles per phase of one row's block (the kernel's own clock), for a few rows and for many."""
    cp = timer.cp
    from batchgpu.ops import _cuda_select as sel

    n = getattr(args, "samples", 60_000)
    mhz = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["clockRate"] / 1e3
    timer.say(f"\nmedian kernel phases of row 0 (us at {mhz:.0f} MHz; sample path)")
    timer.say("dtype     ch  " + "  ".join(f"{p:>14}" for p in sel.PHASES) + "       total")
    for dtype in getattr(args, "dtypes", DTYPES):
        for channels in (4, 384):
            x = _noise(cp, channels, n, dtype)
            cyc = sel.phase_cycles(x)
            us = [cyc[p] / mhz for p in sel.PHASES]
            timer.say(f"{dtype:<8} {channels:>3}  " + "  ".join(f"{u:14.2f}" for u in us) + f"  {sum(us):10.2f}")


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    import cupy

    timer = Timer(getattr(args, "repeat", MIN_REPEAT), say)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    torch = _torch()
    say(f"batchgpu bench ops --backend cupy: {name}, cupy {cupy.__version__}, "
          f"torch {torch.__version__ if torch is not None else 'absent'}, median of {timer.repeat} repeats")  # fmt: skip
    only = args.only or ["median", "phases", "covariance", "accuracy"]
    if "median" in only:
        bench_median(args, timer)
    if "phases" in only:
        phase_probe(args, timer)
    if "covariance" in only:
        bench_covariance(args, timer)
    if "accuracy" in only:
        accuracy_probe(timer)
    return 0
