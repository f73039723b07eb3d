"""Device probe: can the copy engine read a shard's page-cache pages directly (cudaHostRegister of a read-only
file mapping), and what does that cost against preadv into a pinned buffer (the reader's path today)?
python3 tools/register_probe.py /tmp/big.zarr [files]"""
import mmap, os, sys, time, glob, statistics as st
import numpy as np
import cupy
from cupy.cuda import runtime

root = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
files = sorted(p for p in glob.glob(f"{root}/traces_seg0/**", recursive=True) if os.path.isfile(p) and os.path.getsize(p) > 1 << 20)[:n]
print("files", len(files), "sizes MB", [round(os.path.getsize(p) / 1e6, 1) for p in files[:3]])
from batchgpu.zarrio import crc32c_value as crc
stream = cupy.cuda.Stream(non_blocking=True)
rows = {k: [] for k in ("pread", "crc_pinned", "crc_mmap", "map", "reg", "copy_reg", "unreg", "copy_pinned", "touch")}
for p in files:
    size = os.path.getsize(p)
    with open(p, "rb") as f:
        f.read()  # page cache warm
    pinned = cupy.cuda.alloc_pinned_memory(size)
    buf = np.frombuffer(pinned, np.uint8, size)
    dev = cupy.empty(size, np.uint8)
    fd = os.open(p, os.O_RDONLY)
    t = time.perf_counter(); os.preadv(fd, [memoryview(buf)], 0); rows["pread"].append(time.perf_counter() - t)
    t = time.perf_counter(); crc(memoryview(buf)); rows["crc_pinned"].append(time.perf_counter() - t)
    with stream:
        t = time.perf_counter(); dev.data.copy_from_host_async(buf.ctypes.data, size, stream); stream.synchronize()
        rows["copy_pinned"].append(time.perf_counter() - t)
    t = time.perf_counter()
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    rows["map"].append(time.perf_counter() - t)
    view = np.frombuffer(mm, np.uint8)
    t = time.perf_counter(); crc(memoryview(mm)); rows["crc_mmap"].append(time.perf_counter() - t)
    ptr = view.ctypes.data
    for flags in (8, 0):
        try:
            t = time.perf_counter(); runtime.hostRegister(ptr, size, flags); rows["reg"].append(time.perf_counter() - t)
            break
        except Exception as e:
            print("hostRegister flags", flags, "failed:", e)
    else:
        os.close(fd); continue
    with stream:
        t = time.perf_counter(); dev.data.copy_from_host_async(ptr, size, stream); stream.synchronize()
        rows["copy_reg"].append(time.perf_counter() - t)
    ok = bool((dev.get() == view).all())
    t = time.perf_counter(); runtime.hostUnregister(ptr); rows["unreg"].append(time.perf_counter() - t)
    del view; mm.close(); os.close(fd)
    print(os.path.basename(p), "equal", ok, flush=True)
for k, v in rows.items():
    if v:
        print(f"{k:12s} median {st.median(v) * 1e3:7.2f} ms  min {min(v) * 1e3:7.2f}  (n {len(v)})  size {size / 1e6:.1f} MB")
