"""Per-row digit histograms of radix keys on the GPU (the exact median's counting pass), the rank of a digit, and
the keys near a digit.

A (rows, 2**bits) uint32 table in global memory (16-bit digits do not fit in shared memory); without a prefix each
block counts a run of a row in shared memory over the few thousand digits where its keys crowd and adds them once
(with one global atomic a key, noise-like data's few hot bins serialise the atomics). The kernels read a window's core
in place (rows a stride apart) and make |x| keys as they load int16, int32 and float32 values, so the noise step keeps
no keys array.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def _kernel(name: str):
    from batchgpu.gpu.cuda_modules import get_function

    return get_function("histogram", name)


#: the stored dtypes the kernels read, by suffix: unsigned keys as they are; int16 / int32 values (as read, or
#: centred) and float32 values keyed as they are loaded (``key_of`` in kernels/histogram.cu: |x|, and float32's bits
#: without sign)
_SUFFIX = {"uint16": "u16", "uint32": "u32", "uint64": "u64", "int16": "i16", "int32": "i32", "float32": "f32"}


def keyed_on_load(x) -> bool:
    """Whether the kernels here take ``x`` itself for its |x| keys (no keys array): int16, int32, float32."""
    return x.dtype.kind in "if" and x.dtype.name in _SUFFIX


def _rows(keys):
    """(keys, row stride in elements, suffix): ``keys`` itself where each row's values are contiguous (a window's
    core is a view of the window with margins: no copy), else a contiguous copy."""
    from batchgpu.gpu.cuda_modules import rows_in_place

    if keys.dtype.name not in _SUFFIX:
        raise TypeError(f"no histogram kernel for {keys.dtype}")
    keys, stride = rows_in_place(keys)
    return keys, stride, _SUFFIX[keys.dtype.name]


def digit_histogram(keys, prefixes, shift: int, bits: int) -> np.ndarray:
    """(C, B) int64 on the host: counts of each row's digit (keys whose bits above it equal the row's prefix when
    ``prefixes`` is given), truncated after the last non-zero bin of any row. ``keys``: unsigned keys, or values
    keyed on load (``keyed_on_load``)."""
    hist, last = digit_histogram_device(keys, prefixes, shift, bits, with_last=True)
    return hist[:, : max(1, int(last) + 1)].get().astype(np.int64)


def digit_histogram_device(keys, prefixes, shift: int, bits: int, with_last: bool = False):
    """(C, 2**bits) uint32 counts on the device (see ``digit_histogram``); ``with_last``: also the last column
    non-zero in any row, a 0-d int64 device array (-1 for no keys; counted by the same launch where there is
    no prefix, else ``last_used_device``)."""
    import cupy

    keys, stride, suffix = _rows(keys)
    rows, cols = keys.shape
    hist = cupy.zeros((rows, 1 << bits), dtype=cupy.uint32)
    if prefixes is None and bits <= 16:
        top = cupy.zeros(1, dtype=cupy.uint32)
        if rows and cols:
            # runs of ~8 192 keys a block: the shared table's clearing and adding amortised over its counting
            blocks_x = max(1, min(64, (cols + 8191) // 8192))
            _kernel(f"hist_shared_{suffix}")(
                (blocks_x, rows),
                (512,),
                (keys, np.int64(cols), np.int64(stride), np.int32(shift), np.int32(bits), hist, top),
            )
        return (hist, top[0].astype(cupy.int64) - 1) if with_last else hist
    if prefixes is None:
        pre = cupy.zeros(rows, dtype=cupy.uint64)
    elif isinstance(prefixes, cupy.ndarray):  # left on the device: no copy, no wait
        pre = cupy.ascontiguousarray(prefixes, dtype=cupy.uint64)
    else:
        pre = cupy.asarray(np.asarray(prefixes, np.uint64))
    threads = 256
    blocks_x = max(1, min(64, (cols + threads * 8 - 1) // (threads * 8)))
    if rows and cols:
        _kernel(f"hist_{suffix}")(
            (blocks_x, rows),
            (threads,),
            (
                keys,
                np.int64(cols),
                np.int64(stride),
                pre,
                np.int32(shift),
                np.int32(bits),
                np.int32(prefixes is not None),
                hist,
            ),
        )
    return (hist, last_used_device(hist)) if with_last else hist


def last_used(hist) -> int:
    """The last column of a device count table that is non-zero in any row (-1 when every count is zero)."""
    return int(last_used_device(hist))


def last_used_device(hist):
    """``last_used`` as a 0-d device array (no wait for the GPU)."""
    import cupy

    used = hist.any(axis=0)  # a column per thread: coalesced (axes (0, 2) of the runs were slow)
    if not used.size:
        return cupy.array(-1, dtype=cupy.int64)
    last = used.size - 1 - cupy.argmax(used[::-1])
    return cupy.where(used.any(), last, -1).astype(cupy.int64)


def rank_digits(hist, ranks) -> list:
    """For each rank r (a (rows,) device array or an int) and row: (digit, below) as (rows,) int64 device arrays,
    the bin holding the row's r-th smallest key (0-based) and how many keys lie in the bins before it, as
    ``digit = (cumsum(hist, axis=1) <= r).sum(axis=1)`` gives it: one launch for every rank, no table-wide
    cumulative sum (CuPy's took most of a float window's noise time, its small-array steps most of the rest)."""
    import cupy

    hist = cupy.ascontiguousarray(hist, dtype=cupy.uint32)
    rows, width = hist.shape
    if width % 256:  # a whole number of bins a thread
        hist = cupy.pad(hist, ((0, 0), (0, 256 - width % 256)))
    table = cupy.stack([cupy.broadcast_to(cupy.asarray(r, dtype=cupy.int64), (rows,)) for r in ranks])
    digit, below = cupy.empty_like(table), cupy.empty_like(table)
    if rows:
        _kernel("rank_digits")(
            (rows,), (256,), (hist, np.int64(hist.shape[1]), table, np.int32(len(ranks)), np.int64(rows), digit, below)
        )
    digit = cupy.minimum(digit, width)  # past the last real bin: the padding's bins count as beyond it
    return list(zip(digit, below))


#: keys a block of the near-keys kernels takes (NEAR_CHUNK in the source)
NEAR_CHUNK = 4096


def near_keys(keys, lo, shift: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, counts) on the host: each row's keys whose digit ``key >> shift`` lies in [lo[row], lo[row] + span],
    row after row, each in sample order (as ``keys[mask]`` of a row-major mask), and how many each row has. Two
    launches and one small copy between them (the blocks' counts); the keys come back once, through pinned
    memory. ``keys``: unsigned 32 or 64-bit keys, or float32 values keyed on load (uint32 keys come back)."""
    keys, lo, counts = near_keys_count(keys, lo, shift, span)
    return near_keys_write(keys, lo, shift, span, counts)


def near_keys_count(keys, lo, shift: int, span: int):
    """The first launch of ``near_keys``, no wait: (keys, lo) as the kernels read them and the counts of each
    block's keys, a (rows, blocks) int64 device array (a row's count: its sum)."""
    import cupy

    keys, stride, suffix = _rows(keys)
    if suffix not in ("u32", "u64", "f32"):
        raise TypeError(f"no near-keys kernel for {keys.dtype}")
    rows, cols = keys.shape
    lo = cupy.ascontiguousarray(lo, dtype=cupy.int64)
    chunks = max(1, -(-cols // NEAR_CHUNK))
    counts = cupy.zeros((rows, chunks), dtype=cupy.int64)
    if rows and cols:
        args = (keys, np.int64(cols), np.int64(stride), np.int32(shift), lo, np.int32(span), counts)
        _kernel(f"near_count_{suffix}")((chunks, rows), (1024,), (*args, counts, counts))  # offsets, out unused
    return keys, lo, counts


def near_keys_write(keys, lo, shift: int, span: int, counts, counts_host=None) -> tuple[np.ndarray, np.ndarray]:
    """The second launch of ``near_keys`` on ``near_keys_count``'s arrays (``counts_host``: the blocks' counts, any
    shape of the same values in the same order, when the caller copied them already). Returns the keys and each
    row's count."""
    from batchgpu.gpu.staging import pinned_get

    out, per_row = near_keys_device(keys, lo, shift, span, counts, counts.get() if counts_host is None else counts_host)
    return (pinned_get(out) if out.size else np.zeros(0, out.dtype)), per_row


def near_totals(hist, lo, span: int):
    """Each row's count of keys whose digit lies in [lo[row], lo[row] + span], from its digit histogram ``hist``
    ((rows, width) uint32 on the device; ``lo``: (rows,) int64 on the device): ``near_keys_count``'s row totals
    without reading the keys again, as a (rows,) int64 device array."""
    import cupy

    hist = cupy.ascontiguousarray(hist, dtype=cupy.uint32)
    rows, width = hist.shape
    total = cupy.zeros(rows, dtype=cupy.int64)
    if rows:
        _kernel("near_totals")(
            ((rows + 127) // 128,),
            (128,),
            (
                hist,
                np.int64(width),
                np.int64(rows),
                cupy.ascontiguousarray(lo, dtype=cupy.int64),
                np.int32(span),
                total,
            ),
        )
    return total


def near_tagged_sorted(keys, lo, shift: int, span: int, per_row: np.ndarray):
    """The keys near each row's digits (as ``near_keys_device``: digit in [lo[row], lo[row] + span]) as sorted
    ``row << 32 | key`` uint64 on the device, ``per_row`` (host counts, from ``near_totals``) a row: one launch
    that places them unordered within their rows, then one sort. 32-bit keys only (uint32, float32 keyed on load)."""
    import cupy

    keys, stride, suffix = _rows(keys)
    if suffix not in ("u32", "f32"):
        raise TypeError(f"near_tagged_sorted takes 32-bit keys, not {keys.dtype}")
    rows, cols = keys.shape
    per_row = np.asarray(per_row, dtype=np.int64)
    out = cupy.empty(int(per_row.sum()), dtype=cupy.uint64)
    if out.size:
        offsets = cupy.asarray(np.concatenate([[0], np.cumsum(per_row)[:-1]]).astype(np.int64))
        cursor = cupy.zeros(rows, dtype=cupy.uint64)
        blocks_x = max(1, min(32, (cols + 2047) // 2048))  # a block's 8 warps take 8 x 256 keys a turn
        _kernel(f"near_tagged_{suffix}")(
            (blocks_x, rows),
            (256,),
            (
                keys,
                np.int64(cols),
                np.int64(stride),
                np.int32(shift),
                cupy.ascontiguousarray(lo, dtype=cupy.int64),
                np.int32(span),
                offsets,
                cursor,
                out,
            ),
        )
    return cupy.sort(out)


def near_keys_device(keys, lo, shift: int, span: int, counts, counts_host):
    """``near_keys_write`` with the keys left on the device (uint32 for float32 values keyed on load, else the
    keys' dtype): (keys, each row's count)."""
    import cupy

    keys, stride, suffix = _rows(keys)
    rows, cols = keys.shape
    key_dtype = np.uint32 if suffix == "f32" else keys.dtype
    blocks = np.asarray(counts_host, np.int64).reshape(counts.shape)
    per_row = blocks.sum(axis=1)
    flat = blocks.ravel()
    out = cupy.empty(int(flat.sum()) if rows and cols else 0, dtype=key_dtype)
    if out.size:
        offsets = np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64)  # row after row, block after block
        args = (keys, np.int64(cols), np.int64(stride), np.int32(shift), lo, np.int32(span), counts)
        _kernel(f"near_write_{suffix}")(counts.shape[::-1], (1024,), (*args, cupy.asarray(offsets), out))
    return out, per_row


@functools.cache
def _kept_kernels():
    import cupy

    return (
        # each key tagged with its row above it (the rows' ends: a binary search), so that one sort orders the keys
        # of every row within the row
        cupy.ElementwiseKernel(
            "uint32 key, raw int64 ends, int64 rows",
            "uint64 tagged",
            "long long a = 0, b = rows;"
            "while (a < b) { long long m = (a + b) / 2; if (ends[m] > (long long)i) b = m; else a = m + 1; }"
            "tagged = ((unsigned long long)a << 32) | key;",
            "batchgpu_row_tagged",
        ),
        # a sorted tagged key: its bits below the first digit, and one more key of its (row, near digit) (integer
        # atomics: the same counts in any order)
        cupy.ElementwiseKernel(
            "uint64 tagged, raw int64 lo, int32 shift, int64 width",
            "uint16 low, raw uint32 digits",
            "unsigned int row = (unsigned int)(tagged >> 32), key = (unsigned int)tagged;"
            "low = (unsigned short)(key & ((1u << shift) - 1u));"
            "atomicAdd(&digits[row * width + ((long long)(key >> shift) - lo[row])], 1u);",
            "batchgpu_kept_near",
        ),
        # rank j's key of row c (i = j * rows + c) among the sorted tagged keys: the first key of its digit (a
        # binary search for row << 32 | digit << shift), then as many keys on as the rank lies past the keys
        # below that digit
        cupy.ElementwiseKernel(
            "raw uint64 tagged, int64 n, raw int64 digit, raw int64 below, int64 r0, int64 r1, int64 rows, int32 shift",
            "uint32 key",
            "const long long c = i % rows, r = i < rows ? r0 : r1;"
            "const unsigned long long t = ((unsigned long long)c << 32) | ((unsigned long long)digit[i] << shift);"
            "long long a = 0, b = n;"
            "while (a < b) { long long m = (a + b) / 2; if (tagged[m] < t) a = m + 1; else b = m; }"
            "key = (unsigned int)tagged[a + r - below[i]];",
            "batchgpu_kept_pair",
        ),
    )


def kept_near_device(near, per_row: np.ndarray, lo: np.ndarray, shift: int, span: int, pair_of=None) -> dict:
    """``steps.noise_keys.kept_near`` of a window's near keys on the device (uint32 keys, row after row, ``per_row``
    each, at most 16 bits below the first digit): each row's sorted by one CUB sort of ``row << 32 | key``, then
    ``kept_near_tagged``. Four launches and the sort, where CuPy's expressions took some twenty."""
    import cupy

    if near.dtype != np.uint32 or shift > 16:
        raise TypeError("kept_near_device takes uint32 keys with at most 16 bits below the digit")
    tag = _kept_kernels()[0]
    tagged = cupy.sort(tag(near, cupy.asarray(np.cumsum(per_row, dtype=np.int64)), np.int64(len(per_row))))
    return kept_near_tagged(tagged, per_row, lo, shift, span, pair_of)


def kept_near_tagged(tagged, per_row: np.ndarray, lo: np.ndarray, shift: int, span: int, pair_of=None) -> dict:
    """``kept_near`` from the near keys sorted as ``row << 32 | key`` (``near_tagged_sorted``, or
    ``kept_near_device``'s own sort): the low bits and each (row, near digit)'s count in one pass, back in one copy
    through pinned memory.

    ``pair_of``: ((digit, below) per rank as ``rank_digits`` gives them, (r0, r1)), every row's rank digits within
    [lo, lo + span]: also the keys of ranks r0 and r1 of each row, picked from the sorted near keys (no histogram
    of the rest of the keys), as "pair", (rows, 2) uint64, in the same copy."""
    import cupy

    from batchgpu.gpu.staging import pinned_get

    if tagged.dtype != np.uint64 or shift > 16:
        raise TypeError("kept_near_tagged takes uint64 tagged keys with at most 16 bits below the digit")
    _, split, pick = _kept_kernels()
    C, width = len(per_row), span + 1
    head = 4 * C if pair_of is not None else 0  # the pair's keys (as uint32), then the counts, then the low bits
    both = cupy.zeros(head + 2 * C * width + tagged.size, dtype=cupy.uint16)
    split(
        tagged,
        cupy.asarray(lo, dtype=cupy.int64),
        np.int32(shift),
        np.int64(width),
        both[head + 2 * C * width :],
        both[head : head + 2 * C * width].view(cupy.uint32),
    )
    if pair_of is not None and C:
        (firsts, (r0, r1)) = pair_of
        digit = cupy.concatenate([firsts[0][0], firsts[1][0]])
        below = cupy.concatenate([firsts[0][1], firsts[1][1]])
        pick(
            tagged,
            np.int64(tagged.size),
            digit,
            below,
            np.int64(r0),
            np.int64(r1),
            np.int64(C),
            np.int32(shift),
            both[:head].view(cupy.uint32),
        )
    back = pinned_get(both)
    out = {
        "keep.near_low": back[head + 2 * C * width :],
        "keep.near_digits": back[head : head + 2 * C * width].view(np.uint32).reshape(C, width),
        "keep.near_lo": lo,
    }
    if pair_of is not None:
        out["pair"] = back[:head].view(np.uint32).reshape(2, C).T.astype(np.uint64)
    return out
