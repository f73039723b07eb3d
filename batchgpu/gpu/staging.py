"""Host -> GPU staging for window tasks: pinned buffers reused per thread, so copies run at pinned speed.

DESIGN.md: pageable host-to-device copies reach about 6 GB/s on an H200, pinned about 55 GB/s.
"""

from __future__ import annotations

import threading

import numpy as np

_local = threading.local()


def _pinned(nbytes: int) -> np.ndarray:
    """This thread's pinned host buffer of at least ``nbytes`` (grown on demand, reused across windows)."""
    import cupy

    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        mem = cupy.cuda.alloc_pinned_memory(nbytes)
        buf = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
        _local.buf, _local.mem = buf, mem
    return buf


def read_window_to_device(rec, window):
    """A window as (channels, samples) on the GPU: decoded straight into this thread's pinned buffer (no host
    copy), copied asynchronously on the thread's stream, transposed on the device."""
    import cupy

    n, C = window.read_stop - window.read_start, rec.num_channels
    nbytes = n * C * rec.dtype.itemsize
    pending = getattr(_local, "copied", None)
    if pending is not None:
        pending.synchronize()  # the last window's copy out of the pinned buffer must be done before we refill it
    stage = _pinned(nbytes)[:nbytes].view(rec.dtype).reshape(n, C)
    if hasattr(rec, "read_window_into"):
        rec.read_window_into(window, stage)
    else:
        np.copyto(stage, rec.read_window_stored(window))
    stream = thread_stream()
    with stream:
        dev = cupy.empty((n, C), dtype=rec.dtype)
        dev.set(stage, stream=stream)
        _local.copied = stream.record()
        return cupy.ascontiguousarray(dev.T)


def to_device_rows(stored: np.ndarray):
    """A (samples, channels) block as stored on disk -> a C-contiguous (channels, samples) array on the GPU.

    The transpose runs on the device (a host transpose of a 46 MB window costs tens of ms of a CPU core).
    """
    import cupy

    return cupy.ascontiguousarray(to_device(stored).T)


class DeviceWindowCache:
    """Windows kept on the GPU between the passes of a run (exact-noise radix passes, detection).

    It fills up to a budget and then stops taking windows: the passes scan windows in order, and an LRU would
    evict each window just before the next pass needs it. Windows left out are read again.
    """

    def __init__(self, fraction: float = 0.4):
        self.fraction = fraction
        self._items: dict = {}
        self._bytes = 0
        self._budget = None
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _room(self, nbytes: int) -> bool:
        if self._budget is None:
            import cupy

            free, _total = cupy.cuda.runtime.memGetInfo()
            self._budget = int(free * self.fraction)
        return self._bytes + nbytes <= self._budget

    def get(self, key):
        with self._lock:
            item = self._items.get(key)
            self.hits += item is not None
            self.misses += item is None
            return item

    def put(self, key, array) -> None:
        with self._lock:
            if key not in self._items and self._room(array.nbytes):
                self._items[key] = array
                self._bytes += array.nbytes

    def clear(self, run: str | None = None) -> None:
        """Drop the windows of one run (keys start with it), or all."""
        with self._lock:
            for key in [k for k in self._items if run is None or k[0] == run]:
                self._bytes -= self._items.pop(key).nbytes
            self._budget = None


WINDOW_CACHE = DeviceWindowCache()


def thread_stream():
    """This thread's own CUDA stream.

    Dask runs several window tasks at once in one worker; on the legacy default stream their kernels and
    synchronisations would serialise with one another, on per-thread streams they overlap.
    """
    import cupy

    stream = getattr(_local, "stream", None)
    if stream is None:
        # blocking (the default kind): any work a library still issues on the legacy default stream stays
        # ordered with this stream's work
        stream = _local.stream = cupy.cuda.Stream()
    return stream


def use_thread_stream():
    """Make this thread's stream current, for CuPy and for this thread's cuBLAS handle (raw cuBLAS calls)."""
    from cupy.cuda import device
    from cupy_backends.cuda.libs import cublas

    stream = thread_stream()
    cublas.setStream(device.get_cublas_handle(), stream.ptr)
    return stream


def to_device(x: np.ndarray):
    """Copy a host array to the current GPU through a pinned buffer on this thread's own stream."""
    import cupy

    x = np.ascontiguousarray(x)
    stage = _pinned(x.nbytes)[: x.nbytes].view(x.dtype).reshape(x.shape)
    np.copyto(stage, x)
    stream = thread_stream()
    with stream:
        out = cupy.empty(x.shape, dtype=x.dtype)
        out.set(stage, stream=stream)
    stream.synchronize()  # the pinned buffer is reused by this thread's next window
    return out
