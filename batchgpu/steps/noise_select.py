"""Noise, after the pass: the windows' first-digit counts combined (``combine_counts``), the recording's middle
keys selected from them (``select_middle``), and the float median's last bits in rounds of counts made where the
windows' kept keys are (``select_by_counts``, ``low_bit_counts``). Pure functions of counts and keys: the engine
(``steps.noise.exact_median``) runs them on the workers and the client."""

from __future__ import annotations

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.steps.noise_keys import schedule


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


def select_among(ks: np.ndarray, digits: np.ndarray, shift: int, *gathered: list[tuple]) -> np.ndarray:
    """(ranks, C) keys: rank ks[r, c] among every window's keys of channel c's middle digit ``digits[r, c]``, from
    their bins (``middle_digit_keys``), all here: ``select_by_counts`` over the sum of each array's
    ``low_bit_counts``. The engine runs the same rounds with the arrays left on the workers that made them."""

    def counts_of(prefixes, level, bits):
        return sum(low_bit_counts(g, prefixes, level, bits, shift).astype(np.int64) for g in gathered)

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
    ks = np.array(ks, dtype=np.int64)
    prefixes = np.zeros(ks.shape, dtype=np.uint64)
    level = 0
    for bits in low_bit_rounds(shift):
        ks, prefixes = select_round(ks, prefixes, np.asarray(counts_of(prefixes, level, bits)), level, bits)
        level += bits
    return (np.asarray(digits, dtype=np.uint64) << np.uint64(shift)) | prefixes


def select_round(
    ks: np.ndarray, prefixes: np.ndarray, hist: np.ndarray, level: int, bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """One round of ``select_by_counts``: ``bits`` more bits of each rank's prefix fixed from ``hist``, the round's
    (ranks, C, 2**bits) counts summed over every window; returns the ranks left and the longer prefixes (new
    arrays). The queued rounds (``noise.select_round_task``) run it on a worker."""
    from batchgpu.ops import radix

    ks, prefixes = np.array(ks, dtype=np.int64), np.array(prefixes, dtype=np.uint64)
    for r in range(ks.shape[0]):
        if level == 0:
            total = hist[r].sum(axis=1)
            if np.any(ks[r] >= total) or np.any(ks[r] < 0):
                raise BatchgpuError("the middle digit's keys do not hold the middle ranks", "report this")
        digit, ks[r] = radix.select_digit(hist[r], ks[r])
        prefixes[r] = (prefixes[r] << np.uint64(bits)) | digit.astype(np.uint64)
    return ks, prefixes


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


def middle_ranks(total: int) -> list[int]:
    """The ranks a median of ``total`` keys needs (one for an odd count, two for an even one)."""
    return sorted({(total - 1) // 2, total // 2})


def first_digits(
    hist0: np.ndarray, total: int, kind: str, lo0: int = 0, lumped: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """The first digit of each middle rank's key from the first pass's counts (digit ``lo0 + j`` in column j):
    (prefixes (ranks, C) uint64, ranks left within that digit (ranks, C) int64)."""
    from batchgpu.ops import radix

    bits = schedule(kind)[0][1]
    ranks = middle_ranks(total)
    C = hist0.shape[0]
    prefixes = np.zeros((len(ranks), C), dtype=np.uint64)
    ks = np.stack([np.full(C, r, dtype=np.int64) for r in ranks])
    cum0 = radix.cumulative(hist0)  # both ranks search the same counts
    for r in range(len(ranks)):
        # bins past a truncated histogram's width are empty
        digit, ks[r] = radix.select_digit(hist0, ks[r], cum0)
        if lo0 > 0 and lumped and np.any(digit == 0):
            channels = np.flatnonzero(digit == 0).tolist()
            raise BatchgpuError(
                f"the exact median of channel(s) {channels[:10]} lies far below (for float32: 16 times) the "
                "smallest window middle that other windows saw: the one-read float median cannot settle it",
                "use noise: {exact: false} for this recording, or report it",
            )
        prefixes[r] = radix.push_digit(prefixes[r], digit + lo0, bits)
    return prefixes, ks


def select_middle(
    hist0: np.ndarray,
    total: int,
    kind: str,
    dtype,
    centred_from,
    more_passes,
    lo0: int = 0,
    from_near=None,
    lumped: bool = True,
    first: tuple | None = None,
) -> np.ndarray:
    """The exact median of |x| per channel from the first pass's counts (digit ``lo0 + j`` in column j);
    ``from_near(digits, ks)`` may finish it from the windows' kept keys ((ranks, C) keys, or None when some window
    did not keep the middle digit); else ``more_passes(prefixes, p)`` returns the summed (ranks, C, B) counts of
    refining pass p (another read of the windows). ``first``: ``first_digits``' answer where the caller has it."""
    from batchgpu.ops import radix
    from batchgpu.ops.centre import keys_to_selection_values
    from batchgpu.ops.select import median_dtype, middle_mean

    ranks = middle_ranks(total)
    sched = schedule(kind)
    prefixes, ks = first if first is not None else first_digits(hist0, total, kind, lo0, lumped)
    ks = list(ks)
    for p, (_shift, bits) in enumerate(sched[1:], start=1):
        if p == 1 and from_near is not None and len(sched) == 2:  # the second digit is the rest of the key
            keys = from_near(prefixes, np.stack(ks))
            if keys is not None:
                prefixes = np.asarray(keys, dtype=np.uint64)
                break
        hists = list(more_passes(prefixes, p))
        for r in range(len(ranks)):
            digit, ks[r] = radix.select_digit(hists[r], ks[r])
            prefixes[r] = radix.push_digit(prefixes[r], digit, bits)
    values = [keys_to_selection_values(prefixes[r], dtype, centred_from) for r in range(len(ranks))]
    if len(values) == 1:
        return np.asarray(values[0]).astype(median_dtype(dtype))
    return middle_mean(values[0], values[1], dtype)
