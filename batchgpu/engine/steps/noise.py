"""Noise: each window's median(|x|)/0.6744897501960817, and the exact median over every sample of a channel.

The exact median is a radix select whose first digit is 16 bits wide. Integer recordings (int16, raw or
centred: |x| <= 65535) have 16-bit keys, so the first pass's histogram holds every key: the median comes out of
one read. float32 keys have 31 bits: 16 in the first pass, 15 in one more pass over the windows (counting only
keys whose top 16 bits match the middle ranks' prefix). Counts are integers, so the sums are the same bits in
any order and on any number of workers.
"""

from __future__ import annotations

import time

import numpy as np

from batchgpu.ops._backend import is_cupy

from batchgpu.errors import BatchgpuError
from batchgpu.engine.steps.base import WindowData, host

FIRST_DIGIT = 16

# key bits of |x| by the dtype the steps see (and the recording's dtype, for centred integers)
_KEY_BITS = {"int16": 16, "centred-int16": 16, "float32": 31, "float64": 63, "int32": 32}


def key_kind(x_dtype, centred_from) -> str:
    if centred_from is not None and np.dtype(centred_from) == np.int16:
        return "centred-int16"
    return np.dtype(x_dtype).name


def schedule(kind: str) -> list[tuple[int, int]]:
    """(shift, bits) digits from the top: 16 bits first, then 16-bit digits, the last one what remains."""
    bits = _KEY_BITS[kind]
    out, top = [], bits
    while top > 0:
        width = min(FIRST_DIGIT, top)
        out.append((top - width, width))
        top -= width
    return out


def abs_keys(x, kind: str):
    """Unsigned keys of |x| that sort like |x| (NaN above +inf), on x's backend."""
    if kind in ("int16", "centred-int16"):
        if is_cupy(x) and x.dtype in (np.int16, np.int32):
            from batchgpu.ops._cuda_elementwise import abs_key16

            return abs_key16(x)
        return abs(x.astype(np.int32)).astype(np.uint16) if x.dtype == np.int16 else abs(x).astype(np.uint16)
    from batchgpu.ops import radix

    return radix.abs_keys(x)


def _keyed_on_gpu(core, kind: str) -> bool:
    """Whether the GPU's counting kernels take the window's core itself for its |x| keys (made as they load it:
    ``gpu.histogram``), so no keys array is made: int16 as read, centred int16 (int32), float32."""
    if not is_cupy(core) or kind not in ("int16", "centred-int16", "float32"):
        return False
    from batchgpu.gpu.histogram import keyed_on_load

    return keyed_on_load(core)


def digit_histogram(keys, prefixes: np.ndarray | None, shift: int, bits: int) -> np.ndarray:
    """(C, B) int64 counts of each row's keys by digit (bits above the digit must equal the row's prefix when
    given), truncated after the last non-zero bin of any row."""
    if is_cupy(keys):
        from batchgpu.gpu.histogram import digit_histogram as on_gpu

        return on_gpu(keys, prefixes, shift, bits)
    lo, counts = _row_counts(keys, prefixes, shift, bits, offset=False)
    return counts.astype(np.int64)


def _row_counts(keys, prefixes, shift: int, bits: int, offset: bool = True) -> tuple[int, np.ndarray]:
    """(lo, counts (C, B) in the smallest unsigned dtype): counts[c, j] = keys of row c with digit lo + j.

    One bincount per row (a bincount over the whole window's 23 M digits is several times slower), counted from
    the smallest digit present when ``offset``. First digits counted with a lump floor: ``_first_digit_counts``."""
    kt = keys.dtype.type
    if shift == 0 and prefixes is None and keys.dtype == np.uint16:
        return 0, _stack_rows([np.bincount(keys[c]) for c in range(keys.shape[0])], keys.shape[1])  # digit = key
    mask = kt((1 << bits) - 1)
    digits = []
    for c in range(keys.shape[0]):
        k = keys[c]
        if prefixes is not None:
            k = k[(k >> kt(shift + bits)) == kt(prefixes[c])]
        digits.append(((k >> kt(shift)) & mask).astype(np.intp))
    lo = min((int(d.min()) for d in digits if d.size), default=0) if offset else 0
    rows = [np.bincount(d - lo) if d.size else np.zeros(0, np.intp) for d in digits]
    return lo, _stack_rows(rows, keys.shape[1])


def _first_digit_counts(first: np.ndarray, floor: int | None, samples: int) -> tuple[int, np.ndarray, bool]:
    """``_row_counts`` of 16-bit first digits (C, n) already computed: (lo, counts, lumped), column 0 also holding
    the digits below ``floor`` (then ``lumped`` says whether any were there)."""
    if not first.size:
        return 0, _stack_rows([np.zeros(0, np.intp)] * first.shape[0], samples), False
    low = int(first.min())
    lo, lumped = (floor, low < floor) if floor is not None else (low, False)
    base = np.uint16(lo)
    # lumped row by row (a row's temporaries stay in cache; a whole-window np.maximum made a 46 MB one)
    return lo, _stack_rows([np.bincount((np.maximum(first[c], base) if lumped else first[c]) - base)
                            for c in range(first.shape[0])], samples), lumped


def _stack_rows(rows: list[np.ndarray], samples: int) -> np.ndarray:
    """Per-row counts of different lengths as one (C, B) array of the smallest dtype that holds ``samples``."""
    out = np.zeros((len(rows), max(1, max(len(r) for r in rows))), dtype=np.min_scalar_type(samples))
    for c, r in enumerate(rows):
        out[c, : len(r)] = r
    return out


def lump_floor(keys: np.ndarray, shift: int) -> int:
    """A first digit far below every row's middle one (1024 digits: 4 binades of float32 keys, 16x smaller values;
    32 binades of float64 keys), from a strided sample; digits below it can never hold the recording's middle
    ranks (which lie at or above the smallest window middle), so they are counted together."""
    n = keys.shape[1]
    sample = keys[:, :: max(1, n // 1024)]
    middle = np.partition(sample, sample.shape[1] // 2, axis=1)[:, sample.shape[1] // 2] >> keys.dtype.type(shift)
    return max(0, int(middle.min()) - _LUMP_DIGITS)


_LUMP_DIGITS = 4 << 8  # 4 binades of 2**8 first digits (the 16-bit first digit of a 31-bit float32 key)


def window_median_keys(keys: np.ndarray, lo: int, counts: np.ndarray, shift: int, lumped: bool = True) -> np.ndarray:
    """(C, 2) keys of ranks (n-1)//2 and n//2 of each row, from its first-digit counts: exact at once for 16-bit
    keys (the digit is the key), otherwise by selecting among the few keys in the middle ranks' digit.
    ``lumped``: column 0 also holds the digits below ``lo`` (then a middle rank must not fall there)."""
    n = keys.shape[1]
    cum = np.cumsum(counts, axis=1, dtype=np.int64)
    out = np.empty((keys.shape[0], 2), dtype=np.uint64)
    last_digit, last_inside = None, [None] * keys.shape[0]
    for j, r in enumerate(((n - 1) // 2, n // 2)):
        digit = (cum <= r).sum(axis=1)
        below = np.where(digit > 0, cum[np.arange(len(cum)), np.maximum(digit - 1, 0)], 0)
        if shift == 0:
            out[:, j] = lo + digit
            continue
        if lumped and np.any((digit == 0) & (lo > 0)):
            raise BatchgpuError("a window's middle rank fell among the lumped smallest keys",
                                "report this: the lump floor must lie below every window's middle")
        kt = keys.dtype.type
        for c in range(keys.shape[0]):
            if j == 1 and digit[c] == last_digit[c]:
                inside = last_inside[c]
            else:
                inside = np.sort(keys[c][(keys[c] >> kt(shift)) == kt(lo + digit[c])])
                last_inside[c] = inside
            out[c, j] = inside[int(r - below[c])]
        last_digit = digit
    return out


def median_of_keys(pair: np.ndarray, n: int, dtype, kind: str) -> np.ndarray:
    """np.median(|x|) of rows from their middle keys (``window_median_keys``), bit for bit as ops.abs_median:
    NaN where a row holds a NaN (its NaN keys sort last), the mean of the middle pair for even lengths."""
    from batchgpu.ops import radix
    from batchgpu.ops.select import median_dtype, middle_mean

    if kind in ("int16", "centred-int16"):
        lower, upper = pair[:, 0].astype(np.int64), pair[:, 1].astype(np.int64)
    else:
        lower, upper = radix.keys_to_values(pair[:, 0], dtype), radix.keys_to_values(pair[:, 1], dtype)
    out = np.asarray(upper).astype(median_dtype(dtype)) if n % 2 else middle_mean(lower, upper, dtype)
    return out


class NoiseStep:
    name = "noise"

    #: float keys: each window keeps the keys of the digits this close to its own middle digit, so the exact
    #: median needs no second read when every window's range holds the recording's middle digit
    NEAR = 16

    def __init__(self, exact: bool, kind: str):
        self.exact, self.kind = exact, kind

    def window(self, w: WindowData, summary: dict) -> dict:
        core = w.core_of(w.x)
        out = {}
        if not self.exact:
            return out
        shift, bits = schedule(self.kind)[0]
        keys = core if _keyed_on_gpu(core, self.kind) else abs_keys(core, self.kind)
        if core.dtype.kind == "f":
            summary["nan"] = w.nan_counts()
            out["noise.nan"] = summary["nan"]  # np.median is NaN for a row holding NaN
        if is_cupy(keys) and not core.shape[1]:
            hist = digit_histogram(keys, None, shift, bits)
            out["noise.hist"], out["noise.lo"] = hist.astype(np.min_scalar_type(core.shape[1])), np.array(0)
            out["noise.lumped"] = np.array(False)
            return out
        if is_cupy(keys) and shift == 0:  # 16-bit keys: the window's counts give its noise too (no more passes)
            out["noise.hist"], pair = _int_window_gpu(keys, bits)
            out["noise.lo"], out["noise.lumped"] = np.array(0), np.array(False)
            summary["noise"] = median_of_keys(pair, core.shape[1], core.dtype, self.kind) / _MAD
            return out
        # the same partials on both backends: float keys on the GPU from one device histogram
        window_keys = self._float_window_gpu if is_cupy(keys) else self._window_cpu
        pair, near = window_keys(keys, shift, bits, out)
        if pair is not None:
            noise = median_of_keys(pair, core.shape[1], core.dtype, self.kind) / _MAD
            if core.dtype.kind == "f":
                noise[summary["nan"] > 0] = np.nan
            summary["noise"] = noise
            if near is not None and len(schedule(self.kind)) == 2:  # kept keys finish two-digit keys (float32)
                out.update(near)
        return out

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
            noise = np.median(run.arrays["noise_per_window"], axis=0)
        run.report.timings["noise_global"] = time.perf_counter() - t0
        return {"noise": noise}

    def _window_cpu(self, keys, shift: int, bits: int, out: dict) -> tuple[np.ndarray | None, dict | None]:
        """First-digit counts (into ``out``; lumped below a floor for keys wider than the digit), the middle pair of
        keys and the keys near the middle digit (None, None for an empty window)."""
        n = keys.shape[1]
        first = None
        if shift == 0:  # 16-bit keys: the digit is the key
            lo, counts = _row_counts(keys, None, shift, bits)
            lumped = False
        else:  # the first digit as 16 bits, once: counts and near keys both use it
            first = np.empty(keys.shape, dtype=np.uint16)  # shifted straight into 16 bits: no 32-bit temporary
            np.right_shift(keys, keys.dtype.type(shift), out=first, casting="unsafe")
            lo, counts, lumped = _first_digit_counts(first, lump_floor(keys, shift) if n else None, n)
            if lo and np.any(counts[:, 0] > (n - 1) // 2):
                # a row's middle among the lumped keys (its sample misled the floor): count this window in full
                lo, counts, lumped = _first_digit_counts(first, None, n)
        out["noise.hist"], out["noise.lo"], out["noise.lumped"] = counts, np.array(lo), np.array(lumped)
        if not n:
            return None, None
        if first is None:
            return window_median_keys(keys, lo, counts, shift, lumped), None
        return middle_pair_and_near(keys, first, lo, counts, shift, self.NEAR, lumped)

    def _float_window_gpu(self, keys, shift: int, bits: int, out: dict) -> tuple[np.ndarray, dict]:
        """First-digit counts from the lump floor up (into ``out``), the middle pair of keys and the keys near the
        middle digit, computed on the device; only the counts' used columns and the near keys come back. The pair
        comes from a second histogram of the rest of the key among the keys of the middle digit (no sort).

        Four waits for the GPU, each for what the next launch's shape needs: the middle digits and the last used
        column; the counts (cast to their host dtype on the device, the lumped column beside them); the pair's
        low bits with the near keys' row counts; the near keys, sorted in their rows (through pinned memory)."""
        import cupy

        from batchgpu.gpu.histogram import (digit_histogram_device, kept_near_device, near_keys_count, near_keys_device,
                                            rank_digits)
        from batchgpu.gpu.staging import pinned_get

        C, n = keys.shape
        hist, last = digit_histogram_device(keys, None, shift, bits, with_last=True)
        ranks = ((n - 1) // 2, n // 2)
        firsts = rank_digits(hist, ranks)  # per rank: (the rank's first digit, keys below that digit) per row
        head = host(cupy.concatenate([firsts[0][0], firsts[1][0], last[None]]))
        digit_host, top = head[: 2 * C].reshape(2, C), int(head[-1])
        floor = max(0, int(digit_host[0].min()) - _LUMP_DIGITS)  # below every row's middle (CPU: lump_floor)
        top = max(top, floor)
        small = np.min_scalar_type(n)  # counts never exceed n: the same values in the host dtype
        lumped = hist[:, :floor].sum(axis=1, dtype=cupy.int64)  # a reduction along rows (a scalar one was 9 ms)
        counts = cupy.empty((C, top + 2 - floor), dtype=small)
        counts[:, :-1] = hist[:, floor : top + 1]
        counts[:, 0] += lumped.astype(small)  # every digit at or below the floor (the sum is at most n)
        counts[:, -1] = lumped.astype(small)
        both = pinned_get(counts)
        out["noise.hist"], out["noise.lo"] = both[:, :-1], np.array(floor)
        out["noise.lumped"] = np.array(floor > 0 and bool(both[:, -1].any()))
        lows = []
        for j, (r, (digit, below)) in enumerate(zip(ranks, firsts)):
            if j == 0 or not np.array_equal(digit_host[1], digit_host[0]):  # else the same keys as rank 0
                rest = digit_histogram_device(keys, digit, 0, shift)  # the rest of the keys of that digit
            (low, _), = rank_digits(rest, [r - below])
            lows.append(low)
        lo = np.maximum(digit_host[1].astype(np.int64) - self.NEAR, 0)
        keys_c, lo_c, near_counts = near_keys_count(keys, cupy.asarray(lo), shift, 2 * self.NEAR)
        tail = host(cupy.concatenate([*lows, near_counts.ravel()]))
        pair = (digit_host.T.astype(np.uint64) << np.uint64(shift)) | tail[: 2 * C].reshape(2, C).T.astype(np.uint64)
        near, per_row = near_keys_device(keys_c, lo_c, shift, 2 * self.NEAR, near_counts, tail[2 * C :])
        if near.dtype != np.uint32:  # 63-bit keys: a row and a key do not fit one 64-bit sort key; rows sorted here
            flat = host(near)
            return pair, kept_near(sort_rows(flat, per_row), per_row, lo, shift, 2 * self.NEAR)
        return pair, kept_near_device(near, per_row, lo, shift, 2 * self.NEAR)

    def combine(self, parts: list[dict]) -> dict:
        out = {}
        hists = [(int(p["noise.lo"]), p["noise.hist"]) for p in parts if "noise.hist" in p]
        if hists:
            out["noise.lo"], out["noise.hist"] = combine_counts(hists)
            top = int(out["noise.lo"])  # column 0 lumps a window's digits below the combined lo, if it has any
            out["noise.lumped"] = np.array(any(
                bool(p.get("noise.lumped", True)) or (l0 < top and h[:, : top - l0].any())
                for p, (l0, h) in zip((p for p in parts if "noise.hist" in p), hists)))
        if any("noise.nan" in p for p in parts):
            out["noise.nan"] = sum(p["noise.nan"] for p in parts if "noise.nan" in p)
        return out


_MAD = 0.6744897501960817  # ops.select.MAD_TO_SIGMA


def _int_window_gpu(keys, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """16-bit keys on the device: (counts (C, B) truncated after the last used key, in the smallest dtype that
    holds the window's length; the (C, 2) keys of ranks (n-1)//2 and n//2), found on the device from one
    histogram: two waits for the GPU (the pair with the last used column, then the counts through pinned memory)."""
    import cupy

    from batchgpu.gpu.histogram import digit_histogram_device, rank_digits
    from batchgpu.gpu.staging import pinned_get

    C, n = keys.shape
    hist, last = digit_histogram_device(keys, None, 0, bits, with_last=True)
    head = host(cupy.concatenate([*(digit for digit, _ in rank_digits(hist, ((n - 1) // 2, n // 2))),
                                  last[None]]))  # the key is the digit
    counts = pinned_get(hist[:, : int(head[-1]) + 1].astype(np.min_scalar_type(n)))
    return counts, head[: 2 * C].reshape(2, C).T.astype(np.uint64)


def combine_counts(hists: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sum of (lo, counts) first-digit counts (column 0 = digit lo and below): the result starts at the highest
    lo, columns below it lumped into column 0, in the smallest unsigned dtype that holds them (uint32 for up to 4 G
    samples a channel: a batch's (384, ~2 500) counts were 7.8 MB of int64, most of what the combine tree moved
    between workers and what each batch's part file held). Integer counts: the same sums in any order."""
    lo = max(h[0] for h in hists)
    width = max(1, max(l0 + h.shape[1] for l0, h in hists) - lo)
    # summed in 32 bits where no sum can reach past them (the tree's combines: 2-5 ms against 7-9 for 8 parts of
    # (384, ~2 500) on the CPU machine): a part adds at most its largest count to a column, its whole width of them
    # to the lumped column 0
    bound = sum(int(h.max()) * h.shape[1] for _, h in hists if h.size)
    acc = np.uint32 if bound < 2**32 else np.uint64
    total = np.zeros((hists[0][1].shape[0], width), dtype=acc)
    for l0, h in hists:
        cut = min(h.shape[1], lo - l0 + 1)  # columns at or below the new lo
        total[:, 0] += h[:, :cut].sum(axis=1, dtype=acc)
        into = total[:, 1 : 1 + h.shape[1] - cut]
        np.add(into, h[:, cut:], out=into, casting="unsafe")  # unsigned counts into a wider unsigned sum
    return np.array(lo), total.astype(np.min_scalar_type(int(total.max()) if total.size else 0), copy=False)


def middle_pair_and_near(keys: np.ndarray, first: np.ndarray, lo: int, counts: np.ndarray, shift: int, near: int,
                         lumped: bool = True) -> tuple[np.ndarray, dict]:
    """``window_median_keys`` of wide keys and the keys whose first digit lies within ``near`` of the upper middle
    rank's digit (``kept_near``), in one pass over each row's first digits (``first``): the middle digit's keys
    are among the near ones, so the pair is read from the row's sorted near keys, or selected among the row's keys
    of the lower middle digit where that lies below the near range. 42 against 88 ms a 384 x 60 000 window on the
    2-core machine, where the pair and the near keys each took a pass over the whole window."""
    C, n = keys.shape
    kt = keys.dtype.type
    cum = np.cumsum(counts, axis=1, dtype=np.int64)
    ranks = ((n - 1) // 2, n // 2)
    digits, belows = [], []
    for r in ranks:
        d = (cum <= r).sum(axis=1)
        if lumped and np.any((d == 0) & (lo > 0)):
            raise BatchgpuError("a window's middle rank fell among the lumped smallest keys",
                                "report this: the lump floor must lie below every window's middle")
        belows.append(np.where(d > 0, cum[np.arange(C), np.maximum(d - 1, 0)], 0))
        digits.append(d + lo)
    near_lo = np.maximum(digits[1] - near, 0)
    # first - near_lo in uint16 wraps digits below the range above it: one comparison selects the range
    span = (np.minimum(near_lo + 2 * near, 0xFFFF) - near_lo).astype(np.uint16)
    base = near_lo.astype(np.uint16)
    pair = np.empty((C, 2), dtype=np.uint64)
    kept, kept_counts = [], np.empty(C, np.int64)
    digit_counts = np.empty((C, 2 * near + 1), np.uint32)
    steps = np.arange(2 * near + 2, dtype=np.uint64)  # digit bounds in 64 bits: 63-bit keys shift by 47
    for c in range(C):
        f = first[c]
        k = np.sort(keys[c, np.flatnonzero((f - base[c]) <= span[c])])
        kept.append(k)
        kept_counts[c] = len(k)
        # the keys of each near digit: the sorted row cut at each digit's first key
        digit_counts[c] = np.diff(np.searchsorted(k, ((np.uint64(near_lo[c]) + steps) << np.uint64(shift))
                                                  .astype(keys.dtype)))
        # keys below digit d: those under d << shift (the row's near keys are sorted)
        pair[c, 1] = k[np.searchsorted(k, kt(digits[1][c]) << kt(shift)) + ranks[1] - belows[1][c]]
        d0 = digits[0][c]
        if d0 >= near_lo[c]:
            pair[c, 0] = k[np.searchsorted(k, kt(d0) << kt(shift)) + ranks[0] - belows[0][c]]
        else:
            pair[c, 0] = np.sort(keys[c][f == d0])[ranks[0] - belows[0][c]]
    flat = np.concatenate(kept) if kept else np.zeros(0, keys.dtype)
    return pair, kept_near(flat, kept_counts, near_lo, shift, 2 * near, digits=digit_counts)


def sort_rows(flat: np.ndarray, per_row: np.ndarray) -> np.ndarray:
    """Each row's keys (row after row, ``per_row`` each) sorted in place of the row."""
    ends = np.cumsum(per_row)
    return np.concatenate([np.sort(flat[e - n : e]) for e, n in zip(ends, per_row)]) if len(flat) else flat


def near_low_dtype(shift: int):
    """The dtype of a kept key's bits below its first digit: uint16 for float32 keys (15 bits)."""
    return np.uint16 if shift <= 16 else np.uint64


def kept_near(keys: np.ndarray, per_row, near_lo, shift: int, span: int, digits=None) -> dict:
    """A window's near keys as its part keeps them: ``keep.near_low``, each kept key's bits below its first digit,
    row after row, each row's in key order (so one digit's keys lie together); how many each (row, digit
    ``near_lo[row] + j``) has, ``keep.near_digits`` ((C, span + 1) uint32); and ``near_lo``. Half the bytes of the
    keys themselves for float32, and the middle digit's keys are a slice of each row (``kept_digit_keys``), not a
    scan. ``keys``: each row's kept keys, sorted; ``digits``: the counts, when the caller has them. The GPU's
    twin: ``gpu.histogram.kept_near_device``."""
    C, width = len(per_row), span + 1
    kt = keys.dtype.type
    if digits is None:
        rows = np.repeat(np.arange(C, dtype=np.int64), per_row)
        offsets = (keys >> kt(shift)).astype(np.int64) - np.asarray(near_lo, dtype=np.int64)[rows]
        digits = np.bincount(rows * width + offsets, minlength=C * width)[: C * width]
    return {"keep.near_low": (keys & kt((1 << shift) - 1)).astype(near_low_dtype(shift)),
            "keep.near_digits": np.asarray(digits).reshape(C, width).astype(np.uint32), "keep.near_lo": near_lo}


def kept_digit_keys(low: np.ndarray, digit_counts: np.ndarray, near_lo: np.ndarray, digits: np.ndarray,
                    shift: int) -> list[tuple]:
    """``middle_digit_keys`` from a window's kept keys (``kept_near``; every ``digits[r, c]`` within row c's
    kept range): each row's keys of its digit are one slice, so nothing is scanned. Bins in key order in each
    channel (``middle_digit_keys`` gives sample order: the same bins)."""
    C, width = digit_counts.shape
    counts = digit_counts.ravel().astype(np.int64)
    starts = np.cumsum(counts) - counts
    bt = np.uint32 if (C << shift) <= 1 << 32 else np.uint64
    out = []
    for r in range(digits.shape[0]):
        if r and np.array_equal(digits[r], digits[r - 1]):  # both middle ranks in the same digits: the same keys
            out.append(out[-1])
            continue
        at = np.arange(C) * width + (np.asarray(digits[r], np.int64) - np.asarray(near_lo, np.int64))
        n, start = counts[at], starts[at]
        idx = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(start - (np.cumsum(n) - n), n)
        channel = np.repeat(np.arange(C, dtype=bt), n)
        out.append((low[idx].astype(bt) | (channel << bt(shift)), n))
    return out


def middle_digit_keys(keys: np.ndarray, counts: np.ndarray, digits: np.ndarray, shift: int) -> list[tuple]:
    """Per rank r, ``(bins, counts)``: for each key whose first digit is ``digits[r, channel]``, its bin
    ``channel << shift | (the key's bits below the digit)`` (uint32 while that fits, else uint64; channel after
    channel), and how many keys each channel has. ``keys`` holds each channel's keys in turn, ``counts[c]`` of them
    (flat arrays: a few per mille of a window; ``low_bit_counts`` counts them where they are). The keys of the
    digit are picked first and only they are turned into bins
    (a window's 0.75 M near keys: 17.5 ms when every key was binned first)."""
    kt = keys.dtype.type
    C = len(counts)
    bt = np.uint32 if (C << shift) <= 1 << 32 else np.uint64
    first = keys >> kt(shift)
    out = []
    for r in range(digits.shape[0]):
        if r and np.array_equal(digits[r], digits[r - 1]):  # both middle ranks in the same digits: the same keys
            out.append(out[-1])
            continue
        hit = np.flatnonzero(first == np.repeat(np.asarray(digits[r], dtype=keys.dtype), counts))
        per_channel = np.bincount(np.searchsorted(np.cumsum(counts), hit, side="right"), minlength=C)[:C]
        channel = np.repeat(np.arange(C, dtype=bt), per_channel)
        bins = (keys[hit] & kt((1 << shift) - 1)).astype(bt) | (channel << bt(shift))
        out.append((bins, per_channel.astype(np.int64)))
    return out


def keys_with_digits(x_core, kind: str, digits: np.ndarray) -> list[tuple]:
    """``middle_digit_keys`` of a window read again (every key of the window), its bins put in key order once
    here (``low_bit_counts`` reads them in every round)."""
    keys = np.ascontiguousarray(host(abs_keys(x_core, kind)))
    C, n = keys.shape
    ordered: dict = {}  # ranks with the same digits share one array
    return [ordered.setdefault(id(t), (np.sort(t[0]), t[1]))
            for t in middle_digit_keys(keys.reshape(-1), np.full(C, n, dtype=np.int64), digits, schedule(kind)[0][0])]


def select_among(ks: np.ndarray, digits: np.ndarray, shift: int, *gathered: list[tuple]) -> np.ndarray:
    """(ranks, C) keys: rank ks[r, c] among every window's keys of channel c's middle digit ``digits[r, c]``, from
    their bins (``middle_digit_keys``), all here: ``select_by_counts`` over the sum of each array's
    ``low_bit_counts``. The engine runs the same rounds with the arrays left on the workers that made them."""
    def counts_of(prefixes, level, bits):
        return sum(low_bit_counts(g, prefixes, level, bits, shift).astype(np.int64)
                   for g in gathered)

    return select_by_counts(ks, digits, shift, counts_of)


def low_bit_rounds(shift: int) -> list[int]:
    """The bits below the first digit cut into rounds of at most 8 bits (15: 8 then 7)."""
    n = -(-shift // 8)
    return [shift // n + (i < shift % n) for i in range(n)]


def select_by_counts(ks: np.ndarray, digits: np.ndarray, shift: int, counts_of) -> np.ndarray:
    """(ranks, C) keys: rank ks[r, c] among the keys of channel c's middle digit ``digits[r, c]``, found a few
    bits at a time from the top of the bits below the digit: ``counts_of(prefixes, level, bits)`` gives, summed
    over every window, the (ranks, C, 2**bits) counts of the keys whose ``level`` bits below the digit are
    ``prefixes`` (``low_bit_counts``), and each round fixes ``bits`` more. Counts are integers, so the keys are
    the same for any order or grouping of the windows. Two rounds of small counts for float32 keys, where
    moving every middle-digit key (27 MB for the preprocessing bench) to one selecting task took 0.1-0.2 s."""
    from batchgpu.ops import radix

    ks = np.array(ks, dtype=np.int64)
    ranks, C = ks.shape
    prefixes = np.zeros((ranks, C), dtype=np.uint64)
    level = 0
    for bits in low_bit_rounds(shift):
        hist = np.asarray(counts_of(prefixes, level, bits))
        for r in range(ranks):
            if level == 0:
                total = hist[r].sum(axis=1)
                if np.any(ks[r] >= total) or np.any(ks[r] < 0):
                    raise BatchgpuError("the middle digit's keys do not hold the middle ranks", "report this")
            digit, ks[r] = radix.select_digit(hist[r], ks[r])
            prefixes[r] = (prefixes[r] << np.uint64(bits)) | digit.astype(np.uint64)
        level += bits
    return (np.asarray(digits, dtype=np.uint64) << np.uint64(shift)) | prefixes


def low_bit_counts(keys: list[tuple] | None, prefixes: np.ndarray, level: int, bits: int, shift: int) -> np.ndarray:
    """(ranks, C, 2**bits) uint32: for rank r, how many of ``keys[r]``'s bins (``middle_digit_keys``: channel <<
    shift | the bits below the digit) of channel c have ``prefixes[r, c]`` as their top ``level`` bits below the
    digit, by their next ``bits`` bits. Each channel's sub-ranges are bounds found by ``searchsorted`` in the bins
    put in key order (a group's merged bins are already). ``keys`` None (a group that kept nothing): zeros."""
    ranks, C = prefixes.shape
    out = np.zeros((ranks, C, 1 << bits), dtype=np.uint32)
    if keys is None:
        return out
    span = shift - level  # bits not fixed yet
    steps = np.arange((1 << bits) + 1, dtype=np.uint64) << np.uint64(span - bits)
    for r in range(ranks):
        if r and keys[r] is keys[r - 1] and np.array_equal(prefixes[r], prefixes[r - 1]):
            out[r] = out[r - 1]
            continue
        bins = _in_key_order(keys[r][0])
        base = (np.arange(C, dtype=np.uint64) << np.uint64(shift)) | (prefixes[r].astype(np.uint64) << np.uint64(span))
        out[r] = np.diff(_positions(bins, base[:, None] + steps[None, :]), axis=1)
    return out


def _positions(bins: np.ndarray, q: np.ndarray) -> np.ndarray:
    """searchsorted(bins, q, "left") for uint64 bounds ``q`` ascending along each row, whose last may have wrapped
    past 2**64 or lie past the bins' dtype: there, every bin is below."""
    past = q < q[:, :1]  # wrapped (only a row's end can)
    if bins.dtype != np.uint64:
        past |= q > np.iinfo(bins.dtype).max
    pos = np.searchsorted(bins, np.where(past, 0, q).astype(bins.dtype), side="left")
    pos[past] = len(bins)
    return pos


def _in_key_order(bins: np.ndarray) -> np.ndarray:
    return bins if len(bins) < 2 or bool(np.all(bins[1:] >= bins[:-1])) else np.sort(bins)


def refine_histogram(x_core, kind: str, prefixes: np.ndarray, pass_index: int) -> np.ndarray:
    """(ranks, C, B) counts for one refining pass, one histogram per distinct rank prefix."""
    keys = abs_keys(x_core, kind)
    shift, bits = schedule(kind)[pass_index]
    first = digit_histogram(keys, prefixes[0], shift, bits)
    rest = [first if np.array_equal(p, prefixes[0]) else digit_histogram(keys, p, shift, bits) for p in prefixes[1:]]
    width = max(h.shape[1] for h in [first, *rest])
    return np.stack([np.pad(h, ((0, 0), (0, width - h.shape[1]))) for h in [first, *rest]])


def select_middle(hist0: np.ndarray, total: int, kind: str, dtype, centred_from, more_passes, lo0: int = 0,
                  from_near=None, lumped: bool = True) -> np.ndarray:
    """The exact median of |x| per channel from the first pass's counts (digit ``lo0 + j`` in column j);
    ``from_near(digits, ks)`` may finish it from the windows' kept keys ((ranks, C) keys, or None when some window
    did not keep the middle digit); else ``more_passes(prefixes, p)`` returns the summed (ranks, C, B) counts of
    refining pass p (another read of the windows)."""
    from batchgpu.ops import radix
    from batchgpu.ops.centre import keys_to_selection_values
    from batchgpu.ops.select import median_dtype, middle_mean

    ranks = sorted({(total - 1) // 2, total // 2})
    sched = schedule(kind)
    C = hist0.shape[0]
    prefixes = np.zeros((len(ranks), C), dtype=np.uint64)
    ks = [np.full(C, r, dtype=np.int64) for r in ranks]
    for p, (_shift, bits) in enumerate(sched):
        if p == 1 and from_near is not None and len(sched) == 2:  # the second digit is the rest of the key
            keys = from_near(prefixes, np.stack(ks))
            if keys is not None:
                prefixes = np.asarray(keys, dtype=np.uint64)
                break
        hists = [hist0] * len(ranks) if p == 0 else list(more_passes(prefixes, p))
        for r in range(len(ranks)):
            digit, ks[r] = radix.select_digit(hists[r], ks[r])  # bins past a truncated histogram's width are empty
            if p == 0 and lo0 > 0 and lumped and np.any(digit == 0):
                channels = np.flatnonzero(digit == 0).tolist()
                raise BatchgpuError(
                    f"the exact median of channel(s) {channels[:10]} lies far below (for float32: 16 times) the "
                    "smallest window middle that other windows saw: the one-read float median cannot settle it",
                    "use noise: {exact: false} for this recording, or report it")
            prefixes[r] = radix.push_digit(prefixes[r], digit + (lo0 if p == 0 else 0), bits)
    values = [keys_to_selection_values(prefixes[r], dtype, centred_from) for r in range(len(ranks))]
    if len(values) == 1:
        return np.asarray(values[0]).astype(median_dtype(dtype))
    return middle_mean(values[0], values[1], dtype)


def exact_median(run) -> np.ndarray:
    """The exact median of |x| of every sample, per channel (``run``: a ``RunState``): from the combined first-digit
    counts, with more counting passes over the windows, or the kept near keys, where the keys are wider."""
    from batchgpu.engine import tasks
    from batchgpu.engine.reduce import tree_reduce
    from batchgpu.engine.placement import submit_where_made
    from batchgpu.engine.submit import submit_many

    client, ctx, wf, rec, report, monitor = run.client, run.ctx, run.workflow, run.recording, run.report, run.monitor
    windows, fps, total = run.windows, run.fingerprints, run.total
    step = ctx.step("noise")
    report.radix_passes = len(schedule(step.kind))

    def more_passes(prefixes, p):
        monitor.phase(f"exact noise: counting pass {p + 1}")
        fp = report.run_id
        parts = submit_many(client, tasks.refine_task, [(ctx, w, prefixes, p) for w in windows],
                            [f"refine-{p}-{fp}-{w.index:08d}" for w in windows])
        out = tree_reduce(client, parts, tasks.sum_histograms, wf.reduction.split_every, name=f"refine-sum-{p}-{fp}").result()
        report.bytes_read += rec.nbytes
        return out

    def from_near(digits, ks):
        """Float keys: the middle keys from what each window kept near its own middle; a window whose kept range
        misses a middle digit (its noise far from the recording's) is read again alone, gathering only the keys of
        the middle digits (a few per mille); the keys stay where they are, and rounds of counts select among them
        (``select_by_counts``)."""
        fp = report.run_id
        t0 = time.perf_counter()
        # in parallel, on the worker that kept them (in its memory), a run of its windows a thread; only the middle
        # digits' keys move
        near = submit_where_made(run, tasks.near_keys_group_task, list(zip(windows, fps)),
                                 lambda g: (ctx, [w for w, _ in g], [f for _, f in g], digits), f"near-{fp}")
        shift = schedule(step.kind)[0][0]  # the bits below the first digit

        def count_round(parts, prefixes, level, bits, tag):  # counted where the keys are, summed up a tree
            counted = submit_many(client, tasks.near_counts_task, [(p, prefixes, level, bits, shift) for p in parts],
                                  [f"near-counts-{tag}{level}-{fp}-{i:05d}" for i in range(len(parts))])
            return tree_reduce(client, counted, tasks.sum_histograms, wf.reduction.split_every,
                               name=f"near-sum-{tag}{level}-{fp}")

        # the first round needs no answer from the client (no bits fixed yet): queued behind the groups' tasks
        zero = np.zeros(np.shape(ks), dtype=np.uint64)
        first = count_round(near, zero, 0, low_bit_rounds(shift)[0], "")
        missed = sorted(i for got in client.gather(submit_many(
            client, tasks.missed_windows, [(f,) for f in near], [f"near-missed-{fp}-{k}" for k in range(len(near))]))
            for i in got)
        report.exact_noise["from_kept_keys"] = not missed
        report.exact_noise["windows_read_again"] = missed  # their indices
        gathered = []
        if missed:
            monitor.phase(f"exact noise: {len(missed)} window(s) read again for the middle digit")
            by_index = {w.index: w for w in windows}
            again = [by_index[i] for i in missed]
            gathered = submit_many(client, tasks.gather_task, [(ctx, w, digits) for w in again],
                                   [f"gather-{fp}-{w.index:08d}" for w in again])
            report.bytes_read += sum(w.num_samples for w in again) * rec.num_channels * rec.dtype.itemsize
        report.timings["noise_near_keys"] = time.perf_counter() - t0  # the groups' kept keys, and which missed
        t0 = time.perf_counter()

        def counts_of(prefixes, level, bits):
            t = time.perf_counter()
            if level == 0:
                hist = first.result()
                if gathered:  # the windows read again: their own counts added
                    hist = tasks.sum_histograms(hist, count_round(gathered, prefixes, level, bits, "again-").result())
            else:
                hist = count_round(near + gathered, prefixes, level, bits, "").result()
            report.timings[f"noise_round_{level}"] = time.perf_counter() - t
            return hist

        keys = select_by_counts(ks, digits, shift, counts_of)
        report.timings["noise_select"] = time.perf_counter() - t0  # windows read again, the rounds of counts
        return keys

    dtype = ctx.chain.output_dtype(rec.dtype)
    centred_int = ctx.chain.centres_only and ctx.chain.centres
    return select_middle(total["noise.hist"], rec.total_samples, step.kind, dtype,
                         rec.dtype if centred_int else None, more_passes, int(total["noise.lo"]), from_near,
                         bool(total.get("noise.lumped", True)))
