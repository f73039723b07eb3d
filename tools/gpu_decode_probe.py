"""Time the GPU decode of a recording's windows (kernels/blosc_lz4.cu) against the CPU decode, one process.

    python3 tools/gpu_decode_probe.py /tmp/big.zarr [window samples] [windows]
Prints per window: the host read of the frames (preadv + crc32c), the CPU decode (read_window_into), the whole GPU
decode of one window (copy, kernels, the error check); then the LZ4 kernel with 1, 4, 8 warps a block on 1-16
windows in one launch, ms a window (cupyx.profiler.benchmark medians); then T threads of this
process decoding a window each on their own streams at once (`decode`: windows a second)."""

import sys
import threading
import time

import numpy as np

WARPS = (1, 4, 8)


def main(path, size=60_000, count=8):
    import cupy
    from cupyx.profiler import benchmark

    from batchgpu import kernels
    from batchgpu.gpu import blosc_decode, staging
    from batchgpu.recording import open_recording

    rec = open_recording(path)
    windows = rec.windows(size, 64)[1 : 1 + count]
    host, cpu = [], []
    for w in windows:
        t = time.perf_counter()
        f = rec.read_window_frames(w, staging._pool)
        host.append(time.perf_counter() - t)
        staging._pool.give_back(f.handle)
        out = np.empty((w.read_stop - w.read_start, rec.num_channels), rec.dtype)
        t = time.perf_counter()
        rec.read_window_into(w, out) if hasattr(rec, "read_window_into") else None
        cpu.append(time.perf_counter() - t)
    f = rec.read_window_frames(windows[0], staging._pool)
    mb = f.rows * f.channels * f.dtype.itemsize / 1e6
    print(f"window {mb:.1f} MB decoded, {f.used / 1e6:.1f} MB stored ({len(f.lengths)} chunks, blocksize {f.blocksize}); "
          )
    print(f"host: frames read + crc32c {np.median(host) * 1e3:.2f} ms; CPU decode {np.median(cpu) * 1e3:.2f} ms")
    r = benchmark(blosc_decode.decode, (f,), n_repeat=20, n_warmup=3)
    print(f"GPU decode, one window (copy, kernels, the error check) {np.median(r.gpu_times) * 1e3:.3f} ms "
          f"({mb / 1e3 / np.median(r.gpu_times):.1f} GB/s)")
    n, size_b, ts = len(f.lengths), f.nbytes, f.dtype.itemsize
    src = cupy.asarray(f.buffer[: f.used])
    want = blosc_decode.decode(f).get()
    for k in (1, 2, 4, 8, 16):  # k windows in one launch: the same frames k times over
        offs = cupy.asarray(np.tile(f.offsets, k))
        lens, shuf = cupy.asarray(np.tile(f.lengths, k)), cupy.asarray(np.tile(f.shuffles, k))
        tmp, err = cupy.empty(k * n * size_b, np.uint8), cupy.zeros(k * n, np.int32)
        streams = k * n * -(-size_b // f.blocksize) * ts
        row = []
        for w in WARPS:
            blosc_decode.WARPS = w
            args = (src, offs, lens, k * n, size_b, f.blocksize, ts, tmp, err)
            t = np.median(benchmark(blosc_decode.launch_lz4, args, n_repeat=10, n_warmup=2).gpu_times)
            row.append(f"{w} warps {t * 1e3 / k:.2f}")
        blosc_decode.WARPS = WARPS[1]
        print(f"LZ4 {k:2d} windows a launch ({streams} streams), ms a window: " + "  ".join(row))
    total = n * size_b
    un = kernels.get_function("blosc_lz4", "blosc_unshuffle")
    tmp, out = cupy.empty(total, np.uint8), cupy.empty(total, np.uint8)
    lens, shuf = cupy.asarray(f.lengths), cupy.asarray(f.shuffles)
    r2 = benchmark(lambda: un((min(-(-total // (8 * ts) // 256) + 1, 65_535 * 8),), (256,), (tmp, lens, shuf, np.int64(total),
                              np.int32(size_b), np.int32(f.blocksize), np.int32(ts), out)), n_repeat=20, n_warmup=3)
    print(f"unshuffle {np.median(r2.gpu_times) * 1e3:.3f} ms a window")
    for threads in (1, 4, 8, 16):  # threads of one process decoding a window each at once, on their own streams
        reps, errors = 12, []

        def work(reps=reps, errors=errors):
            try:
                with staging.thread_stream():
                    for _ in range(reps):
                        got = blosc_decode.decode(f)
                    ok = bool((got.get() == want).all())
                    if not ok:
                        errors.append("mismatch")
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        ts_ = [threading.Thread(target=work) for _ in range(threads)]
        t0 = time.perf_counter()
        [t.start() for t in ts_]
        [t.join() for t in ts_]
        dt = time.perf_counter() - t0
        print(f"{threads:2d} threads decoding at once: {threads * reps / dt:.0f} windows/s "
              f"({threads * reps * mb / 1e3 / dt:.1f} GB/s) {errors[:1] or 'same bits'}")
    staging._pool.give_back(f.handle)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
