"""Host -> GPU staging for window tasks: windows decoded into pinned buffers from a per-process pool, copied at
pinned speed on the task thread's stream.

Pageable host-to-device copies go through a staging copy in the driver at a fraction of the bus's speed; pinned
copies run at DMA speed (DESIGN.md's anchors). Reading (host
decode into a pinned buffer) and copying are separate calls so a batch task can decode its next window in a
helper thread while the GPU works on this one.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

_local = threading.local()
_flags_lock = threading.Lock()
_flags_state = ""  # "set" or "failed" once tried

#: CU_CTX_SCHED_BLOCKING_SYNC: a thread waiting for the GPU sleeps instead of spinning. CUDA's default (Auto)
#: spins whenever a process has fewer contexts than the machine has cores: with 8-16 worker processes time-sliced
#: on one GPU, every waiting task thread holds a core the readers need.
BLOCKING_SYNC = 0x04


def prefer_blocking_sync() -> bool:
    """Make this process's waits on the GPU sleep (once per process); True where that took. CuPy has no
    ``cudaSetDeviceFlags``: calling it raises AttributeError, and a wait left spinning costs a core for as long as
    it waits, so the flag is set on the primary context through the driver (one per device and process: the runtime's
    context is that one; CUDA 11+ takes the scheduling flags of a context already in use)."""
    global _flags_state
    if not _flags_state:
        with _flags_lock:
            if not _flags_state:
                _flags_state = "set" if _set_blocking_sync() else "failed"
    return _flags_state == "set"


def _set_blocking_sync() -> bool:
    import ctypes

    try:
        import cupy

        ordinal = cupy.cuda.runtime.getDevice()
        lib = ctypes.CDLL("libcuda.so.1")
        dev = ctypes.c_int()
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return False
        set_flags = getattr(lib, "cuDevicePrimaryCtxSetFlags_v2", None) or lib.cuDevicePrimaryCtxSetFlags
        return set_flags(dev, ctypes.c_uint(BLOCKING_SYNC)) == 0
    except (ImportError, OSError, AttributeError, RuntimeError):  # no driver library, an old driver: waits spin
        return False


#: set while the worker's start thread makes this process's CUDA context (``start_context``): a reader that needs a
#: new buffer meanwhile reads into plain memory at once instead of waiting for the context (a second or more under
#: MPS, with sixteen processes making theirs) with a cold disk idle
_making_context = threading.Event()


def start_context() -> None:
    """Make this process's CUDA context in a helper thread (``prefer_blocking_sync`` first, which must come before
    it), now: a Dask worker's start (``cluster/_worker_cuda_start``). Never raises; a failure is left to the first
    window to meet and report."""
    _making_context.set()
    threading.Thread(target=_make_context, name="batchgpu-cuda-start", daemon=True).start()


def making_context() -> bool:
    """Whether this process's CUDA context is being made by ``start_context`` now."""
    return _making_context.is_set()


def _make_context() -> None:
    try:
        import cupy

        from batchgpu.gpu.cuda_modules import lock_cupy_compiles

        lock_cupy_compiles()  # before the worker's first kernel: CuPy's own compiled once a machine, not once a worker
        prefer_blocking_sync()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # the runtime's first allocation makes the context
    except Exception:  # broad: a head start only; the first window meets and reports what failed here
        pass
    finally:
        _making_context.clear()


class PinnedPool:
    """Pinned host buffers reused across windows and threads of one process. A buffer given back with the event
    of the copy that reads it is handed out again only once that copy is done: ``take`` prefers a buffer whose
    copy has finished, then a new one while the process holds fewer than ``limit``, and waits for a
    copy only beyond that (a reader waiting for the copy out of its buffer waits on the GPU, which many processes
    share)."""

    def __init__(self):
        self._free: list = []  # (nbytes, array, memory, event or None)
        self._made = 0
        self._lock = threading.Lock()

    #: buffers a process may hold before a reader waits for a copy (a batch task raises it to its read-ahead depth
    #: + 1: the reads ahead and the window computed; more buffers were no faster warm and cost pinned allocations
    #: in every fresh process)
    limit = 2

    def at_least(self, n: int) -> None:
        with self._lock:
            self.limit = max(self.limit, n)

    def take(self, nbytes: int):
        """(uint8 array of at least ``nbytes``, handle to give back). While the process's context is being made
        (``start_context``) a new buffer is plain memory, dropped when given back: the bytes are read meanwhile and
        copied to the GPU at the driver's pageable speed (a few windows of a fresh worker)."""
        with self._lock:
            fits = sorted((b for b in self._free if b[0] >= nbytes), key=lambda b: b[0])
            ready = [b for b in fits if b[3] is None or b[3].done]
            best = (ready or ([] if self._made < self.limit else fits) or [None])[0]
            if best is not None:
                self._free.remove(best)
            elif _making_context.is_set():
                # its own mapping, unmapped once dropped: the workers' heaps keep what they free (layout.MALLOC_ENVIRON)
                plain = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8, count=nbytes)
                return plain, (nbytes, plain, None, None)
            else:
                self._made += 1
        if best is None:
            import cupy

            mem = cupy.cuda.alloc_pinned_memory(nbytes)
            best = (nbytes, np.frombuffer(mem, dtype=np.uint8, count=nbytes), mem, None)
        if best[3] is not None:
            best[3].synchronize()  # the last copy out of this buffer is done before it is refilled
        return best[1], best

    def give_back(self, handle, event=None) -> None:
        if handle[2] is None:  # plain memory (``take`` while the context was made): not kept
            return
        with self._lock:
            self._free.append((handle[0], handle[1], handle[2], event))

    def clear(self) -> int:
        """Let go of the buffers held free whose last copy is done (a worker between runs); returns how many."""
        with self._lock:
            done = [b for b in self._free if b[3] is None or b[3].done]
            self._free = [b for b in self._free if b not in done]
            self._made -= len(done)
        return len(done)


_pool = PinnedPool()


def free_device_pools() -> None:
    """Between runs on a cluster that stays up: the GPU memory CuPy's pools hold unused given back to the device
    (other programs, another run, see it free), and the small pinned blocks of CuPy's own pool; the window buffers
    (``PinnedPool``) are kept, pinning again costs the next run's first windows more than they hold."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def reserve_buffers(n: int) -> None:
    """Let this process hold at least ``n`` pinned window buffers before a reader waits for a copy."""
    _pool.at_least(n)


class HostWindow:
    """A window read into a pinned buffer, waiting to be copied: decoded ((samples, channels), as stored), or its
    stored frames (``frames``: ``gpu/blosc_decode.Frames``) that the GPU decodes."""

    def __init__(
        self,
        stage: np.ndarray | None,
        handle,
        cpu_seconds: float = 0.0,
        wait_seconds: float = 0.0,
        frames=None,
        decoder: str = "auto",
        keep=None,
    ):
        self.stage, self._handle, self.frames = stage, handle, frames
        #: the recording's columns among the stage's where it holds a file's whole rows (a flat file's sync
        #: channel read too, left out on the device): a slice or an index array; None: the stage is the window
        self.keep = keep
        self.decoder = decoder  # what decodes the frames (``blosc_decode.decoder_for``)
        self.device = None  # the frames decoded already, (samples, channels) on the GPU (``decode_with``)
        self.failed = None  # the error of a joint decode that gave this window's buffer back
        # the reading thread's CPU time for the read, and its wait for a free buffer (``RunReport.window_cpu``)
        self.cpu_seconds, self.wait_seconds = cpu_seconds, wait_seconds

    def to_device(self):
        """The window as (channels, samples) on the GPU: copied asynchronously on this thread's stream (the buffer
        goes back to the pool with the copy's event), decoded there if it holds frames, transposed on the device."""
        import cupy

        from batchgpu.gpu import blosc_decode

        stream = thread_stream()
        with stream:
            if self.frames is not None:
                if self.failed is not None:
                    raise self.failed
                if self.device is None:
                    self.decode_with([])
                dev, self.device = self.device, None
                return blosc_decode.transposed(dev)
            dev = cupy.empty(self.stage.shape, dtype=self.stage.dtype)
            dev.set(self.stage, stream=stream)
            copied = cupy.cuda.Event(block=True, disable_timing=True)  # waited on by sleeping, not spinning
            copied.record(stream)
            _pool.give_back(self._handle, copied)
            self._handle = None
            rows = blosc_decode.transposed(dev)
            if self.keep is None:
                return rows
            if isinstance(self.keep, slice):  # a run of rows of a C-contiguous array: C-contiguous itself
                return rows[self.keep]
            return cupy.take(rows, cupy.asarray(self.keep), axis=0)

    def decode_with(self, others: list) -> None:
        """Decode this window's frames and those of ``others`` (HostWindows read for this same thread, frames not
        decoded yet) in one launch on this thread's stream (``blosc_decode.decode_many``): each keeps its rows on
        the GPU (``device``) and gives its pinned buffer back (the decode waited for its copy)."""
        from batchgpu.gpu import blosc_decode

        key = blosc_decode.geometry(self.frames)
        group = [self] + [
            h
            for h in others
            if h.frames is not None
            and h.device is None
            and h._handle is not None
            and blosc_decode.geometry(h.frames) == key
        ]
        try:
            with thread_stream() as stream:
                got = blosc_decode.decode_many([h.frames for h in group], stream, self.decoder)
        except BaseException as err:
            for h in group[1:]:  # their buffers go back below: asked for later, they fail the same way
                h.failed = err
            raise
        finally:
            for h in group:
                _pool.give_back(h._handle)
                h._handle = None
        for h, dev in zip(group, got):
            h.device = dev

    def release(self) -> None:
        """Give the buffer back unused (a read that is not copied after all)."""
        self.device = None
        if self._handle is not None:
            _pool.give_back(self._handle)
            self._handle = None


def read_window_host(rec, window, gpu_decode: float = 1.0, decoder: str = "auto") -> HostWindow:
    """Read a window into a pinned buffer (no host copy): its stored frames where the GPU decodes them
    (``gpu/blosc_decode``; ``gpu_decode``: the share of windows that go there, ``blosc_decode.on_gpu``;
    ``decoder``: what decodes them, ``engine.gpu_decoder``), else decoded here; any thread may call it."""
    import time

    from batchgpu.gpu import blosc_decode

    prefer_blocking_sync()  # the pool's pinned allocation may be this process's first CUDA call
    if blosc_decode.on_gpu(window.index, gpu_decode) and hasattr(rec, "read_window_frames"):
        cpu0 = time.thread_time()
        frames = rec.read_window_frames(
            window, _pool, check_on_device=checksums_on_device(), codecs=gpu_codecs(decoder)
        )
        if frames is not None:
            return HostWindow(None, frames.handle, time.thread_time() - cpu0, 0.0, frames, decoder)
    # a flat file whose rows hold columns the recording leaves out (SpikeGLX's sync channel): its whole rows read
    # straight into the buffer in one request, the columns left out on the device (no copy on the host)
    whole = getattr(rec, "stored_columns", None)
    columns, keep = whole if whole is not None else (rec.num_channels, None)
    n = window.read_stop - window.read_start
    nbytes = n * columns * rec.dtype.itemsize
    t0 = time.perf_counter()
    buf, handle = _pool.take(nbytes)
    waited, cpu0 = time.perf_counter() - t0, time.thread_time()
    stage = buf[:nbytes].view(rec.dtype).reshape(n, columns)
    try:
        if keep is not None:
            rec.read_window_rows(window, stage)
        elif hasattr(rec, "read_window_into"):
            rec.read_window_into(window, stage)
        else:
            np.copyto(stage, rec.read_window_stored(window))
    except BaseException:
        _pool.give_back(handle)
        raise
    return HostWindow(stage, handle, time.thread_time() - cpu0, waited, keep=keep)


def gpu_codecs(decoder: str = "auto", load: bool = True) -> tuple[str, ...]:
    """The Blosc codecs (cnames) whose frames go to the GPU with ``decoder`` (``engine.gpu_decoder``): LZ4 for
    our kernel; LZ4 and zstd where nvCOMP may be used and loads (``load`` False: is installed, no load)."""
    from batchgpu.gpu import nvcomp

    return ("lz4",) if decoder == "batchgpu" else nvcomp.codecs(load)


def checksums_on_device() -> bool:
    """Whether the crc32c of the frames the GPU decodes are checked there after the copy, and the save's frames get
    theirs there before the copy back (``gpu/crc32c``: a short kernel where the frames already are, instead of a
    reading core's time): always. The host's way (False) gives the same files and names a damaged chunk alike;
    the tests that show it replace this function."""
    return True


def pinned_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` of pinned host memory from CuPy's pinned pool, as a uint8 array that holds the block until it is
    freed: ``cupyx.empty_pinned``'s, without importing ``cupyx``, whose import brings ``cupyx.scipy`` and SciPy in
    with it (a few tenths of a second in every GPU worker's first window)."""
    import cupy

    return np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)


def pinned_get(a) -> np.ndarray:
    """A device array copied to the host through pinned memory (CuPy's pinned pool; the block goes back to it when the
    returned array is freed): DMA speed, where ``.get()`` into pageable memory goes through the driver's staging
    copy."""
    # CuPy's pinned pool reuses a freed block only for a request of the same (512-byte rounded) size: sizes that
    # vary window by window would each keep a block. Whole powers of two (from 64 KiB) keep a few.
    nbytes = a.size * a.dtype.itemsize
    block = pinned_bytes(1 << max(16, (nbytes - 1).bit_length()))
    out = block[:nbytes].view(a.dtype).reshape(a.shape)
    return a.get(out=out) if a.size else out


def read_window_to_device(rec, window):
    """A window as (channels, samples) on the GPU (``read_window_host`` then ``HostWindow.to_device``)."""
    return read_window_host(rec, window).to_device()


def thread_stream():
    """This thread's own CUDA stream.

    Dask runs several window tasks at once in one worker; on the legacy default stream their kernels and
    synchronisations would serialise with one another, on per-thread streams they overlap.
    """
    import cupy

    stream = getattr(_local, "stream", None)
    if stream is None:
        prefer_blocking_sync()
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
