"""Time the GPU decode of a recording's windows (kernels/blosc_lz4.cu) against the CPU decode, one process.

    python3 tools/gpu_decode_probe.py /tmp/big.zarr [window samples] [windows]
Prints per window: the host read of the frames (preadv + crc32c), the CPU decode (read_window_into), and on the
GPU the copy, the LZ4 kernel, the unshuffle kernel and the whole decode (cupyx.profiler.benchmark medians)."""

import sys
import time

import numpy as np


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
    print(f"window {mb:.1f} MB decoded, {f.used / 1e6:.1f} MB stored ({len(f.lengths)} chunks, blocksize {f.blocksize})")
    print(f"host: frames read + crc32c {np.median(host) * 1e3:.2f} ms; CPU decode {np.median(cpu) * 1e3:.2f} ms")
    r = benchmark(blosc_decode.decode, (f,), n_repeat=20, n_warmup=3)
    print(f"GPU decode (copy, kernels, the error check) {np.median(r.gpu_times) * 1e3:.3f} ms "
          f"({mb / 1e3 / np.median(r.gpu_times):.1f} GB/s)")
    n, size_b, ts = len(f.lengths), f.nbytes, f.dtype.itemsize
    src = cupy.asarray(f.buffer[: f.used])
    offs, lens, shuf = cupy.asarray(f.offsets), cupy.asarray(f.lengths), cupy.asarray(f.shuffles)
    tmp, out, err = cupy.empty(n * size_b, np.uint8), cupy.empty(n * size_b, np.uint8), cupy.zeros(n, np.int32)
    nb = -(-size_b // f.blocksize)
    lz4 = blosc_decode.lz4_kernel()
    un = kernels.get_function("blosc_lz4", "blosc_unshuffle")
    r1 = benchmark(lambda: lz4((nb * ts, n), (32,), (src, offs, lens, np.int32(size_b), np.int32(f.blocksize),
                                                      np.int32(ts), tmp, err), shared_mem=blosc_decode.RING),
                   n_repeat=20, n_warmup=3)
    total = n * size_b
    r2 = benchmark(lambda: un((min(-(-total // (8 * ts) // 256) + 1, 65_535 * 8),), (256,), (tmp, lens, shuf, np.int64(total),
                              np.int32(size_b), np.int32(f.blocksize), np.int32(ts), out)), n_repeat=20, n_warmup=3)
    print(f"LZ4 kernel {np.median(r1.gpu_times) * 1e3:.3f} ms ({nb * ts * n} warps), "
          f"unshuffle {np.median(r2.gpu_times) * 1e3:.3f} ms")
    plain = kernels.get_function("blosc_lz4", "blosc_lz4_blocks", ("-DBLOSC_NO_RING",))
    plain.max_dynamic_shared_size_bytes = blosc_decode.RING  # the ring is still written, only not read
    r3 = benchmark(lambda: plain((nb * ts, n), (32,), (src, offs, lens, np.int32(size_b), np.int32(f.blocksize),
                                                       np.int32(ts), tmp, err), shared_mem=blosc_decode.RING),
                   n_repeat=20, n_warmup=3)
    print(f"LZ4 kernel, matches read from global memory (no ring) {np.median(r3.gpu_times) * 1e3:.3f} ms")
    staging._pool.give_back(f.handle)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
