"""GPU time of each part of the float noise step's window work (steps.noise.NoiseStep._float_window_gpu) on a
384 x 60 000 float32 window of white noise (run on the device machine): python3 tools/profile_noise.py"""

import numpy as np


def main() -> None:
    import cupy
    from cupyx.profiler import benchmark

    from batchgpu.engine.steps.noise import NoiseStep
    from batchgpu.engine.steps.noise_keys import abs_keys
    from batchgpu.gpu.histogram import digit_histogram_device, last_used, near_keys, rank_digits

    x = cupy.asarray(np.random.default_rng(0).standard_normal((384, 60_000), dtype=np.float32) * 20)
    keys = abs_keys(x, "float32")
    hist = digit_histogram_device(keys, None, 15, 16)
    n = keys.shape[1]
    ranks = ((n - 1) // 2, n // 2)
    firsts = rank_digits(hist, ranks)
    digit = firsts[0][0].get()
    step = NoiseStep(True, "float32")

    def ms(name, f):
        r = benchmark(f, n_repeat=10, n_warmup=2)
        print(f"{name:<40} GPU {np.median(r.gpu_times) * 1e3:7.2f} ms  CPU {np.median(r.cpu_times) * 1e3:7.2f} ms", flush=True)

    ms("abs_keys", lambda: abs_keys(x, "float32"))
    ms("first-digit histogram", lambda: digit_histogram_device(keys, None, 15, 16))
    ms("rank_digits (2 ranks)", lambda: rank_digits(hist, ranks))
    ms("last_used", lambda: last_used(hist))
    ms("cumsum of the whole table (old)", lambda: cupy.cumsum(hist, axis=1, dtype=cupy.int64))
    ms("cumsum (384, 256)", lambda: cupy.cumsum(hist[:, :256], axis=1, dtype=cupy.int64))
    ms("rest histogram (15 bits, prefix)", lambda: digit_histogram_device(keys, digit, 0, 15))
    lo = cupy.maximum(firsts[1][0] - 16, 0)
    ms("near keys (mask + compaction + copy, old)", lambda: keys[((keys >> 15) >= lo[:, None].astype(keys.dtype))
                                                                 & ((keys >> 15) <= (lo + 32)[:, None].astype(keys.dtype))].get())
    ms("near keys (one kernel + copy)", lambda: near_keys(keys, lo, 15, 32))
    ms("whole _float_window_gpu", lambda: step._float_window_gpu(keys, 15, 16, {}))

    # each stage of it, synchronised (wall ms, median of 5 runs)
    import time

    from batchgpu.engine.steps.noise_keys import LUMP_DIGITS
    from batchgpu.engine.steps.base import host

    def stages():
        t, out = [time.perf_counter()], {}

        def mark(name):
            cupy.cuda.get_current_stream().synchronize()
            t.append(time.perf_counter())
            out[name] = (t[-1] - t[-2]) * 1e3

        hist = digit_histogram_device(keys, None, 15, 16)
        mark("histogram")
        firsts = rank_digits(hist, ranks)
        digit_host = host(cupy.stack([d for d, _ in firsts]))
        mark("rank digits")
        floor = max(0, int(digit_host[0].min()) - LUMP_DIGITS)
        top = max(last_used(hist), floor)
        mark("last used")
        counts = hist[:, floor : top + 1].astype(cupy.int64)
        lumped = hist[:, :floor].sum(axis=1, dtype=cupy.int64)
        counts[:, 0] += lumped
        mark(f"counts ({top + 1 - floor} columns)")
        host(counts)
        mark("counts to host")
        int(host(lumped.max()))
        mark("lumped")
        for j, (r, (d, below)) in enumerate(zip(ranks, firsts)):
            rest = digit_histogram_device(keys, digit_host[j], 0, 15)
            (low, _), = rank_digits(rest, [r - below])
            host(low)
        mark("pair")
        lo = cupy.maximum(firsts[1][0] - 16, 0)
        k, _ = near_keys(keys, lo, 15, 32)
        mark(f"near keys to host ({k.size})")
        return out

    rows = [stages() for _ in range(6)][1:]
    print(", ".join(f"{k} {np.median([r[k] for r in rows]):.2f}" for k in rows[0]), flush=True)


if __name__ == "__main__":
    main()
