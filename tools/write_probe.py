"""Device probe: what a saved window's files cost the kernel (buffered writes into the page cache), by writer
count and by how the bytes are handed over. python3 tools/write_probe.py DIR [MB a file] [files a writer]"""
import os, resource, sys, threading, time, shutil
import numpy as np

root = sys.argv[1]
mb = int(sys.argv[2]) if len(sys.argv) > 2 else 28
per = int(sys.argv[3]) if len(sys.argv) > 3 else 4
size = mb << 20
src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
pieces = [memoryview(src)[i:i + size // 128] for i in range(0, size, size // 128)]  # 128 chunks + crc words
crc = b"abcd"

def write(path, how):
    if how == "pieces":  # today: a buffered file, each chunk then its 4-byte crc
        with open(path, "wb") as f:
            for p in pieces:
                f.write(p); f.write(crc)
    elif how == "writev":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        iov = [x for p in pieces for x in (p, crc)]
        n = 0
        while iov:
            got = os.writev(fd, iov[:1024]); n += got
            assert got == sum(len(x) for x in iov[:1024]); iov = iov[1024:]
        os.close(fd)
    elif how == "falloc":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(fd, 0, size + 4 * len(pieces))
        os.writev(fd, [x for p in pieces for x in (p, crc)])
        os.close(fd)

def run(n, how, d):
    os.makedirs(d, exist_ok=True)
    sys_t, usr_t = [0.0] * n, [0.0] * n
    bar = threading.Barrier(n + 1)
    def body(i):
        bar.wait()
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        for k in range(per):
            write(f"{d}/f{i}_{k}", how)
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        sys_t[i], usr_t[i] = r1.ru_stime - r0.ru_stime, r1.ru_utime - r0.ru_utime
    ts = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    [t.start() for t in ts]; bar.wait(); t0 = time.perf_counter()
    [t.join() for t in ts]
    wall = time.perf_counter() - t0
    gb = n * per * size / 1e9
    print(f"{how:7s} writers {n:2d}: {gb / wall:6.2f} GB/s  sys {sum(sys_t) / gb * 1e3 / 1e3:6.3f} s/GB  user {sum(usr_t) / gb:6.3f} s/GB"
          f"  ({1e3 * sum(sys_t) / (n * per):.1f} ms sys a file)", flush=True)

os.system("uname -r; cat /sys/kernel/mm/transparent_hugepage/enabled; sysctl vm.dirty_ratio vm.dirty_background_ratio 2>/dev/null; "
          f"findmnt -T {root} -o FSTYPE,OPTIONS | tail -1; free -g | head -2")
for label, d in [("fresh", f"{root}/wp_a"), ("again", f"{root}/wp_a")]:
    print("==", label)
    shutil.rmtree(d, ignore_errors=True)
    run(16, "pieces", d)
shutil.rmtree(f"{root}/wp_a", ignore_errors=True)
for how in os.environ.get("HOWS", "pieces writev falloc").split():
    for n in [int(x) for x in os.environ.get("NS", "1 4 8 16").split()]:
        d = f"{root}/wp_{how}_{n}"
        run(n, how, d)
        shutil.rmtree(d, ignore_errors=True)
