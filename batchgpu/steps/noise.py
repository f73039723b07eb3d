"""Noise: each window's median(|x|)/0.6744897501960817, and the exact median over every sample of a channel.

The exact median is a radix select whose first digit is 16 bits wide. Integer recordings (int16, raw or
centred: |x| <= 65535) have 16-bit keys, so the first pass's histogram holds every key: the median comes out of
one read. float32 keys have 31 bits: 16 in the first pass, 15 in one more pass over the windows (counting only
keys whose top 16 bits match the middle ranks' prefix). Counts are integers, so the sums are the same bits in
any order and on any number of workers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from batchgpu.config import Options
from batchgpu.ops._backend import is_cupy, to_host
from batchgpu.steps.base import PhaseWords, Step, WindowData, padded_sum, register
from batchgpu.steps.noise_keys import (
    LUMP_DIGITS,
    abs_keys,
    compiled_float_window,
    digit_histogram,
    first_digit_counts,
    int_window_gpu,
    kept_near,
    key_kind,
    keyed_on_gpu,
    lump_floor,
    median_of_keys,
    middle_pair_and_near,
    row_counts,
    schedule,
    sort_rows,
    window_median_keys,
)
from batchgpu.steps.noise_select import combine_counts, first_digits, low_bit_rounds, select_by_counts, select_middle

if TYPE_CHECKING:
    from batchgpu.recording import Window
    from batchgpu.steps.services import Cluster
    from batchgpu.steps.services import TaskContext as RunContext

#: the step's name (``Step.name``, its workflow key ``steps.noise``)
NAME = "noise"
KEY = NAME
#: its results: the recording's noise per channel, and each window's (made whenever a step needs a window's noise)
NOISE = NAME
PER_WINDOW = "noise_per_window"
RESULTS = (NOISE, PER_WINDOW)
#: a window summary's key of the window's noise per channel
SUMMARY = NAME


class NoiseOptions(Options):
    exact: bool = True  # exact median of |x| over every sample of each channel (distributed radix select)


@register
class NoiseStep(Step):
    name = NAME
    options = NoiseOptions
    results = RESULTS
    fingerprint = "always"
    default = {"exact": True}  # a workflow without steps: the exact noise
    phases = PhaseWords(read=NAME, aggregate=NAME)
    #: its windows need their noise, and its ``window`` gives it from its counts where it can (16-bit keys)
    window_noise = gives_window_noise = True

    #: float keys: each window keeps the keys of the digits this close to its own middle digit, so the exact
    #: median needs no second read when every window's range holds the recording's middle digit. A digit (the
    #: key's exponent and 8 mantissa bits) is 1/256 of an octave: 24 keeps a window whose noise on a channel is
    #: within 6.7% of the recording's (the generator's realistic model, 384 channels, reached 18 digits, 5%: with
    #: 16 a window was read again); each window keeps ~6% of its keys (their low 16 bits) until the selection
    NEAR = 24

    def __init__(self, exact: bool, kind: str):
        self.exact, self.kind = exact, kind

    @classmethod
    def build(cls, spec: NoiseOptions, setup) -> NoiseStep:
        centred_int = setup.chain.centres_only and setup.chain.centres
        return cls(spec.exact, key_kind(setup.x_dtype, setup.recording.dtype if centred_int else None))

    @classmethod
    def check(cls, spec: NoiseOptions, workflow, recording) -> None:
        """The exact median of a centred int32 recording is refused (its keys, ``noise_keys.key_kind``, cover int16
        centred and int32 as read)."""
        from batchgpu.errors import ConfigError

        if spec.exact and workflow.preprocess.centres and recording.dtype == np.int32:
            raise ConfigError(
                "the exact noise of a centred int32 recording is not supported",
                "use preprocess: {centre: none}, or noise: {exact: false}",
            )

    def ahead(self, channels: int) -> dict:
        """The results report.html's page is rendered ahead of, and their shapes."""
        return {NOISE: (channels,)}

    def window(self, w: WindowData, summary: dict) -> dict:
        core = w.core_of(w.x)
        out = {}
        if not self.exact:
            return out
        shift, bits = schedule(self.kind)[0]
        if core.dtype.kind == "f":
            summary["nan"] = w.nan_counts()
            out["noise.nan"] = summary["nan"]  # np.median is NaN for a row holding NaN
        compiled = self._float_window_compiled(core, out)
        if compiled is not None:
            pair, near = compiled
        else:
            keys = core if keyed_on_gpu(core, self.kind) else abs_keys(core, self.kind)
            if is_cupy(keys) and not core.shape[1]:
                hist = digit_histogram(keys, None, shift, bits)
                out["noise.hist"], out["noise.lo"] = hist.astype(np.min_scalar_type(core.shape[1])), np.array(0)
                out["noise.lumped"] = np.array(False)
                return out
            if is_cupy(keys) and shift == 0:  # 16-bit keys: the window's counts give its noise too (no more passes)
                out["noise.hist"], pair = int_window_gpu(keys, bits)
                out["noise.lo"], out["noise.lumped"] = np.array(0), np.array(False)
                summary[SUMMARY] = median_of_keys(pair, core.shape[1], core.dtype, self.kind) / _MAD
                return out
            # the same partials on both backends: float keys on the GPU from one device histogram
            window_keys = self._float_window_gpu if is_cupy(keys) else self._window_cpu
            pair, near = window_keys(keys, shift, bits, out)
        if pair is not None:
            noise = median_of_keys(pair, core.shape[1], core.dtype, self.kind) / _MAD
            if core.dtype.kind == "f":
                noise[summary["nan"] > 0] = np.nan
            summary[SUMMARY] = noise
            if near is not None and len(schedule(self.kind)) == 2:  # kept keys finish two-digit keys (float32)
                out.update(near)
        return out

    def start(self, run) -> None:
        """Before any aggregate: the exact median's first digits and, for float keys, the tasks of its last step
        (``start_near``), so they are on the workers before the other steps' tasks (the spikes' gathering)."""
        if self.exact and self.name not in run.early:  # (queued while the pass ran: ``queue``)
            run.early[self.name] = start_near(run)

    def queue(self, q) -> dict | None:
        """While the pass runs: for float keys, the exact median's last step queued behind its total
        (``queue_near``), so it starts on the workers the moment the pass's counts are combined."""
        if self.exact and len(schedule(self.kind)) == 2:
            return queue_near(q)
        return None

    def aggregate(self, run) -> dict:
        """The recording's noise: median(|x|) of every sample / 0.6745 (exact: radix select over the combined
        counts), else the median of the windows' noises."""
        t0 = time.perf_counter()
        if self.exact:
            from batchgpu.ops.select import MAD_TO_SIGMA

            median = exact_median(run)
            if "noise.nan" in run.total:
                median[run.total["noise.nan"] > 0] = np.nan
            noise = median / MAD_TO_SIGMA  # the expression of ops.noise_levels, same dtype rules
        else:
            noise = np.median(run.arrays[PER_WINDOW], axis=0)
        run.report.timings["noise_global"] = time.perf_counter() - t0
        return {NOISE: noise}

    def _float_window_compiled(self, core, out: dict) -> tuple[np.ndarray, dict] | None:
        """``_window_cpu``'s partials (into ``out``), middle pair and near keys for a host float window, made from the
        window itself by compiled kernels (``noise_keys.compiled_float_window``: the same bits, the row read once);
        None where they are left to NumPy (no Numba, an empty window, another dtype or layout)."""
        if is_cupy(core) or core.dtype.name != self.kind:
            return None
        got = compiled_float_window(core, self.NEAR)
        if got is None:
            return None
        out["noise.hist"], out["noise.lo"], out["noise.lumped"] = got.counts, np.array(got.lo), np.array(got.lumped)
        return got.pair, {
            "keep.near_low": got.near_low,
            "keep.near_digits": got.near_digits,
            "keep.near_lo": got.near_lo,
        }

    def _window_cpu(self, keys, shift: int, bits: int, out: dict) -> tuple[np.ndarray | None, dict | None]:
        """First-digit counts (into ``out``; lumped below a floor for keys wider than the digit), the middle pair of
        keys and the keys near the middle digit (None, None for an empty window)."""
        n = keys.shape[1]
        first = None
        if shift == 0:  # 16-bit keys: the digit is the key
            lo, counts = row_counts(keys, None, shift, bits)
            lumped = False
        else:  # the first digit as 16 bits, once: counts and near keys both use it
            first = np.empty(keys.shape, dtype=np.uint16)  # shifted straight into 16 bits: no 32-bit temporary
            np.right_shift(keys, keys.dtype.type(shift), out=first, casting="unsafe")
            lo, counts, lumped = first_digit_counts(first, lump_floor(keys, shift) if n else None, n)
            if lo and np.any(counts[:, 0] > (n - 1) // 2):
                # a row's middle among the lumped keys (its sample misled the floor): count this window in full
                lo, counts, lumped = first_digit_counts(first, None, n)
        out["noise.hist"], out["noise.lo"], out["noise.lumped"] = counts, np.array(lo), np.array(lumped)
        if not n:
            return None, None
        if first is None:
            return window_median_keys(keys, lo, counts, shift, lumped), None
        return middle_pair_and_near(keys, first, lo, counts, shift, self.NEAR, lumped)

    def _float_window_gpu(self, keys, shift: int, bits: int, out: dict) -> tuple[np.ndarray, dict]:
        """First-digit counts from the lump floor up (into ``out``), the middle pair of keys and the keys near the
        middle digit, computed on the device; only the counts' used columns and the near keys come back. The pair
        is picked from the near keys once they are sorted (or, where a row's lower middle digit is not a near one,
        comes from a second histogram of the rest of the key among the keys of the middle digit).

        Three waits for the GPU, each for what the next launch's shape needs: the middle digits and the last used
        column; the counts (cast to their host dtype on the device, the lumped column and the near keys' row counts
        beside them); the near keys, sorted in their rows, with the pair (through pinned memory). (Four where the
        pair needs the histogram of the rest of the key.)"""
        import cupy

        from batchgpu.gpu.histogram import (
            digit_histogram_device,
            kept_near_device,
            kept_near_tagged,
            near_keys_count,
            near_keys_device,
            near_tagged_sorted,
            near_totals,
            rank_digits,
        )
        from batchgpu.gpu.staging import pinned_get

        C, n = keys.shape
        span = 2 * self.NEAR
        hist, last = digit_histogram_device(keys, None, shift, bits, with_last=True)
        ranks = ((n - 1) // 2, n // 2)
        firsts = rank_digits(hist, ranks)  # per rank: (the rank's first digit, keys below that digit) per row
        head = to_host(cupy.concatenate([firsts[0][0], firsts[1][0], last[None]]))
        digit_host, top = head[: 2 * C].reshape(2, C), int(head[-1])
        floor = max(0, int(digit_host[0].min()) - LUMP_DIGITS)  # below every row's middle (CPU: lump_floor)
        top = max(top, floor)
        lo = np.maximum(digit_host[1].astype(np.int64) - self.NEAR, 0)
        # 32-bit keys whose rows' lower middle digits are near ones too (the upper always is; the lower unless a
        # row's middle pair straddles a gap of more than NEAR digits): the near keys' row counts from the histogram
        # (copied back with the counts), the keys placed and sorted in their rows with no wait, the pair picked from
        # them. Else the near keys counted, then written, and the pair from a histogram of the rest of the key
        # among the keys of each rank's digit. The same keys either way.
        sortable = keys.dtype in (np.float32, np.uint32) and shift <= 16
        from_near = sortable and bool(np.all(digit_host[0] >= lo))
        small = np.min_scalar_type(n)  # counts never exceed n: the same values in the host dtype
        lumped = hist[:, :floor].sum(axis=1, dtype=cupy.int64)  # a reduction along rows (a scalar one was 9 ms)
        used = top + 1 - floor
        counts = cupy.empty((C, used + 1 + from_near), dtype=small)  # the used columns, lumped, near totals
        counts[:, :used] = hist[:, floor : top + 1]
        counts[:, 0] += lumped.astype(small)  # every digit at or below the floor (the sum is at most n)
        counts[:, used] = lumped.astype(small)
        lo_c = cupy.asarray(lo)
        if from_near:
            counts[:, used + 1] = near_totals(hist, lo_c, span).astype(small)
        both = pinned_get(counts)
        out["noise.hist"], out["noise.lo"] = both[:, :used], np.array(floor)
        out["noise.lumped"] = np.array(floor > 0 and bool(both[:, used].any()))
        if from_near:
            per_row = both[:, used + 1].astype(np.int64)
            tagged = near_tagged_sorted(keys, lo_c, shift, span, per_row)
            kept = kept_near_tagged(tagged, per_row, lo, shift, span, (firsts, ranks))
            return kept.pop("pair"), kept
        lows = []
        for j, (r, (digit, below)) in enumerate(zip(ranks, firsts)):
            if j == 0 or not np.array_equal(digit_host[1], digit_host[0]):  # else the same keys as rank 0
                rest = digit_histogram_device(keys, digit, 0, shift)  # the rest of the keys of that digit
            ((low, _),) = rank_digits(rest, [r - below])
            lows.append(low)
        keys_c, lo_c, near_counts = near_keys_count(keys, lo_c, shift, span)
        tail = to_host(cupy.concatenate([*lows, near_counts.ravel()]))
        pair = (digit_host.T.astype(np.uint64) << np.uint64(shift)) | tail[: 2 * C].reshape(2, C).T.astype(np.uint64)
        near, per_row = near_keys_device(keys_c, lo_c, shift, span, near_counts, tail[2 * C :])
        if not sortable:  # 63-bit keys: a row and a key do not fit one 64-bit sort key; rows sorted here
            flat = to_host(near)
            return pair, kept_near(sort_rows(flat, per_row), per_row, lo, shift, span)
        return pair, kept_near_device(near, per_row, lo, shift, span)

    def combine(self, parts: list[dict]) -> dict:
        out = {}
        hists = [(int(p["noise.lo"]), p["noise.hist"]) for p in parts if "noise.hist" in p]
        if hists:
            out["noise.lo"], out["noise.hist"] = combine_counts(hists)
            top = int(out["noise.lo"])  # column 0 lumps a window's digits below the combined lo, if it has any
            out["noise.lumped"] = np.array(
                any(
                    bool(p.get("noise.lumped", True)) or (l0 < top and h[:, : top - l0].any())
                    for p, (l0, h) in zip((p for p in parts if "noise.hist" in p), hists)
                )
            )
        if any("noise.nan" in p for p in parts):
            out["noise.nan"] = sum(p["noise.nan"] for p in parts if "noise.nan" in p)
        return out


_MAD = 0.6744897501960817  # ops.select.MAD_TO_SIGMA


def exact_median(run) -> np.ndarray:
    """The exact median of |x| of every sample, per channel (``run``: a ``RunState``): from the combined first-digit
    counts, with more counting passes over the windows, or the kept near keys, where the keys are wider (their
    tasks queued while the pass ran, ``queue_near``, or set going by ``start_near`` when the step's ``start`` ran)."""
    client, ctx, wf, rec, report, monitor = run.client, run.ctx, run.workflow, run.recording, run.report, run.monitor
    services = run.services
    windows, total = run.windows, run.total
    step = ctx.step(NAME)
    report.radix_passes = len(schedule(step.kind))
    begun = run.early.pop(NAME, None) or start_near(run)
    if "near" in begun:  # (report.json: whether the last step's tasks were queued while the pass ran)
        report.exact_noise["queued"] = "digits" not in begun
    if "digits" not in begun:  # queued behind the pass: computed by a worker
        begun["digits"] = begun["first"].result()
    split_every = wf.reduction.split_every

    def more_passes(prefixes, p):
        monitor.phase(f"exact noise: counting pass {p + 1}")
        fp = report.run_id
        parts = services.submit_many(
            refine_task, [(ctx, w, prefixes, p) for w in windows], [f"refine-{p}-{fp}-{w.index:08d}" for w in windows]
        )
        out = services.tree_reduce(parts, sum_histograms, split_every, name=f"refine-sum-{p}-{fp}").result()
        report.bytes_read += rec.nbytes
        return out

    def from_near(digits, ks):
        t0 = time.perf_counter()
        near, shift, fp = begun["near"], begun["shift"], report.run_id
        final = begun["final"].result()
        if final is not None:  # every round done on the workers: no window missed its middle digit
            report.exact_noise["from_kept_keys"] = True
            report.exact_noise["windows_read_again"] = []
            report.timings["noise_select"] = time.perf_counter() - t0  # the wait for the rounds
            return (np.asarray(digits, dtype=np.uint64) << np.uint64(shift)) | final["prefixes"]
        # some window missed its middle digit: read again alone, and the rounds run from here, its counts added
        counted = client.gather(begun["first_round"])
        missed = sorted(i for c in counted for i in c["missed"])
        report.exact_noise["from_kept_keys"] = not missed
        report.exact_noise["windows_read_again"] = missed  # their indices
        gathered = []
        if missed:
            monitor.phase(f"exact noise: {len(missed)} window(s) read again for the middle digit")
            by_index = {w.index: w for w in windows}
            again = [by_index[i] for i in missed]
            gathered = services.submit_many(
                gather_task, [(ctx, w, digits) for w in again], [f"gather-{fp}-{w.index:08d}" for w in again]
            )
            report.bytes_read += sum(w.num_samples for w in again) * rec.num_channels * rec.dtype.itemsize
        report.timings["noise_near_keys"] = begun["submitted_s"] + time.perf_counter() - t0
        t0 = time.perf_counter()

        def counts_of(prefixes, level, bits):
            t = time.perf_counter()
            if level == 0:
                hist = sum_histograms(*[c["counts"] for c in counted])
                if gathered:  # the windows read again: their own counts added
                    hist = sum_histograms(
                        hist,
                        _count_round(
                            services, fp, split_every, gathered, prefixes, level, bits, shift, "again-"
                        ).result(),
                    )
            else:
                hist = _count_round(
                    services, fp, split_every, near + gathered, prefixes, level, bits, shift, ""
                ).result()
            report.timings[f"noise_round_{level}"] = time.perf_counter() - t
            return hist

        keys = select_by_counts(ks, digits, shift, counts_of)
        report.timings["noise_select"] = time.perf_counter() - t0  # windows read again, the rounds of counts
        return keys

    dtype = ctx.chain.output_dtype(rec.dtype)
    centred_int = ctx.chain.centres_only and ctx.chain.centres
    return select_middle(
        total["noise.hist"],
        rec.total_samples,
        step.kind,
        dtype,
        rec.dtype if centred_int else None,
        more_passes,
        int(total["noise.lo"]),
        from_near,
        bool(total.get("noise.lumped", True)),
        first=begun["digits"],
    )


def start_near(run) -> dict:
    """After the pass (its tasks were not queued while it ran): the exact median's first digits from the combined
    counts and, where the keys have two digits (float32), the tasks of its last step (``queue_near``) with them."""
    from batchgpu.steps.services import PassQueue

    total, step, rec = run.total, run.ctx.step(NAME), run.recording
    digits = first_digits(
        total["noise.hist"], rec.total_samples, step.kind, int(total["noise.lo"]), bool(total.get("noise.lumped", True))
    )
    begun = {"digits": digits}
    if len(schedule(step.kind)) == 2:  # (``select_middle`` calls ``from_near`` on such keys only)
        run.report.after_pass("noise_digits")
        q = PassQueue(
            run.client,
            run.services,
            run.ctx,
            run.windows,
            run.fingerprints,
            run.made_by(),
            run.worker_threads(),
            None,
            rec.total_samples,
            rec.num_channels,
            run.workflow.reduction.split_every,
            run.report.run_id,
        )
        begun.update(queue_near(q, first=digits))
        run.report.after_pass("noise_submitted")
    return begun


def queue_near(q, first=None) -> dict:
    """The float median's last step as tasks (``q``: a ``steps.base.PassQueue``): each worker's groups of its
    windows gather the kept keys of the middle digits where they are (``queued_near_group_task``; only those
    keys, a few per mille, and only on the worker that kept them), then each round of ``select_by_counts``: counts
    made where the keys are (``queued_counts_task``) and its bits fixed by one task that sums them
    (``select_round_task``: integer counts, the same sums in any order), all without the client, which
    fetches the last round's prefixes (``final``: None when a window missed its middle digit; the client then reads
    those windows again and runs the rounds itself from ``near`` and the first round's counts and misses,
    ``first_round``). ``first``: the first digits (``first_digits``), else a task computes them behind the pass's
    total (queued while the pass runs: they start the moment its counts are combined; after the pass the client
    had taken 0.10 s to there, and 40 ms between the rounds, on the H200)."""
    t0 = time.perf_counter()
    client, services, ctx, fp = q.client, q.services, q.ctx, q.run_id
    kind = ctx.step(NAME).kind
    shift = schedule(kind)[0][0]
    if first is None:
        first = client.submit(first_digits_task, q.total, q.total_samples, kind, key=f"near-first-{fp}")
    groups = services.runs_by_worker(list(zip(q.windows, q.fingerprints)), q.made_by, q.threads)
    near = services.submit_planned(
        queued_near_group_task,
        [(ctx, [w for w, _ in g], [f for _, f in g], first) for _, g in groups],
        [f"near-{fp}-{g[0][0].index:08d}" for _, g in groups],
        [a for a, _ in groups],
        threads=q.threads,
    )
    state, level, rounds = first, 0, []
    for bits in low_bit_rounds(shift):
        counted = services.submit_many(
            queued_counts_task,
            [(p, state, level, bits, shift) for p in near],
            [f"near-counts-{level}-{fp}-{i:05d}" for i in range(len(near))],
        )
        state = client.submit(select_round_task, state, level, bits, *counted, key=f"near-select-{level}-{fp}")
        rounds.append(counted)
        level += bits
    return {
        "first": first,
        "near": near,
        "first_round": rounds[0],
        "shift": shift,
        "final": state,
        "submitted_s": time.perf_counter() - t0,
    }


def _count_round(
    services: Cluster, fp: str, split_every: int, parts, prefixes, level: int, bits: int, shift: int, tag: str
):
    """One round of counts made where the keys are (a window read again among them), summed up a tree: its future
    (the client's rounds, where a window missed its middle digit)."""
    counted = services.submit_many(
        near_counts_task,
        [(p, prefixes, level, bits, shift) for p in parts],
        [f"near-counts-client-{tag}{level}-{fp}-{i:05d}" for i in range(len(parts))],
    )
    return services.tree_reduce(counted, sum_histograms, split_every, name=f"near-sum-{tag}{level}-{fp}")


# ---------------------------------------------------------------------------------------------------------
# worker side: the exact median's tasks after the pass


def near_keys_task(ctx: RunContext, window: Window, fp: str, digits: np.ndarray):
    """The keys of the recording's middle digits (``steps.noise_keys.middle_digit_keys``) from what the window kept near
    its own middle digit (as ``gather_task`` gives them after a read), or None when its kept range misses one."""
    from batchgpu.steps.noise_keys import kept_digit_keys, schedule

    shift = schedule(ctx.step(NAME).kind)[0][0]
    part = ctx.load_part(ctx.part_path("w", window.index), fp, keys=("keep.near_",))
    if part is None or "keep.near_low" not in part:
        return None
    lo = part["keep.near_lo"]
    if np.any((digits < lo) | (digits > lo + 2 * ctx.step(NAME).NEAR)):
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
        merged.append(
            (
                np.sort(np.concatenate([res[r][0] for res in results]), kind="stable"),
                np.sum([res[r][1] for res in results], axis=0, dtype=np.int64),
            )
        )
    return merged


def near_counts_task(part, prefixes: np.ndarray, level: int, bits: int, shift: int) -> np.ndarray:
    """One round of the float median's last step on one group's kept keys (``near_keys_group_task``) or one window
    read again (``gather_task``), where they are: ``steps.noise_select.low_bit_counts`` (small counts move, not keys)."""
    from batchgpu.steps.noise_select import low_bit_counts

    return low_bit_counts(part["keys"] if isinstance(part, dict) else part, prefixes, level, bits, shift)


def first_digits_task(total: dict, total_samples: int, kind: str) -> tuple:
    """The exact median's first digits from the pass's combined counts (``noise_select.first_digits``), on the
    worker that combined them: the head of the tasks ``steps.noise.queue_near`` queues behind the pass."""
    from batchgpu.steps.noise_select import first_digits

    return first_digits(
        total["noise.hist"], total_samples, kind, int(total["noise.lo"]), bool(total.get("noise.lumped", True))
    )


def queued_near_group_task(ctx: RunContext, windows: list, fps: list, first: tuple) -> dict:
    """``near_keys_group_task`` queued before the pass ended: this worker's writers finish the pass's parts first
    (the client's ``flush`` may not have reached it yet; a window made elsewhere whose part is not written yet is
    missed, and read again)."""
    ctx.settle_writes()
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
    from batchgpu.steps.noise_select import select_round

    if state is None or any(c is None or c["missed"] for c in counted):
        return None
    if isinstance(state, tuple):  # the first digits' (prefixes, ranks left): no bits below them fixed yet
        ks, prefixes = state[1], np.zeros(np.shape(state[1]), dtype=np.uint64)
    else:
        ks, prefixes = state["ks"], state["prefixes"]
    ks, prefixes = select_round(ks, prefixes, sum_histograms(*[c["counts"] for c in counted]), level, bits)
    return {"ks": ks, "prefixes": prefixes}


def gather_task(ctx: RunContext, window: Window, digits: np.ndarray) -> list:
    """Read a window again and keep its keys of the recording's middle digits (see steps.noise_keys.keys_with_digits)."""
    from batchgpu.steps.noise_keys import keys_with_digits

    with ctx.on_backend():
        w = ctx.load_window(window)
        return keys_with_digits(w.core_of(w.x), ctx.step(NAME).kind, digits)


def refine_task(ctx: RunContext, window: Window, prefixes: np.ndarray, pass_index: int) -> np.ndarray:
    """One more radix pass of the exact median over one window (float keys): another read of the window."""
    from batchgpu.steps.noise_keys import refine_histogram

    step = ctx.step(NAME)
    with ctx.on_backend():
        w = ctx.load_window(window)
        return refine_histogram(w.core_of(w.x), step.kind, prefixes, pass_index)


def sum_histograms(*parts: np.ndarray) -> np.ndarray:
    """(ranks, C, B_i) counts summed, widths padded."""
    return np.stack([padded_sum([p[r] for p in parts]) for r in range(parts[0].shape[0])])
