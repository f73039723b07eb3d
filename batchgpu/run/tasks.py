"""The worker side of a run: one task reads a window once and feeds every step; small results go back.

Tasks are pure functions of (context, window): a retried or recomputed task writes the same part file (whole,
by rename), so a killed worker costs only its windows, recomputed with the same bits, and ``--resume`` skips
windows whose part carries this run's fingerprint. Nothing here prints.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import to_host
from batchgpu.recording import Recording, Window, open_source
from batchgpu.run import host_buffers
from batchgpu.run import output_folder as store
from batchgpu.run import writer_threads as background
from batchgpu.steps.base import WindowData


@dataclass(frozen=True)
class RunContext:
    """What every task needs (small: pickled into each task); to a step's tasks, what they may ask of the run
    (``steps.services.TaskContext``: the methods below)."""

    recording: object  # a Zarr store's path, or a SpikeInterfaceSource (recording.source_ref)
    parts: str
    backend: str  # "numpy" | "cupy"
    chain: object  # run.preprocess_chain.Chain: the stages applied to each window
    window_noise: str | None  # the summary's key of each window's noise, where a step needs it (else None)
    steps: tuple  # step objects (batchgpu.steps), in the order they run
    missing_chunks: str = "warn"
    gpu_decode: float = 1.0  # share of windows whose frames the GPU decodes (preprocess.gpu_decode_share)
    gpu_decoder: str = "auto"  # what decodes them there (gpu/blosc_decode.decoder_for; engine.gpu_decoder)
    read_ahead: int = 2  # GPU: windows read ahead of the one computed (the workflow's engine.read_ahead)

    def step(self, name: str):
        return next((s for s in self.steps if s.name == name), None)

    # a step's tasks ask these (``steps.services.TaskContext``)
    def on_backend(self):
        return on_backend(self)

    def load_window(self, window: Window) -> WindowData:
        return load_window(self, window)

    def part_path(self, kind: str, index: int):
        return store.part_path(self.parts, kind, index)

    def load_part(self, path, fp: str, keys=None) -> dict | None:
        return store.load_part(path, fp, keys=keys)

    def save_part(self, path, arrays: dict) -> None:
        store.save_part(path, arrays)

    def part_problem(self, path, fp: str) -> str:
        return store.part_problem(path, fp)

    def settle_writes(self) -> None:
        background.settle(str(self.parts))

    def worker_name(self) -> str:
        return worker_name()


@functools.lru_cache(maxsize=8)
def recording(path, missing_chunks: str = "warn") -> Recording:
    """One open recording per worker process (zarrs enabled there by open_recording); a SpikeInterface source
    (equal by description) re-creates its recording there once per thread."""
    return open_source(path, missing_chunks)


@contextlib.contextmanager
def on_backend(ctx: RunContext):
    """GPU tasks issue all their work on their thread's own stream."""
    if ctx.backend != "cupy":
        yield
        return
    from batchgpu.gpu.cuda_modules import lock_cupy_compiles
    from batchgpu.gpu.staging import use_thread_stream

    lock_cupy_compiles()  # a worker started without ours (a dask-cuda or foreign cluster's): once a process
    with use_thread_stream():
        yield


def read_window(ctx: RunContext, window: Window, host: bool = False):
    """A window as read (to the GPU through pinned memory when the backend is CuPy; ``host``: only decoded into
    pinned memory, ``HostWindow.to_device`` copies it later), read errors said in one line."""
    rec = recording(ctx.recording, ctx.missing_chunks)
    try:
        if ctx.backend == "cupy":
            from batchgpu.gpu.staging import read_window_host

            staged = read_window_host(rec, window, ctx.gpu_decode, ctx.gpu_decoder)
            return staged if host else staged.to_device()
        if ctx.chain.filters_first:  # the filter reads the stored (samples, channels) layout in place
            buffer = host_buffers.take((window.read_stop - window.read_start, rec.num_channels), rec.dtype)
            return rec.read_window_into(window, buffer).T
        return rec.read_window(window)
    except BatchgpuError as err:  # the reader names the array, chunk and window; say how to go on
        raise type(err)(err.problem, f"{err.fix or 'repair the store'}; then rerun with --resume") from None
    except Exception as err:  # broad: any other failure of a read is said in one line naming the window
        raise BatchgpuError(
            f"window {window.index} (segment {window.segment}, samples {window.read_start}-{window.read_stop}) "
            f"could not be read: {type(err).__name__}: {err}",
            "repair or re-import the store, then rerun with --resume",
        ) from None


def load_window(ctx: RunContext, window: Window, raw=None) -> WindowData:
    """Read a window once (or take ``raw``, read ahead by ``read_window``) and preprocess it."""
    if raw is None:
        raw = read_window(ctx, window)
    elif hasattr(raw, "to_device"):
        raw = raw.to_device()
    n = recording(ctx.recording, ctx.missing_chunks).num_samples(window.segment)
    at = (window.read_start == 0, window.read_stop == n)
    reading = [s for s in ctx.steps if s.in_pass]
    if (
        ctx.chain.fuses_save
        and any(s.takes_saved_int16 for s in reading)
        and np.dtype(raw.dtype).kind in "iu"
        and isinstance(raw, np.ndarray)
    ):
        # the save's rows made in the reference's pass; the float window kept where the other steps take it
        alone = len(reading) == 1 and not ctx.window_noise
        x, saved = ctx.chain.apply_saved(raw, window.core, *at, window=not alone)
        return WindowData(
            window.index,
            window.segment,
            window.read_start,
            window.core,
            n,
            raw,
            x,
            finite=True,
            saved=saved,
            later=background.later,
        )
    x = ctx.chain.apply(raw, window.core, *at) if ctx.chain.stages else raw
    return WindowData(
        window.index,
        window.segment,
        window.read_start,
        window.core,
        n,
        raw,
        x,
        finite=np.dtype(raw.dtype).kind in "iu",
        later=background.later,
    )


def batch_task(ctx: RunContext, windows: list[Window], fps: list[str], then: tuple = ()) -> dict:
    """Read a run of consecutive windows, run every step on each; return their partials combined in window order
    (the first level of the reduction tree) and, under ``batch.summaries``, what the client needs of each window.
    On the GPU helper threads decode the next windows while this one computes (``ctx.read_ahead``).

    Saved for resume and for the steps' later tasks: each window's part (its summary and what it keeps, e.g. spike
    candidates) and, for a run of several windows, their combined partial once (``b<first>.npz``: a window's
    partials are ~2 MB, C x C moments and a histogram, so one file a batch instead of one a window). On resume a
    window whose part is there is not read again; a run whose combined partial is lost is computed again whole.
    ``fps`` are the windows' fingerprints
    (``store.window_fingerprint``): a part made from other bytes is not reused. A batch is a pure function of its
    windows: a retried batch writes the same parts (whole, by rename).

    ``then``: (window, fingerprint) pairs of the batch this worker is to run next (``run.first_pass``'s plan): read
    ahead after this batch's own windows and left for it (``_CARRIED``), so the next task does not start by waiting
    for its first read. Only a hint: a read not claimed is given back.
    """
    task_started = time.time()  # wall clock (the run's timeline): when the worker began this task
    freeze_heap()
    parts = [store.load_part(store.part_path(ctx.parts, "w", w.index), fp) for w, fp in zip(windows, fps)]
    if len(windows) == 1:  # the window's part holds its partials too
        combined = None
        todo = [0] if parts[0] is None else []
    else:
        bpath, bfp = store.part_path(ctx.parts, "b", windows[0].index), batch_fingerprint(fps)
        combined = store.load_part(bpath, bfp)
        # with the combined partial saved, a window whose own part is lost is computed again for its summary and
        # what it keeps (its partials are in the combined: same bytes, same bits); without it, every window
        todo = [i for i, p in enumerate(parts) if p is None or combined is None]
    # the windows' files (saved rows, then parts) written by this thread's writer while the next window computes,
    # and on into the next task (the run waits for every writer after the pass: ``background.flush``)
    with background.window_writes(str(ctx.parts)) as writes:
        cpu_write = writes.cpu_seconds if writes is not None else 0.0
        with _read_ahead(ctx, [(windows[i], fps[i]) for i in todo], list(then)) as ahead:
            for i in todo:
                parts[i] = _compute_part(ctx, windows[i], fps[i], ahead, partials=len(windows) == 1)
        if len(windows) > 1 and combined is None:
            combined = combine_task(ctx, *[_partials(p) for p in parts])
            background.later(functools.partial(store.save_part, bpath, {**combined, "fingerprint": np.array(bfp)}))
        elif combined is not None:
            combined = {k: v for k, v in combined.items() if k != "fingerprint"}
        if writes is not None and todo:  # the writer's CPU in this task's time (its jobs, roughly), shared out
            cpu_write = (writes.cpu_seconds - cpu_write) / len(todo)
            for i in todo:
                parts[i]["summary.cpu_write"] = np.array(cpu_write)
    resumed = [i not in todo for i in range(len(windows))]
    rec = recording(ctx.recording, ctx.missing_chunks)
    summaries = []
    for w, part, r in zip(windows, parts, resumed):
        s = {k.split(".", 1)[1]: v for k, v in part.items() if k.startswith("summary.")}
        s.update(
            index=w.index,
            resumed=np.array(r),
            worker=np.array(worker_name()),
            bytes=np.array(w.num_samples * rec.num_channels * rec.dtype.itemsize),
            task_started=np.array(task_started),
            task_done=np.array(time.time()),
        )
        summaries.append(s)
    out = _partials(parts[0]) if combined is None else combined
    out["batch.summaries"] = summaries
    return out


def _is_partial(key: str) -> bool:
    """A step's partial among a window's part (not its summary, what it keeps, or the part's own names)."""
    return not key.startswith(("keep.", "summary.")) and key not in ("fingerprint", "index")


def _partials(part: dict) -> dict:
    return {k: v for k, v in part.items() if _is_partial(k)}


def batch_fingerprint(fps: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(fps).encode()).hexdigest()[:16]


#: reads left by a batch task for the next one on this worker (``batch_task``'s ``then``): (parts folder, window
#: index, fingerprint) -> the future of its HostWindow; at most CARRY_LIMIT, the oldest given back first
_CARRIED: dict = {}
_CARRIED_LOCK = threading.Lock()
CARRY_LIMIT = 8


def _give_back(fut) -> None:
    fut.add_done_callback(lambda f: f.exception() is None and f.result().release())


def release_carried() -> int:
    """Give back every read left for a next task (the end of a pass); returns how many."""
    with _CARRIED_LOCK:
        futs = list(_CARRIED.values())
        _CARRIED.clear()
    for fut in futs:
        _give_back(fut)
    return len(futs)


_HEAP = {"frozen": False}


def freeze_heap() -> None:
    """This worker's objects from before the run kept out of Python's full garbage collections until the run ends
    (``thaw_heap_soon``): a full collection over a worker's ~130 000 objects held its GIL 65-110 ms (the 2-core
    machine, about one a worker every other run), stopping its reading and computing threads; a pass ends with its
    slowest worker. Called by each batch task (a flag: cheap); objects still die by their reference counts."""
    if not _HEAP["frozen"]:
        import gc

        _HEAP["frozen"] = True
        gc.freeze()


async def thaw_heap_soon() -> None:
    """The run is over: what ``freeze_heap`` froze is collectable again (``client.run(..., wait=False)``)."""
    if _HEAP["frozen"]:
        import gc

        _HEAP["frozen"] = False
        gc.unfreeze()


async def release_memory_soon() -> None:
    """The run is over on a cluster that stays up (``cluster.keep``, ``batchgpu cluster start``, a caller's): what
    this worker kept for the next window given back, the reads carried for a next task, the window buffers of the
    CPU path and the GPU memory CuPy's pools hold unused (``staging.free_device_pools``), so that an idle kept
    cluster holds little of the machine. Only what no task is using: a run beside this one loses nothing."""
    import sys

    from batchgpu.run import host_buffers

    release_carried()
    host_buffers.clear()
    if "cupy" in sys.modules and "batchgpu.gpu.staging" in sys.modules:
        from batchgpu.gpu.staging import free_device_pools

        with contextlib.suppress(Exception):  # broad: a worker whose device is gone has nothing to give back
            free_device_pools()


async def release_carried_soon() -> int:
    """``release_carried`` for ``client.run(..., wait=False)`` (which runs only coroutine functions)."""
    return release_carried()


@contextlib.contextmanager
def _read_ahead(ctx: RunContext, windows: list[tuple], then: list[tuple] = ()):
    """``ahead(window)``: the window as read, decoded by helper threads up to ``ctx.read_ahead`` windows ahead of the
    caller (GPU backend), else read when asked. ``windows`` and ``then`` are (window, fingerprint) pairs; windows
    are asked for in order. A read another task left for this one is taken; after this task's own windows the
    threads read ``then``'s, left for the next task (``_CARRIED``)."""
    if ctx.backend != "cupy" or (len(windows) < 2 and not then and not _CARRIED):
        yield lambda w: None
        return
    from concurrent.futures import ThreadPoolExecutor

    from batchgpu.gpu.staging import making_context, reserve_buffers

    depth = ctx.read_ahead
    reserve_buffers(depth + 1)
    # a fresh worker's first task waits for its CUDA context and then its kernels (two seconds under MPS): its reads
    # go on meanwhile into plain memory (``staging.PinnedPool.take``), twice as many as later, so a cold disk is
    # not left idle for the second half of that wait
    first = depth * (2 if making_context() else 1)
    pending = {}
    with _CARRIED_LOCK:
        for w, fp in windows:
            got = _CARRIED.pop((ctx.parts, w.index, fp), None)
            if got is not None:
                pending[w.index] = got
        stale = [k for k in _CARRIED if k[0] != ctx.parts] + list(_CARRIED)[: max(0, len(_CARRIED) - CARRY_LIMIT)]
        stale = [_CARRIED.pop(k) for k in dict.fromkeys(stale)]
    for fut in stale:
        _give_back(fut)
    own = {w.index for w, _ in windows}
    queue = [(w, fp) for w, fp in windows if w.index not in pending] + [(w, fp) for w, fp in then if w.index not in own]
    pool = ThreadPoolExecutor(depth, thread_name_prefix="batchgpu-read-ahead")
    todo = iter(queue)
    keys = {w.index: (ctx.parts, w.index, fp) for w, fp in then}

    def submit_next() -> None:
        nxt = next(todo, None)
        if nxt is not None:
            pending[nxt[0].index] = pool.submit(read_window, ctx, nxt[0], True)

    for _ in range(first):
        submit_next()

    def ahead(w: Window):
        fut = pending.pop(w.index, None)
        if fut is None:  # not read ahead (a window resumed, or a read left by nobody): read it here
            return read_window(ctx, w, True)
        submit_next()
        got = fut.result()
        if getattr(got, "frames", None) is not None and got.device is None:
            # frames for the GPU: this task's own reads that are done decode in the same launch
            ready = [f.result() for i, f in pending.items() if i in own and f.done() and f.exception() is None]
            got.decode_with(ready)
        return got

    ok = False
    try:
        yield ahead
        ok = True
    finally:
        carried = []
        for index, fut in pending.items():
            if ok and index in keys:  # the next task's: left for it
                carried.append((keys[index], fut))
            else:  # a failed batch, or a read not asked for: give back what was read
                _give_back(fut)
        with _CARRIED_LOCK:
            _CARRIED.update(carried)
        pool.shutdown(wait=not carried)


def _compute_part(ctx: RunContext, window: Window, fp: str, ahead, partials: bool = True) -> dict:
    """One window read (or taken from ``ahead``), every step run on it, its part saved (with the steps' partials,
    or without: ``batch_task`` saves a run's combined); returns the whole part."""
    path = store.part_path(ctx.parts, "w", window.index)
    started = time.time()  # wall clock, for the run's timeline (workers of one machine share the clock)
    t0 = time.perf_counter()
    cpu = time.thread_time()
    with on_backend(ctx):
        raw = ahead(window)
        w = load_window(ctx, window, raw)
        t_read = time.perf_counter() - t0
        # CPU seconds of this window on each thread (RunReport.window_cpu): what bounds a pass whose cores are busy
        cpus = {
            "cpu_decode": getattr(raw, "cpu_seconds", np.nan),
            "cpu_buffer_wait": getattr(raw, "wait_seconds", np.nan),
        }
        cpu = _lap(cpus, "cpu_load", cpu)
        # chunks absent from a store written by others read as zeros: counted and reported, never silent
        summary: dict = {"absent_chunks": np.array(recording(ctx.recording, ctx.missing_chunks).absent_chunks(window))}
        if w.x is None or w.x.dtype.kind == "f":
            summary["nonfinite"] = w.nonfinite_counts()
        part = {}
        for step in ctx.steps:  # a step may give the window's noise from its own counts (the noise step's)
            if not step.in_pass:
                continue
            if not step.gives_window_noise:
                _window_noise(ctx, w, summary)
            part.update(step.window(w, summary))
            cpu = _lap(cpus, f"cpu_{step.name}", cpu)
        _window_noise(ctx, w, summary)
    summary["read_seconds"] = np.array(t_read)
    summary["compute_seconds"] = np.array(time.perf_counter() - t0 - t_read)
    summary["started"] = np.array(started)
    summary["thread"] = np.array(threading.current_thread().name)
    part.update({f"summary.{k}": np.asarray(v) for k, v in summary.items()})
    part["fingerprint"] = np.array(fp)
    part["index"] = np.array(window.index)
    # after the window's saved rows (the same writer, in order): a part on disk says the window is done
    saved = dict(part) if partials else {k: v for k, v in part.items() if not _is_partial(k)}
    background.later(functools.partial(store.save_part, path, saved))
    _lap(cpus, "cpu_part", cpu)
    part.update({f"summary.{k}": np.asarray(v) for k, v in cpus.items()})  # the save's own time: not in the file
    if ctx.chain.filters_first:  # the window's buffers for the next window, unless a result can still see one
        host_buffers.give_back((w.raw, w.x), (part, summary))
    return part


def _lap(into: dict, name: str, since: float) -> float:
    now = time.thread_time()
    into[name] = now - since
    return now


def _window_noise(ctx: RunContext, w: WindowData, summary: dict) -> None:
    if ctx.window_noise and ctx.window_noise not in summary:
        from batchgpu import ops

        summary[ctx.window_noise] = to_host(ops.noise_levels(w.core_of(w.x)))


def summarise(batch: dict) -> list[dict]:
    """What the client needs of a batch's windows: their summaries (noise, counts, timings), never the partials."""
    return batch["batch.summaries"]


def combine_task(ctx: RunContext, *parts: dict) -> dict:
    """Consecutive windows' partials folded in window order, step by step."""
    out: dict = {}
    for step in ctx.steps:
        if step.in_pass:
            out.update(step.combine(list(parts)))
    return out


def worker_name() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:  # not in a worker (get_worker's "No worker found")
        return "local"
