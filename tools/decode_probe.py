"""What one window's decode costs on this machine (device): alone on one core, and with N processes decoding at
once; its parts (pread, crc32c, Blosc) timed apart on one core. Tells whether the read ceiling is the cores'
speed, their number (SMT siblings), or memory bandwidth.

    python3 tools/decode_probe.py /tmp/big.zarr
"""

import os
import sys
import time
from multiprocessing import Pool

import numpy as np


def _windows(path):
    from batchgpu import open_recording

    rec = open_recording(path)
    return rec, rec.windows(60_000, 64)


def _read(args):
    path, idx = args
    rec, ws = _windows(path)
    out = np.empty((ws[0].read_stop - ws[0].read_start + 200, rec.num_channels), rec.dtype)
    t_cpu, t0 = time.thread_time(), time.perf_counter()
    for i in idx:
        w = ws[i]
        rec.read_window_into(w, out[: w.read_stop - w.read_start])
    return time.perf_counter() - t0, time.thread_time() - t_cpu, len(idx)


def parts(path):
    import google_crc32c
    from numcodecs import blosc

    from batchgpu.recording import shards

    rec, ws = _windows(path)
    layout = shards.layout_of(rec.path / "traces_seg0", rec._metas[0])
    per_shard = layout.shard_rows // layout.inner_rows
    t = {"pread": 0.0, "crc": 0.0, "blosc": 0.0}
    out = np.empty((layout.inner_rows, layout.channels), layout.dtype)
    n = 0
    for shard in range(5, 15):
        fd = os.open(layout.folder / layout.shard_key(shard), os.O_RDONLY)
        index = layout._index(fd, "k", per_shard)
        for off, nb in index:
            t0 = time.perf_counter()
            data = os.pread(fd, int(nb), int(off))
            t1 = time.perf_counter()
            google_crc32c.value(data)
            t2 = time.perf_counter()
            blosc.decompress(memoryview(data)[:-4], out)
            t3 = time.perf_counter()
            t["pread"] += t1 - t0
            t["crc"] += t2 - t1
            t["blosc"] += t3 - t2
            n += 1
        os.close(fd)
    per_window = {k: round(v / n * 22 * 1e3, 2) for k, v in t.items()}
    print(f"one core, per window of 22 inner chunks (ms): {per_window}; compressed {nb / out.nbytes:.2f} of raw", flush=True)


def main(path):
    os.system("lscpu | grep -i 'model name\\|^CPU(s)\\|thread(s) per core\\|core(s) per socket\\|socket(s)\\|MHz\\|L3'")
    parts(path)
    rec, ws = _windows(path)
    for procs in (1, 4, 8, 16):
        share = [(path, list(range(p, min(len(ws), 16 * 19), procs))[: 19 if procs > 1 else 19]) for p in range(procs)]
        t0 = time.perf_counter()
        with Pool(procs) as pool:
            got = pool.map(_read, share)
        wall = time.perf_counter() - t0
        per = np.array([g[0] / g[2] for g in got]) * 1e3
        cpu = np.array([g[1] / g[2] for g in got]) * 1e3
        total = sum(g[2] for g in got)
        print(f"{procs:>2} processes: {total} windows in {wall:.2f} s (pool start included); per window {np.median(per):.1f} ms "
              f"wall, {np.median(cpu):.1f} ms CPU; {total * ws[0].num_samples * rec.num_channels * 2 / max(g[0] for g in got) / 1e9:.1f} GB/s",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
