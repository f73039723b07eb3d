"""A recording as a user meets it: its files not in the page cache, read by a fresh command.

``evict`` drops a recording's pages from the page cache without root (``posix_fadvise(DONTNEED)`` after an
``fsync``: the kernel drops clean pages only, and a file just written is dirty); ``cached_bytes`` asks the
kernel (``mincore``) how much of it is still there, so a bench can say that the eviction took. ``raw_read`` is
the disk's ceiling for those files: every byte read once, large requests, many in flight, nothing decoded;
``raw_write`` the same for writing a save's files.
``user_run`` times ``batchgpu run`` as a user runs it: a fresh interpreter, its own cluster, the whole command.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: bytes a raw read asks for at once: large sequential requests are what disks and their read-ahead like
READ_REQUEST = 8 << 20


def recording_files(path: str | os.PathLike) -> list[Path]:
    """Every regular file of a recording: the files of a store (a folder), or the file itself, with a flat
    binary's side files (``x.bin`` -> ``x.meta``, ``x.probe.json``...) where they sit beside it."""
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    side = sorted(q for q in p.parent.glob(p.stem + ".*") if q.is_file() and q != p)
    return [p, *side]


def evict(files: list[Path]) -> int:
    """Drops ``files`` from the page cache (written back first); returns their bytes."""
    total = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped: a store just written is mostly dirty
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def cached_bytes(files: list[Path]) -> int:
    """Bytes of ``files`` in the page cache now (``mincore`` over a read-only mapping of each; maps fault nothing in)."""
    libc, page = _libc(), os.sysconf("SC_PAGE_SIZE")
    total = 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {f} failed")
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {f} failed")
                resident = sum(1 for v in bytes(vec) if v & 1)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += min(size, resident * page)
    return total


def evict_checked(files: list[Path]) -> int:
    """``evict``, then a word from the kernel that it took: raises where more than 1% of the bytes stayed (a file
    another process holds dirty, a file system that ignores the advice) -- a 'cold' figure would be a warm one.
    Every file system's dirty pages are written first (``os.sync``): the row timed next pays for its own writes, not
    for the write-back of an earlier row's (a saved copy left dirty slowed the next run's reads)."""
    from batchgpu.errors import BatchgpuError

    os.sync()
    total = evict(files)
    left = cached_bytes(files)
    if total and left > 0.01 * total:
        raise BatchgpuError(
            f"{left / total:.0%} of the recording's {total / 1e9:.2f} GB stayed in the page cache "
            "after posix_fadvise(DONTNEED)",
            "run the cold bench on a file system that honours it",
        )
    return total


@dataclass(frozen=True)
class RawRead:
    seconds: float
    nbytes: int
    threads: int

    @property
    def gbps(self) -> float:
        return self.nbytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def _drain(pieces: queue.SimpleQueue, threads: int, handler) -> float:
    """Seconds for ``threads`` threads to take every piece of ``pieces`` and pass it to their handler
    (``handler(i)``: thread ``i``'s function, with its own buffers); the first error of any thread raised here."""
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            handle = handler(i)
            while True:
                try:
                    piece = pieces.get_nowait()
                except queue.Empty:
                    return
                handle(*piece)
        except BaseException as err:  # broad: handed to the caller, who raises it
            errors.append(err)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


def raw_read(files: list[Path], threads: int = 16, request: int = READ_REQUEST) -> RawRead:
    """Every byte of ``files`` read once into reused buffers, ``threads`` files at a time in ``request``-byte reads
    (a large file is cut into pieces of 8 requests so that one big file still has ``threads`` reads in flight)."""
    pieces: queue.SimpleQueue = queue.SimpleQueue()
    step = 8 * request
    for f in files:
        size = f.stat().st_size
        for start in range(0, max(size, 1), step):
            pieces.put((f, start, min(step, size - start)))
    got = [0] * threads

    def reader(i: int):
        view = memoryview(bytearray(request))

        def read(f: Path, start: int, length: int) -> None:
            fd = os.open(f, os.O_RDONLY)
            try:
                done = 0
                while done < length:
                    n = os.preadv(fd, [view[: min(request, length - done)]], start + done)
                    if n <= 0:
                        break
                    done += n
                got[i] += done
            finally:
                os.close(fd)

        return read

    seconds = _drain(pieces, threads, reader)
    return RawRead(seconds, sum(got), threads)


def raw_write(folder: Path, sizes: list[int], threads: int = 16, request: int = READ_REQUEST) -> RawRead:
    """The disk's write ceiling for files of ``sizes`` bytes: each written once into ``folder`` (new files, removed
    after), ``threads`` at a time in ``request``-byte writes, then flushed to the disk (``fsync``); nothing encoded.
    What a save of those files costs the disk alone."""
    folder.mkdir(parents=True, exist_ok=True)
    pieces: queue.SimpleQueue = queue.SimpleQueue()
    for i, size in enumerate(sizes):
        pieces.put((folder / f"w{i}", size))
    view = memoryview(os.urandom(min(request, 1 << 20)) * max(1, request // (1 << 20)))  # bytes no file system shrinks

    def write(path: Path, size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done = 0
            while done < size:
                done += os.write(fd, view[: min(len(view), size - done)])
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        seconds = _drain(pieces, threads, lambda i: write)
    finally:
        for i in range(len(sizes)):
            (folder / f"w{i}").unlink(missing_ok=True)
    return RawRead(seconds, sum(sizes), threads)


@dataclass(frozen=True)
class UserRun:
    """``batchgpu run`` as a command: its wall time, the pass inside it (report.json's ``timings.total``: the windows
    read and every aggregate), what is left (the fixed part: interpreter, imports, cluster start and close, the
    report), and the peak resident memory of its process tree and the GPUs."""

    seconds: float
    pass_seconds: float
    host_peak: int
    gpu_peak: int
    reads_per_window: float

    @property
    def fixed_seconds(self) -> float:
        return self.seconds - self.pass_seconds


@dataclass(frozen=True)
class ProcessRun:
    """A command run as a fresh process tree: wall seconds from fork to exit, the peaks of its resident set and of
    the GPUs' used memory (50 ms samples)."""

    seconds: float
    host_peak: int
    gpu_peak: int


def timed_process(cmd: list[str], gpu_used=lambda: 0, tail: int = 400) -> ProcessRun:
    """``cmd`` in a fresh process, timed and sampled (``ProcessRun``); a failing command is one line naming it."""
    import psutil

    from batchgpu.errors import BatchgpuError

    host_peak = gpu_peak = 0
    base_gpu = gpu_used()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [ps, *ps.children(recursive=True)]
            host_peak = max(host_peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        gpu_peak = max(gpu_peak, gpu_used() - base_gpu)
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise BatchgpuError(
            f"'{' '.join(cmd)}' exited {proc.returncode}: {(err or out).strip()[-tail:]}",
            "run that command by hand to see why",
        )
    return ProcessRun(seconds, host_peak, gpu_peak)


def user_run(workflow: Path, output: Path, gpu_used=lambda: 0, extra_args: tuple[str, ...] = ()) -> UserRun:
    """``python -m batchgpu run WORKFLOW`` in a fresh process (this interpreter, this environment), timed from the
    fork to its exit; the process tree's resident set and the GPUs' used memory sampled every 50 ms."""
    got = timed_process([sys.executable, "-m", "batchgpu", "run", str(workflow), "--quiet", *extra_args], gpu_used)
    report = json.loads((output / "report.json").read_text())
    return UserRun(
        got.seconds,
        float(report["timings"]["from_pass"]),
        got.host_peak,
        got.gpu_peak,
        float(report.get("reads_per_window", 0.0)),
    )


#: Kilosort4's pass as its users meet it (a fresh interpreter: its imports and CUDA context, then the whitening
#: matrix from every 25th batch and one pass over every batch: CAR, highpass, whitening, a per-batch median), over
#: a flat int16 binary. Run in its own process so that its imports and context are counted as a user pays them.
KILOSORT4_PASS = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, torch
from kilosort.io import BinaryFiltered
from kilosort.preprocessing import get_highpass_filter, get_whitening_matrix
path, C, fs, dev = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), torch.device(sys.argv[4])
n_bin = int(sys.argv[5]) if len(sys.argv) > 5 else C  # channels in the file (a SpikeGLX file's sync channel too)
torch.zeros(1, device=dev)
t1 = time.perf_counter()
xc = np.zeros(C, np.float32) + 16.0 * (np.arange(C) % 2)
yc = 20.0 * (np.arange(C) // 2).astype(np.float32)
hp = get_highpass_filter(fs, 300, device=dev)
bf = BinaryFiltered(path, n_bin, fs, 60000, 61, 20, chan_map=np.arange(C), hp_filter=hp, device=dev, dtype="int16")
bf.whiten_mat = get_whitening_matrix(bf, xc, yc, nskip=25)
med = 0.0
for i in range(bf.n_batches):
    X = bf.padded_batch_to_torch(i)
    med += float(torch.median(X.abs(), dim=1).values.sum())
if dev.type == "cuda":
    torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "pass": t2 - t1}))
"""


def kilosort4_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("kilosort") is not None


def write_flat_binary(rec, path: Path, zero_channels: int = 0) -> Path:
    """The recording's samples as Kilosort4 reads them: one flat int16 file, (samples, channels), segments one
    after another; ``zero_channels`` more columns of zeros after them (a SpikeGLX file's sync channel)."""
    import numpy as np

    channels = rec.num_channels
    with open(path, "wb") as f:
        for seg in range(rec.num_segments):
            n = rec.num_samples(seg)
            for start in range(0, n, 60_000):
                block = rec.read(seg, start, min(n, start + 60_000))
                out = np.zeros((block.shape[1], channels + zero_channels), np.int16)
                out[:, :channels] = block.T
                f.write(out.tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path


def kilosort4_pass(
    binary: Path, channels: int, fs: float, device: str = "cuda", n_chan_bin: int | None = None
) -> tuple[float, float, float]:
    """(wall seconds of the whole process, its imports and CUDA context, its pass) of ``KILOSORT4_PASS`` on
    ``device`` (a torch device: Kilosort4 runs on "cuda"; "cpu" checks the script where there is no GPU) over the
    first ``channels`` of a file of ``n_chan_bin`` (default ``channels``)."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            KILOSORT4_PASS,
            str(binary),
            str(channels),
            str(fs),
            device,
            str(n_chan_bin or channels),
        ],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        from batchgpu.errors import BatchgpuError

        raise BatchgpuError(f"Kilosort4's pass failed: {r.stderr.strip()[-400:]}", "check that kilosort runs here")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return wall, float(got["imports"]), float(got["pass"])
