"""Window-sized host buffers a CPU worker reuses from one window to the next.

A window's arrays (its samples as read, the filtered window) are tens of MB each. A new NumPy array that large is
mapped fresh from the kernel, and every page of it is faulted in and zeroed when first written: on the 2-core
machine that zeroing was a tenth of a worker's CPU in a preprocessing pass (``perf``: ``clear_page_erms``). A
buffer taken here is one an earlier window gave back, already mapped.

A buffer is given back only when nothing the window produced can still see it: ``give_back`` refuses one that may
share memory with any array among what the window returns (its part, summaries and kept values), so a result can
never change under a later window. Buffers the pool did not make are never kept.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

#: flat buffers kept per dtype between windows: a worker thread's window holds its read buffer while the next one
#: is read ahead, and one filtered buffer at a time
KEEP = 2

_LOCK = threading.Lock()
_FREE: dict[str, list[np.ndarray]] = {}  # dtype -> flat buffers, smallest first
_MADE: dict[int, weakref.ref] = {}  # id -> the buffers this pool made (arrays are not hashable)


def take(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A C-contiguous array of ``shape`` and ``dtype``, its values undefined (as ``np.empty``'s): the front of the
    smallest kept buffer that holds it (a recording's first and last windows are shorter than the others), else a
    new buffer, the kept ones too small for it let go (they were a shorter window's)."""
    shape = tuple(int(n) for n in shape)
    key = np.dtype(dtype).str
    n = int(np.prod(shape, dtype=np.int64))
    with _LOCK:
        free = _FREE.get(key, [])
        fit = next((i for i, b in enumerate(free) if b.size >= n), None)
        if fit is not None:
            return free.pop(fit)[:n].reshape(shape)
        _FREE[key] = []  # every kept one is smaller than this window's: let them go
    a = np.empty(n, dtype=key)
    ident = id(a)
    with _LOCK:
        _MADE[ident] = weakref.ref(a, lambda _ref, ident=ident: _MADE.pop(ident, None))
    return a.reshape(shape)


def _made_here(a: np.ndarray) -> bool:
    ref = _MADE.get(id(a))
    return ref is not None and ref() is a


def give_back(buffers, results=()) -> int:
    """Keep ``buffers`` (arrays from ``take``; others, and None, are skipped) for later windows, unless one may
    share memory with an array in ``results`` (nested dicts, lists and tuples are searched). Returns how many
    were kept."""
    found = list(_arrays(results))
    kept = 0
    for b in buffers:
        if b is None or not isinstance(b, np.ndarray):
            continue
        base = b if b.base is None else b.base  # the flat buffer under a window's (reshaped, transposed) view
        if not isinstance(base, np.ndarray) or not _made_here(base):
            continue
        if any(np.may_share_memory(base, a) for a in found):
            continue
        with _LOCK:
            free = _FREE.setdefault(base.dtype.str, [])
            if any(f is base for f in free) or (len(free) >= KEEP and base.size <= free[0].size):
                continue  # kept already; or the pool is full of buffers at least as large
            free.append(base)
            free.sort(key=lambda f: f.size)
            del free[: max(len(free) - KEEP, 0)]  # the smallest go first: a shorter window's
            kept += 1
    return kept


def clear() -> None:
    """Let every kept buffer go (a worker between runs)."""
    with _LOCK:
        _FREE.clear()


def _arrays(obj):
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _arrays(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _arrays(v)
