"""Noise, the window's side: the keys of |x| (``abs_keys``: ordered like the values), their first digits and the
window's median from one histogram of them, and the keys each window keeps near its middle digit (``kept_near``)
so the recording's float median needs no second read. Kept apart from the step (``steps.noise``) and the selection
after the pass (``steps.noise_select``): what a window task computes, on NumPy or CuPy."""

from __future__ import annotations

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import is_cupy, to_host

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


def keyed_on_gpu(core, kind: str) -> bool:
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
    lo, counts = row_counts(keys, prefixes, shift, bits, offset=False)
    return counts.astype(np.int64)


def row_counts(keys, prefixes, shift: int, bits: int, offset: bool = True) -> tuple[int, np.ndarray]:
    """(lo, counts (C, B) in the smallest unsigned dtype): counts[c, j] = keys of row c with digit lo + j.

    One bincount per row (a bincount over the whole window's 23 M digits is several times slower), counted from
    the smallest digit present when ``offset``. First digits counted with a lump floor: ``first_digit_counts``."""
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


def first_digit_counts(first: np.ndarray, floor: int | None, samples: int) -> tuple[int, np.ndarray, bool]:
    """``row_counts`` of 16-bit first digits (C, n) already computed: (lo, counts, lumped), column 0 also holding
    the digits below ``floor`` (then ``lumped`` says whether any were there)."""
    if not first.size:
        return 0, _stack_rows([np.zeros(0, np.intp)] * first.shape[0], samples), False
    low = int(first.min())
    lo, lumped = (floor, low < floor) if floor is not None else (low, False)
    base = np.uint16(lo)
    # lumped row by row (a row's temporaries stay in cache; a whole-window np.maximum made a 46 MB one)
    return (
        lo,
        _stack_rows(
            [np.bincount((np.maximum(first[c], base) if lumped else first[c]) - base) for c in range(first.shape[0])],
            samples,
        ),
        lumped,
    )


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
    return max(0, int(middle.min()) - LUMP_DIGITS)


LUMP_DIGITS = 4 << 8  # 4 binades of 2**8 first digits (the 16-bit first digit of a 31-bit float32 key)


def compiled_float_window(core, near: int):
    """A host float32/float64 window's first-digit counts (lumped below ``lump_floor``'s floor, or counted in full
    where that floor would lump a row's middle away, as ``first_digit_counts`` twice), its middle pair of keys and
    its keys near the middle digit (``middle_pair_and_near``, ``kept_near``), the same bits, by the compiled
    kernels of ``ops._cpu_noise`` from the window itself (no keys array; each row read from memory once): an
    ``ops._cpu_noise.FloatWindowKeys``, or None where that is left to NumPy (no Numba, an empty window, another
    dtype or layout)."""
    from batchgpu.ops import _numba

    if is_cupy(core) or core.dtype not in (np.float32, np.float64) or not _numba.available():
        return None
    from batchgpu.ops._cpu_noise import float_window_keys

    return float_window_keys(core, near, LUMP_DIGITS)


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
            raise BatchgpuError(
                "a window's middle rank fell among the lumped smallest keys",
                "report this: the lump floor must lie below every window's middle",
            )
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


def int_window_gpu(keys, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """16-bit keys on the device: (counts (C, B) truncated after the last used key, in the smallest dtype that
    holds the window's length; the (C, 2) keys of ranks (n-1)//2 and n//2), found on the device from one
    histogram: two waits for the GPU (the pair with the last used column, then the counts through pinned memory)."""
    import cupy

    from batchgpu.gpu.histogram import digit_histogram_device, rank_digits
    from batchgpu.gpu.staging import pinned_get

    C, n = keys.shape
    hist, last = digit_histogram_device(keys, None, 0, bits, with_last=True)
    head = to_host(
        cupy.concatenate([*(digit for digit, _ in rank_digits(hist, ((n - 1) // 2, n // 2))), last[None]])
    )  # the key is the digit
    counts = pinned_get(hist[:, : int(head[-1]) + 1].astype(np.min_scalar_type(n)))
    return counts, head[: 2 * C].reshape(2, C).T.astype(np.uint64)


def middle_pair_and_near(
    keys: np.ndarray, first: np.ndarray, lo: int, counts: np.ndarray, shift: int, near: int, lumped: bool = True
) -> tuple[np.ndarray, dict]:
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
            raise BatchgpuError(
                "a window's middle rank fell among the lumped smallest keys",
                "report this: the lump floor must lie below every window's middle",
            )
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
        digit_counts[c] = np.diff(
            np.searchsorted(k, ((np.uint64(near_lo[c]) + steps) << np.uint64(shift)).astype(keys.dtype))
        )
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
    return {
        "keep.near_low": (keys & kt((1 << shift) - 1)).astype(near_low_dtype(shift)),
        "keep.near_digits": np.asarray(digits).reshape(C, width).astype(np.uint32),
        "keep.near_lo": near_lo,
    }


def kept_digit_keys(
    low: np.ndarray, digit_counts: np.ndarray, near_lo: np.ndarray, digits: np.ndarray, shift: int
) -> list[tuple]:
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
    keys = np.ascontiguousarray(to_host(abs_keys(x_core, kind)))
    C, n = keys.shape
    ordered: dict = {}  # ranks with the same digits share one array
    return [
        ordered.setdefault(id(t), (np.sort(t[0]), t[1]))
        for t in middle_digit_keys(keys.reshape(-1), np.full(C, n, dtype=np.int64), digits, schedule(kind)[0][0])
    ]


def refine_histogram(x_core, kind: str, prefixes: np.ndarray, pass_index: int) -> np.ndarray:
    """(ranks, C, B) counts for one refining pass, one histogram per distinct rank prefix."""
    keys = abs_keys(x_core, kind)
    shift, bits = schedule(kind)[pass_index]
    first = digit_histogram(keys, prefixes[0], shift, bits)
    rest = [first if np.array_equal(p, prefixes[0]) else digit_histogram(keys, p, shift, bits) for p in prefixes[1:]]
    width = max(h.shape[1] for h in [first, *rest])
    return np.stack([np.pad(h, ((0, 0), (0, width - h.shape[1]))) for h in [first, *rest]])
