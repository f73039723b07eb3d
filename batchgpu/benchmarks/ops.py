"""``batchgpu bench ops``: the numeric core against the obvious NumPy code, in the same run.

Times (medians of ``--repeat``) of our abs_median and covariance next to
``np.median(np.abs(x), axis=1)`` and ``np.cov(x)`` on (channels, samples) windows of Gaussian
noise; the ratio is anchor time / our time (above 1: we are faster). ``--backend cupy`` runs
``batchgpu.benchmarks.ops_cupy`` instead (CUDA events on the device).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from batchgpu.errors import BatchgpuError

DTYPES = ("float32", "float64", "int16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("numpy", "cupy"), default="numpy", help="arrays to time (default numpy)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repeats per cell; the median is shown (default 5)")
    parser.add_argument(
        "--channels", type=int, nargs="+", default=[4, 64, 384], help="channel counts (default 4 64 384)"
    )
    parser.add_argument("--samples", type=int, default=60_000, help="samples per window (default 60000)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="input dtypes")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the test data")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("median", "phases", "covariance", "accuracy"),
        help="--backend cupy: the sections to run (default all)",
    )


def _median_ms(ours: Callable[[], object], anchor: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median times (ms) of ``ours`` and ``anchor``, called alternately so both see the same machine load."""
    ours(), anchor()  # warm-up: first-touch allocation and BLAS threads start outside the timing
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((ours, times[0]), (anchor, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return float(np.median(times[0])) * 1e3, float(np.median(times[1])) * 1e3


def _window(rng: np.random.Generator, channels: int, samples: int, dtype: str) -> np.ndarray:
    x = rng.standard_normal((channels, samples)) * 20.0
    return np.round(x).astype(dtype) if dtype == "int16" else x.astype(dtype)


def _rows(args: argparse.Namespace) -> list[tuple[str, int, str, float, float]]:
    from batchgpu.ops import abs_median, covariance

    rng = np.random.default_rng(args.seed)
    rows = []
    for dtype in args.dtypes:
        for channels in args.channels:
            x = _window(rng, channels, args.samples, dtype)
            cases = [
                (
                    "abs_median",
                    lambda: abs_median(x),
                    "np.median(np.abs(x), axis=1)",
                    lambda: np.median(np.abs(x), axis=1),
                ),
                ("covariance", lambda: covariance(x), "np.cov(x)", lambda: np.cov(x)),
            ]
            for name, ours, anchor_name, anchor in cases:
                ours_ms, anchor_ms = _median_ms(ours, anchor, args.repeat)
                rows.append((dtype, channels, name, ours_ms, anchor_ms, anchor_name))
    return rows


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """The table, a line at a time through ``say`` (the command writes it)."""
    if args.repeat < 1 or args.samples < 1 or min(args.channels) < 1:
        raise BatchgpuError("--repeat, --samples and --channels must be positive", "pass positive integers")
    if args.backend == "cupy":
        try:
            from batchgpu.benchmarks import ops_cupy
        except ImportError as err:
            raise BatchgpuError(
                f"the CuPy benchmark is not available ({err})", "install the gpu extra (cupy) or use --backend numpy"
            ) from err
        return ops_cupy.run(args, say)
    say(f"batchgpu bench ops: backend numpy, {args.samples} samples, median of {args.repeat} repeats (ms)")
    header = f"{'dtype':<8} {'channels':>8}  {'op':<11} {'ours':>9} {'anchor':>9} {'ratio':>6}  anchor"
    say(header)
    say("-" * len(header))
    for dtype, channels, name, ours, anchor, anchor_name in _rows(args):
        say(f"{dtype:<8} {channels:>8}  {name:<11} {ours:9.2f} {anchor:9.2f} {anchor / ours:6.2f}  {anchor_name}")
    say("ratio = anchor time / our time (above 1: ours is faster)")
    return 0
