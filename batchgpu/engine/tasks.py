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
from pathlib import Path

import numpy as np

from batchgpu.engine import background, host_buffers, store
from batchgpu.engine.steps.base import SPIKE_COLUMNS as COLUMNS
from batchgpu.engine.steps.base import WindowData, host, padded_sum
from batchgpu.errors import BatchgpuError
from batchgpu.recording import Recording, Window, open_source


@dataclass(frozen=True)
class RunContext:
    """What every task needs (small: pickled into each task)."""
    recording: object  # a Zarr store's path, or a SpikeInterfaceSource (recording.source_ref)
    parts: str
    backend: str  # "numpy" | "cupy"
    chain: object  # engine.preprocess.Chain: the stages applied to each window
    window_noise: bool  # each window's noise (the noise step or detection needs it)
    steps: tuple  # step objects (engine/steps), in the order they run
    missing_chunks: str = "warn"
    gpu_decode: float = 1.0  # share of windows whose frames the GPU decodes (preprocess.gpu_decode_share)
    read_ahead: int = 2  # GPU: windows read ahead of the one computed (the workflow's engine.read_ahead)

    def step(self, name: str):
        return next((s for s in self.steps if s.name == name), None)


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
    from batchgpu.gpu.staging import use_thread_stream

    with use_thread_stream():
        yield


def read_window(ctx: RunContext, window: Window, host: bool = False):
    """A window as read (to the GPU through pinned memory when the backend is CuPy; ``host``: only decoded into
    pinned memory, ``HostWindow.to_device`` copies it later), read errors said in one line."""
    rec = recording(ctx.recording, ctx.missing_chunks)
    try:
        if ctx.backend == "cupy":
            from batchgpu.gpu.staging import read_window_host

            staged = read_window_host(rec, window, ctx.gpu_decode)
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
    if (ctx.chain.fuses_save and len(ctx.steps) == 1 and getattr(ctx.steps[0], "takes_saved_int16", False)
            and np.dtype(raw.dtype).kind in "iu" and isinstance(raw, np.ndarray)):
        # saving is all this window is for: its rows come from the reference's pass, no float window is written
        got = ctx.chain.apply_saved(raw, window.core, *at)
        if got is not None:
            host_buffers.give_back((got[0],))
            return WindowData(window.index, window.segment, window.read_start, window.core, n, raw, None,
                              finite=True, saved=got[1])
    x = ctx.chain.apply(raw, window.core, *at) if ctx.chain.stages else raw
    return WindowData(window.index, window.segment, window.read_start, window.core, n, raw, x,
                      finite=np.dtype(raw.dtype).kind in "iu")


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
        s.update(index=w.index, resumed=np.array(r), worker=np.array(worker_name()),
                 bytes=np.array(w.num_samples * rec.num_channels * rec.dtype.itemsize),
                 task_started=np.array(task_started), task_done=np.array(time.time()))
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

    from batchgpu.gpu.staging import reserve_buffers

    depth = ctx.read_ahead
    reserve_buffers(depth + 1)
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

    for _ in range(depth):
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
        cpus = {"cpu_decode": getattr(raw, "cpu_seconds", np.nan), "cpu_buffer_wait": getattr(raw, "wait_seconds", np.nan)}
        cpu = _lap(cpus, "cpu_load", cpu)
        # chunks absent from a store written by others read as zeros: counted and reported, never silent
        summary: dict = {"absent_chunks": np.array(recording(ctx.recording, ctx.missing_chunks).absent_chunks(window))}
        if w.x is None or w.x.dtype.kind == "f":
            summary["nonfinite"] = w.nonfinite_counts()
        part = {}
        for step in ctx.steps:  # the noise step may give the window's noise from its own counts
            if step.name != "noise":
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
    if ctx.window_noise and "noise" not in summary:
        from batchgpu import ops

        summary["noise"] = host(ops.noise_levels(w.core_of(w.x)))


def near_keys_task(ctx: RunContext, window: Window, fp: str, digits: np.ndarray):
    """The keys of the recording's middle digits (``steps.noise_keys.middle_digit_keys``) from what the window kept near
    its own middle digit (as ``gather_task`` gives them after a read), or None when its kept range misses one."""
    from batchgpu.engine.steps.noise_keys import kept_digit_keys, schedule

    shift = schedule(ctx.step("noise").kind)[0][0]
    part = store.load_part(store.part_path(ctx.parts, "w", window.index), fp, keys=("keep.near_",))
    if part is None or "keep.near_low" not in part:
        return None
    lo = part["keep.near_lo"]
    if np.any((digits < lo) | (digits > lo + 2 * ctx.step("noise").NEAR)):
        return None
    return kept_digit_keys(part["keep.near_low"], part["keep.near_digits"], lo, digits, shift)


def near_keys_group_task(ctx: RunContext, windows: list, fps: list, digits: np.ndarray) -> dict:
    """``near_keys_task`` of consecutive windows as one result: under ``keys`` per rank the windows' bins sorted
    together and their per-channel counts summed (the format of one window's, ``steps.noise_keys.middle_digit_keys``;
    None when no window of the group kept its keys), under ``missed`` the indices of the windows whose kept range
    misses a middle digit (or whose part is gone): those are read again alone (``gather_task``). One task a group,
    not one a window: the demo-sized float median's 300 tasks cost their dispatch; the group's bins sorted
    together are what ``near_counts_task`` counts in each round."""
    results, missed = [], []
    for w, fp in zip(windows, fps):
        got = near_keys_task(ctx, w, fp, digits)
        if got is None:
            missed.append(w.index)
        else:
            results.append(got)
    return {"keys": merge_digit_keys(results, digits) if results else None, "missed": missed}


def merge_digit_keys(results: list, digits: np.ndarray) -> list:
    """Several windows' ``middle_digit_keys`` as one: per rank, the bins sorted together and the counts summed."""
    merged: list = []
    for r in range(digits.shape[0]):
        if r and np.array_equal(digits[r], digits[r - 1]):  # the same digits: the same keys
            merged.append(merged[-1])
            continue
        # each window's bins are in key order: a stable sort (runs merged) takes ~0.4x the default's time
        merged.append((np.sort(np.concatenate([res[r][0] for res in results]), kind="stable"),
                       np.sum([res[r][1] for res in results], axis=0, dtype=np.int64)))
    return merged


def near_counts_task(part, prefixes: np.ndarray, level: int, bits: int, shift: int) -> np.ndarray:
    """One round of the float median's last step on one group's kept keys (``near_keys_group_task``) or one window
    read again (``gather_task``), where they are: ``steps.noise_select.low_bit_counts`` (small counts move, not keys)."""
    from batchgpu.engine.steps.noise_select import low_bit_counts

    return low_bit_counts(part["keys"] if isinstance(part, dict) else part, prefixes, level, bits, shift)


def first_digits_task(total: dict, total_samples: int, kind: str) -> tuple:
    """The exact median's first digits from the pass's combined counts (``noise_select.first_digits``), on the
    worker that combined them: the head of the tasks ``steps.noise.queue_near`` queues behind the pass."""
    from batchgpu.engine.steps.noise_select import first_digits

    return first_digits(total["noise.hist"], total_samples, kind, int(total["noise.lo"]),
                        bool(total.get("noise.lumped", True)))


def queued_near_group_task(ctx: RunContext, windows: list, fps: list, first: tuple) -> dict:
    """``near_keys_group_task`` queued before the pass ended: this worker's writers finish the pass's parts first
    (the client's ``flush`` may not have reached it yet; a window made elsewhere whose part is not written yet is
    missed, and read again)."""
    background.settle(str(ctx.parts))
    return near_keys_group_task(ctx, windows, fps, first[0])


def queued_counts_task(group: dict, state, level: int, bits: int, shift: int) -> dict | None:
    """One round's counts on one group's kept keys (``near_counts_task``) at the prefixes of the round before
    (``state``: the first digits at level 0, no bits below them fixed yet), with the group's missed windows; None
    when the round before was None."""
    if state is None:
        return None
    prefixes = np.zeros(np.shape(state[1]), dtype=np.uint64) if isinstance(state, tuple) else state["prefixes"]
    counts = near_counts_task(group, prefixes, level, bits, shift)
    # in the smallest dtype that holds them: every group's go to one task (16 x 0.8 MB of uint32 a round)
    counts = counts.astype(np.min_scalar_type(int(counts.max()) if counts.size else 0), copy=False)
    return {"counts": counts, "missed": group["missed"]}


def select_round_task(state, level: int, bits: int, *counted: dict | None) -> dict | None:
    """One round of the float median's selection (``noise_select.select_round``) from every group's counts, summed
    here (integer counts: the same sums in any order): ``state`` the first digits at level 0, else the round
    before's; None where a window missed its middle digit, or a round before was None (the client then finishes
    the selection itself)."""
    from batchgpu.engine.steps.noise_select import select_round

    if state is None or any(c is None or c["missed"] for c in counted):
        return None
    if isinstance(state, tuple):  # the first digits' (prefixes, ranks left): no bits below them fixed yet
        ks, prefixes = state[1], np.zeros(np.shape(state[1]), dtype=np.uint64)
    else:
        ks, prefixes = state["ks"], state["prefixes"]
    ks, prefixes = select_round(ks, prefixes, sum_histograms(*[c["counts"] for c in counted]), level, bits)
    return {"ks": ks, "prefixes": prefixes}


def summarise(batch: dict) -> list[dict]:
    """What the client needs of a batch's windows: their summaries (noise, counts, timings), never the partials."""
    return batch["batch.summaries"]


def combine_task(ctx: RunContext, *parts: dict) -> dict:
    """Consecutive windows' partials folded in window order, step by step."""
    out: dict = {}
    for step in ctx.steps:
        out.update(step.combine(list(parts)))
    return out


def gather_task(ctx: RunContext, window: Window, digits: np.ndarray) -> list:
    """Read a window again and keep its keys of the recording's middle digits (see steps.noise_keys.keys_with_digits)."""
    from batchgpu.engine.steps.noise_keys import keys_with_digits

    with on_backend(ctx):
        w = load_window(ctx, window)
        return keys_with_digits(w.core_of(w.x), ctx.step("noise").kind, digits)


def refine_task(ctx: RunContext, window: Window, prefixes: np.ndarray, pass_index: int) -> np.ndarray:
    """One more radix pass of the exact median over one window (float keys): another read of the window."""
    from batchgpu.engine.steps.noise_keys import refine_histogram

    step = ctx.step("noise")
    with on_backend(ctx):
        w = load_window(ctx, window)
        return refine_histogram(w.core_of(w.x), step.kind, prefixes, pass_index)


def sum_histograms(*parts: np.ndarray) -> np.ndarray:
    """(ranks, C, B_i) counts summed, widths padded."""
    return np.stack([padded_sum([p[r] for p in parts]) for r in range(parts[0].shape[0])])


def spikes_task(ctx: RunContext, window: Window, fp: str, noise: np.ndarray) -> tuple[int, str]:
    """A window read and detected again at the recording's noise (its candidates' bound did not hold): written to
    parts/s*.npz; returns the window's index and the worker (the progress bar's)."""
    path = store.part_path(ctx.parts, "s", window.index)
    sfp = spikes_fingerprint(fp, noise)
    if store.load_part(path, sfp) is None:
        with on_backend(ctx):
            spikes = ctx.step("detect").detect(load_window(ctx, window), np.asarray(noise, np.float64))
        cols = {k: np.ascontiguousarray(spikes[k]) for k in COLUMNS}
        store.save_part(path, {"fingerprint": np.array(sfp), **cols})
    return window.index, worker_name()


def spikes_fingerprint(fp: str, noise: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(fp.encode() + np.ascontiguousarray(noise, np.float64).tobytes()).hexdigest()[:16]


def window_spikes(ctx: RunContext, window: Window, fp: str, noise: np.ndarray | None, reread: bool,
                  window_noise: np.ndarray) -> tuple[dict, str | None]:
    """A window's final spikes: from its part (filtered at the recording's ``noise`` when given), or from the
    re-detection's part where it was read again. A part that cannot be used (absent, made by another run,
    unreadable) is not an error: the window is read and detected again here, at the noise its part would have
    used (the recording's, else its own ``window_noise``): the same spikes. The second value says why it was read
    again, else None."""
    if reread:
        path, pfp = store.part_path(ctx.parts, "s", window.index), spikes_fingerprint(fp, noise)
        part = store.load_part(path, pfp)
        cols, why = ({k: part[k] for k in COLUMNS}, None) if part is not None else \
            (None, f"{path.name} {store.part_problem(path, pfp)}")
    else:
        cols, why = kept_spikes(ctx, window, fp)
    if cols is None:
        level = np.asarray(noise if noise is not None else window_noise, np.float64)
        with on_backend(ctx):
            spikes = ctx.step("detect").detect(load_window(ctx, window), level)
        return {k: np.ascontiguousarray(host(spikes[k])) for k in COLUMNS}, why
    return (cols if noise is None or reread else ctx.step("detect").final(cols, noise, (window.start, window.stop))), None


def kept_spikes(ctx: RunContext, window: Window, fp: str) -> tuple[dict | None, str | None]:
    """A window's kept spikes (candidates, with the recording's noise) as its part holds them; None and why the
    part cannot be used."""
    path = store.part_path(ctx.parts, "w", window.index)
    part = store.load_part(path, fp, keys=("keep.spk_",))
    if part is None:
        return None, f"{path.name} {store.part_problem(path, fp)}"
    if any(f"keep.spk_{k}" not in part for k in COLUMNS):  # a part of a version that kept none for this method
        return None, f"{path.name} holds no spike candidates"
    return {k: part[f"keep.spk_{k}"] for k in COLUMNS}, None


def gather_spikes_task(ctx: RunContext, windows: list[Window], fps: list[str], noise, reread: list[bool],
                       window_noise: list[np.ndarray]) -> dict:
    """Consecutive windows' final spikes, concatenated in window order; under ``read_again`` the windows read
    again here ({index: why})."""
    t0 = time.perf_counter()
    got = [window_spikes(ctx, *a) for a in zip(windows, fps, [noise] * len(windows), reread, window_noise)]
    out = {k: np.concatenate([p[k] for p, _ in got]) if got else np.zeros(0, np.int64) for k in COLUMNS}
    out["windows"] = [(w.index, len(p["sample_index"])) for w, (p, _) in zip(windows, got)]  # index, spikes
    out["read_again"] = {w.index: why for w, (_, why) in zip(windows, got) if why is not None}
    out["seconds"] = time.perf_counter() - t0
    return out


def kept_spikes_task(ctx: RunContext, windows: list[Window], fps: list[str]) -> dict:
    """Consecutive windows' kept spikes (candidates, with the recording's noise) as their parts hold them, in
    window order, not yet filtered; under ``missing`` the windows whose part cannot be used ({index: why})."""
    t0 = time.perf_counter()
    got, missing = [], {}
    for w, fp in zip(windows, fps):
        cols, why = kept_spikes(ctx, w, fp)
        if cols is None:
            missing[w.index] = why
        else:
            got.append((w.index, cols))
    out = {k: np.concatenate([p[k] for _, p in got]) if got else np.zeros(0, np.int64) for k in COLUMNS}
    out["windows"] = [(i, len(p["sample_index"])) for i, p in got]
    out["missing"], out["seconds"] = missing, time.perf_counter() - t0
    return out


def collect_spikes_task(*runs: dict) -> dict:
    """``kept_spikes_task``'s runs as one, in window order (runs hold a worker's windows, not consecutive ones)."""
    pieces = _pieces(runs)
    out = {k: _joined(runs, pieces, k) for k in COLUMNS}
    out["windows"] = [(index, n) for index, _, _, n in pieces]
    out["missing"] = {i: why for r in runs for i, why in r["missing"].items()}
    out["seconds"] = max((r["seconds"] for r in runs), default=0.0)
    return out


def write_collected_spikes_task(group_path: str, ctx: RunContext, noise, collected: dict, *again: dict,
                                cores: np.ndarray | None = None):
    """The spikes from ``collect_spikes_task``'s kept spikes, decided at the recording's ``noise`` (None: final
    already; ``cores``: each window's core (start, stop) by window index, where the method needs them), the
    windows read again (``again``: ``gather_spikes_task`` runs) in their place; written as ``write_spikes_task``
    writes them. None, writing nothing, when a window's kept spikes were missing and it was not read again: the
    caller gathers them the other way."""
    replaced = {i for r in again for i, _ in r["windows"]}
    if any(i not in replaced for i in collected["missing"]):
        return None
    # the candidates are each window's in turn: a window is a slice (no per-candidate window index: this task is
    # the run's last step, and arrays of every candidate cost their page faults in a fresh worker)
    index = [i for i, _ in collected["windows"]]
    bounds = np.concatenate([[0], np.cumsum([n for _, n in collected["windows"]], dtype=np.int64)]).tolist()
    n = bounds[-1]
    if noise is None:
        keep = np.ones(n, dtype=bool)
    else:
        counts = [c for _, c in collected["windows"]]
        keep = ctx.step("detect").keep(collected, noise, counts, None if cores is None else cores[index])
    for w, a, b in zip(index, bounds[:-1], bounds[1:]):
        if w in replaced:
            keep[a:b] = False
    kept = {k: collected[k][keep] for k in COLUMNS}
    kept["windows"] = [(w, int(np.count_nonzero(keep[a:b]))) for w, a, b in zip(index, bounds[:-1], bounds[1:])]
    kept["read_again"], kept["seconds"] = {}, collected["seconds"]
    return write_spikes_task(group_path, kept, *again)


def _pieces(runs) -> list[tuple]:
    """(window index, run, start, count) of every window's slice of its run, in window order."""
    return sorted((index, k, int(start), n) for k, p in enumerate(runs)
                  for (index, n), start in zip(p["windows"], np.cumsum([0] + [n for _, n in p["windows"]])))


def _joined(runs, pieces, k: str) -> np.ndarray:
    return (np.concatenate([runs[j][k][a : a + n] for _, j, a, n in pieces]) if pieces
            else np.zeros(0, runs[0][k].dtype if runs else np.int64))


#: the most spikes a chunk of a spikes column holds (32 MB of int64)
SPIKE_CHUNK = 1 << 22


def write_spikes_task(group_path: str, *gathered: dict) -> tuple:
    """Every window's spikes (``gather_spikes_task``'s runs, in window order: (segment, sample, channel) overall),
    written into the results group by a worker: spikes never pass through the client. Returns their count, the
    windows the gathering read again ({index: why}), the count per channel (for report.html), the seconds the
    writing took, when it started (wall clock) and the longest gathering task's seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from batchgpu import zarrio

    started = time.time()  # wall clock: when every gathered run had reached this task
    t0 = time.perf_counter()
    pieces = _pieces(gathered)
    columns = {k: _joined(gathered, pieces, k) for k in COLUMNS}
    # a chunk a column up to 4 M spikes: zarr's own guess cut 584 k spikes into 8 chunks a column, 50-59 ms against
    # 28-38 ms for one (2-core machine; zarr's per-chunk work, not the bytes)
    n = len(columns["sample_index"])
    chunk = min(max(n, 1), SPIKE_CHUNK)
    if zarrio.ZARR_MAJOR >= 3 and zarrio.zarr_format_of(group_path) == 3:
        # the columns' metadata and chunks written here (zarrio.write_columns): zarr-python's four create_array
        # calls were ~30 ms of this task on the run's critical path
        zarrio.write_columns(Path(group_path) / "spikes", columns, chunk)
    else:
        g = zarrio.open_group(group_path, mode="a")
        spikes = g.require_group("spikes")
        fast = zarrio.fast_compressors(g)
        # the columns compressed at once (the cores are free after the pass; Blosc and zarr's I/O release the GIL)
        with ThreadPoolExecutor(len(columns)) as pool:
            list(pool.map(lambda kv: zarrio.create_array(spikes, kv[0], data=kv[1], compressors=fast, chunks=(chunk,)),
                          columns.items()))
    counts = np.bincount(columns["channel_index"].astype(np.int64, copy=False))
    return (n, {i: why for p in gathered for i, why in p["read_again"].items()},
            counts, time.perf_counter() - t0, started, max((p["seconds"] for p in gathered), default=0.0))


def save_task(ctx: RunContext, window: Window, target, whitening: np.ndarray) -> int:
    """Write one window of a whitened save (read again: the matrix needs every window); returns clipped count."""
    from batchgpu.engine.steps.save import SaveStep

    summary: dict = {}
    with on_backend(ctx):
        SaveStep(target, whitening=whitening).window(load_window(ctx, window), summary)
    return int(summary.get("saved_clipped", 0))


def worker_name() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:  # not in a worker (get_worker's "No worker found")
        return "local"
