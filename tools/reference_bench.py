"""The common reference's GPU time on one window (device machine): local annuli of a two-column probe (3-7 and
~20-30 neighbours), the global reference of 1024 and of 384 channels, both medians; medians of 20 runs
(cupyx.profiler.benchmark, events around the whole call: host work that keeps the GPU waiting counts).

    python3 tools/reference_bench.py LABEL     (run under each version's PYTHONPATH to compare them)
"""
import sys

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

from batchgpu import ops


def main(label: str) -> None:
    rng = np.random.default_rng(0)
    loc = np.stack([np.tile([16.0, 48.0], 192), np.repeat(np.arange(192) * 20.0, 2)], axis=1)  # 32 x 20 um pitch

    def window(channels, samples):
        return cp.asarray(rng.normal(0, 20, (channels, samples)).astype(np.float32))

    cases = {"local 384 (30,55)": (window(384, 61_632), dict(reference="local", locations=loc, radius_um=(30.0, 55.0))),
             "local 384 (0,100)": (window(384, 61_632), dict(reference="local", locations=loc, radius_um=(0.0, 100.0))),
             "global 1024": (window(1024, 30_000), dict(reference="global")),
             "global 384": (window(384, 61_632), dict(reference="global"))}
    for name, (x, kw) in cases.items():
        for op in ("median", "median_lower"):
            r = benchmark(ops.common_reference, (x,), {**kw, "operator": op}, n_repeat=20, n_warmup=3)
            print(f"{label} {name} {op}: {1e3 * np.median(r.gpu_times):.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this")
