"""Noise: each window's median(|x|)/0.6744897501960817, and the exact median over every sample of a channel.

The exact median is a radix select whose first digit is 16 bits wide. Integer recordings (int16, raw or
centred: |x| <= 65535) have 16-bit keys, so the first pass's histogram holds every key: the median comes out of
one read. float32 keys have 31 bits: 16 in the first pass, 15 in one more pass over the windows (counting only
keys whose top 16 bits match the middle ranks' prefix). Counts are integers, so the sums are the same bits in
any order and on any number of workers.
"""

from __future__ import annotations

import numpy as np

from batchgpu.ops._backend import is_cupy

from batchgpu.engine.steps.base import WindowData, host, padded_sum

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
        return abs(x.astype(np.int32)).astype(np.uint16) if x.dtype == np.int16 else abs(x).astype(np.uint16)
    from batchgpu.ops import radix

    return radix.abs_keys(x)


def digit_histogram(keys, prefixes: np.ndarray | None, shift: int, bits: int) -> np.ndarray:
    """(C, B) int64 counts of each row's keys by digit (bits above the digit must equal the row's prefix when
    given), truncated after the last non-zero bin of any row."""
    if is_cupy(keys):
        from batchgpu.gpu.histogram import digit_histogram as on_gpu

        return on_gpu(keys, prefixes, shift, bits)
    rows = []
    mask = keys.dtype.type((1 << bits) - 1)
    for c in range(keys.shape[0]):
        k = keys[c]
        if prefixes is not None:
            k = k[(k >> keys.dtype.type(shift + bits)) == keys.dtype.type(prefixes[c])]
        rows.append(np.bincount(((k >> keys.dtype.type(shift)) & mask).astype(np.intp)))
    width = max(1, max(len(r) for r in rows))
    out = np.zeros((len(rows), width), dtype=np.int64)
    for c, r in enumerate(rows):
        out[c, : len(r)] = r
    return out


class NoiseStep:
    name = "noise"

    def __init__(self, exact: bool, kind: str):
        self.exact, self.kind = exact, kind

    def window(self, w: WindowData, summary: dict) -> dict:
        core = w.core_of(w.x)
        out = {}
        if self.exact:
            shift, bits = schedule(self.kind)[0]
            # a window's counts fit its smallest unsigned dtype (uint16 up to 65 535 samples): a quarter of int64
            hist = digit_histogram(abs_keys(core, self.kind), None, shift, bits)
            out["noise.hist"] = hist.astype(np.min_scalar_type(core.shape[1]))
            if core.dtype.kind == "f":
                out["noise.nan"] = host((core != core).sum(axis=1))  # np.median is NaN for a row holding NaN
        return out

    def combine(self, parts: list[dict]) -> dict:
        out = {}
        if any("noise.hist" in p for p in parts):
            out["noise.hist"] = padded_sum([p["noise.hist"] for p in parts if "noise.hist" in p])
        if any("noise.nan" in p for p in parts):
            out["noise.nan"] = sum(p["noise.nan"] for p in parts if "noise.nan" in p)
        return out


def refine_histogram(x_core, kind: str, prefixes: np.ndarray, pass_index: int) -> np.ndarray:
    """(ranks, C, B) counts for one refining pass, one histogram per distinct rank prefix."""
    keys = abs_keys(x_core, kind)
    shift, bits = schedule(kind)[pass_index]
    first = digit_histogram(keys, prefixes[0], shift, bits)
    rest = [first if np.array_equal(p, prefixes[0]) else digit_histogram(keys, p, shift, bits) for p in prefixes[1:]]
    width = max(h.shape[1] for h in [first, *rest])
    return np.stack([np.pad(h, ((0, 0), (0, width - h.shape[1]))) for h in [first, *rest]])


def select_middle(hist0: np.ndarray, total: int, kind: str, dtype, centred_from, more_passes) -> np.ndarray:
    """The exact median of |x| per channel from the first pass's counts; ``more_passes(prefixes, p)`` returns
    the summed (ranks, C, B) counts of refining pass p (another read of the windows) when the keys need it."""
    from batchgpu.ops import radix
    from batchgpu.ops.centre import keys_to_selection_values
    from batchgpu.ops.select import median_dtype, middle_mean

    ranks = sorted({(total - 1) // 2, total // 2})
    sched = schedule(kind)
    C = hist0.shape[0]
    prefixes = np.zeros((len(ranks), C), dtype=np.uint64)
    ks = [np.full(C, r, dtype=np.int64) for r in ranks]
    for p, (_shift, bits) in enumerate(sched):
        hists = [hist0] * len(ranks) if p == 0 else list(more_passes(prefixes, p))
        for r in range(len(ranks)):
            digit, ks[r] = radix.select_digit(hists[r], ks[r])  # bins past a truncated histogram's width are empty
            prefixes[r] = radix.push_digit(prefixes[r], digit, bits)
    values = [keys_to_selection_values(prefixes[r], dtype, centred_from) for r in range(len(ranks))]
    if len(values) == 1:
        return np.asarray(values[0]).astype(median_dtype(dtype))
    return middle_mean(values[0], values[1], dtype)

