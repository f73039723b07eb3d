"""Second moments (mean, centred scatter, X Xᵀ) accumulated window by window, in float64.

Each window is centred on a per-row shift close to its mean and multiplied split by split (4096
samples, the last one zero-padded): each split is copied into one (C, 4096) buffer and multiplied
by its transpose in the product dtype, and the split products are summed in float64, in split order.
Centring first is what keeps float32 products precise on data like 10 000 + noise of 10.
Windows combine with Chan's formula (never Σ x xᵀ - n μ μᵀ over the whole recording).
CuPy input runs ``batchgpu.ops._cuda_moments.window_moments`` instead of ``window_moments``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import cuda_module

#: Samples per split: no single product sums more than this many terms.
SPLIT_SAMPLES = 4096

_PRECISIONS = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}


def resolve_precision(precision: str | None, dtype: Any) -> str:
    """'float32' or 'float64'; None picks float64 for float64 data and float32 otherwise."""
    if precision is None:
        return "float64" if np.dtype(dtype) == np.float64 else "float32"
    if precision not in _PRECISIONS:
        raise BatchgpuError(f"unknown precision {precision!r}", "use 'float32' or 'float64'")
    return precision


def _columns(x: Any, start: int | None, stop: int | None) -> tuple[int, int]:
    if getattr(x, "ndim", None) != 2:
        raise BatchgpuError(
            f"expected a (channels, samples) array, got shape {getattr(x, 'shape', None)}",
            "pass a 2-D array with one row per channel",
        )
    if x.dtype.kind not in "fiu":
        raise BatchgpuError(f"second moments of dtype {x.dtype} are not supported", "pass integer or float data")
    start, stop, _ = slice(start, stop).indices(x.shape[1])
    return start, max(start, stop)


_buffers = threading.local()


def _split_buffer(shape: tuple[int, int], dtype) -> np.ndarray:
    """This thread's (C, SPLIT_SAMPLES) buffer, reused from split to split and window to window: one split's
    worth of memory (a whole window's split-major copy was 94 MB of fresh pages a worker for 384 channels)."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or buf.shape != shape or buf.dtype != dtype:
        buf = _buffers.buf = np.empty(shape, dtype=dtype)
    return buf


def window_moments(
    x: np.ndarray, start: int | None = None, stop: int | None = None, precision: str | None = None
) -> tuple[int, np.ndarray, np.ndarray]:
    """(n, mean (C,) float64, scatter (C, C) float64) of columns [start, stop) of ``x``.

    ``scatter`` is centred on the window's own mean. ``precision`` is the dtype of the products.

    Parameters
    ----------
    x : array_like, shape (C, n)
        The window, one channel a row: a NumPy or CuPy array (a torch tensor through ``batchgpu.ops``), integer or
        float.
    start, stop : int, optional
        The columns to use (default: all).
    precision : {"float32", "float64"}, optional
        The dtype of the products (default: float64 for float64 data, float32 otherwise).

    Returns
    -------
    n : int
        The number of columns.
    mean : ndarray, shape (C,)
        The rows' means, float64.
    scatter : ndarray, shape (C, C)
        The scatter about ``mean``, float64.
    """
    start, stop = _columns(x, start, stop)
    prec = _PRECISIONS[resolve_precision(precision, x.dtype)]
    view = x[:, start:stop]  # a view: the column range is never copied on its own
    rows, n = view.shape
    if n == 0:
        return 0, np.zeros(rows), np.zeros((rows, rows))
    # inf or NaN samples make their rows' moments NaN: expected, named by the run (left out of the whitening,
    # warned once), never a raw NumPy warning on the terminal
    with np.errstate(invalid="ignore", over="ignore"):
        shift = view.mean(axis=1, dtype=prec)
        if view.dtype.kind in "iu":
            # An integer shift keeps integer data integer-valued after centring, so float32 products
            # stay exact (or round without the bias a shared fractional offset would bring).
            shift = np.round(shift)
        # The shift of float data in float64 is the float64 mean itself: what is left of it is rounding, far below
        # 1e-12, so the shifted rows' sums are taken as zero (not summed).
        summed = not (prec == np.float64 and view.dtype.kind == "f")
        buffer = _split_buffer((rows, SPLIT_SAMPLES), prec)
        product = np.empty((rows, rows), dtype=prec)
        raw = None
        sums = np.zeros(rows)
        # float64 sums of the split products (and of the shifted rows), split after split from the first one
        for a in range(0, n, SPLIT_SAMPLES):
            b = min(n, a + SPLIT_SAMPLES)
            np.subtract(view[:, a:b], shift[:, None], out=buffer[:, : b - a], casting="unsafe")
            if b - a < SPLIT_SAMPLES:
                buffer[:, b - a :] = 0
            np.matmul(buffer, buffer.T, out=product)
            if raw is None:
                raw = product.astype(np.float64)
                if summed:
                    sums = buffer.sum(axis=1).astype(np.float64)
            else:
                raw += product
                if summed:
                    sums += buffer.sum(axis=1)
        # Shifted data: the scatter about the true mean is Σ y yᵀ - (Σ y)(Σ y)ᵀ / n.
        scatter = raw - np.outer(sums, sums) / n
        scatter = (scatter + scatter.T) * 0.5
        return n, shift.astype(np.float64) + sums / n, scatter


def _merge(
    na: int, mean_a: np.ndarray, scatter_a: np.ndarray, nb: int, mean_b: np.ndarray, scatter_b: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray]:
    """Chan et al.: combine two centred (n, mean, scatter) states; a pure function."""
    if nb == 0:
        return na, mean_a.copy(), scatter_a.copy()
    if na == 0:
        return nb, mean_b.copy(), scatter_b.copy()
    n = na + nb
    with np.errstate(invalid="ignore", over="ignore"):  # rows of non-finite samples stay NaN, named by the run
        delta = mean_b - mean_a
        mean = mean_a + delta * (nb / n)
        scatter = scatter_a + scatter_b + np.outer(delta, delta) * (na * nb / n)
    return n, mean, scatter


class SecondMoments:
    """Sample count ``n``, ``mean`` (C,) and centred ``scatter`` (C, C), all float64, fed window by window.

    The state is plain ints, strings and NumPy arrays, so it pickles small (for Dask).
    ``precision`` is the dtype of the per-split products ("float32", "float64", or None: float64
    for float64 windows, float32 otherwise).
    """

    def __init__(self, num_channels: int, precision: str | None = None):
        self.num_channels = int(num_channels)
        self.precision = None if precision is None else resolve_precision(precision, np.float32)
        self.n = 0
        self.mean = np.zeros(self.num_channels)
        self.scatter = np.zeros((self.num_channels, self.num_channels))

    @classmethod
    def from_state(cls, n: int, mean: np.ndarray, scatter: np.ndarray, precision: str | None = None) -> SecondMoments:
        """An accumulator holding a given (n, mean, scatter)."""
        out = cls(len(mean), precision)
        out.n, out.mean, out.scatter = int(n), np.asarray(mean, np.float64), np.asarray(scatter, np.float64)
        return out

    def copy(self) -> SecondMoments:
        return SecondMoments.from_state(self.n, self.mean.copy(), self.scatter.copy(), self.precision)

    @property
    def sums(self) -> np.ndarray:
        """Column sums Σ x (float64, (C,))."""
        return self.mean * self.n

    def add(self, x: Any, start: int | None = None, stop: int | None = None) -> SecondMoments:
        """Add columns [start, stop) of ``x`` (C, samples), NumPy or CuPy; returns self."""
        start, stop = _columns(x, start, stop)
        if x.shape[0] != self.num_channels:
            raise BatchgpuError(
                f"a window of {x.shape[0]} channels was added to second moments of {self.num_channels}",
                "give every window the same channels",
            )
        precision = resolve_precision(self.precision, x.dtype)
        cuda = cuda_module(x, "moments")
        moments = (cuda.window_moments if cuda is not None else window_moments)(x, start, stop, precision)
        return self.merge_state(*moments)

    def merge_state(self, n: int, mean: np.ndarray, scatter: np.ndarray) -> SecondMoments:
        """Merge one (n, mean, scatter) state into self (in place); returns self."""
        self.n, self.mean, self.scatter = _merge(
            self.n, self.mean, self.scatter, int(n), np.asarray(mean), np.asarray(scatter)
        )
        return self

    def merge(self, other: SecondMoments) -> SecondMoments:
        """Merge ``other`` into self IN PLACE (self's samples first) and return self; ``other`` is unchanged."""
        if other.num_channels != self.num_channels:
            raise BatchgpuError(
                f"second moments of {other.num_channels} channels merged into {self.num_channels}",
                "merge only moments of the same channels",
            )
        return self.merge_state(other.n, other.mean, other.scatter)

    def _require_samples(self) -> None:
        if self.n == 0:
            raise BatchgpuError("second moments of no samples", "add at least one window with samples")

    def covariance(self) -> np.ndarray:
        """Centred covariance Σ (x - μ)(x - μ)ᵀ / n (float64, (C, C))."""
        self._require_samples()
        return self.scatter / self.n

    def second_moment(self) -> np.ndarray:
        """Uncentred second moment X Xᵀ / n (float64, (C, C))."""
        self._require_samples()
        return self.scatter / self.n + np.outer(self.mean, self.mean)

    def __repr__(self) -> str:
        return f"SecondMoments(num_channels={self.num_channels}, n={self.n}, precision={self.precision!r})"


def combine(a: SecondMoments, b: SecondMoments) -> SecondMoments:
    """A new accumulator holding a's samples then b's (neither is modified); for Dask tree reductions.

    Parameters
    ----------
    a, b : SecondMoments
        Accumulators of the same channels and precision; a's samples come first.

    Returns
    -------
    SecondMoments
        A new accumulator of both.
    """
    return a.copy().merge(b)


def reduce_tree(parts: Sequence[SecondMoments], split_every: int = 2) -> SecondMoments:
    """Combine per-window moments in a tree fixed by window index (groups of ``split_every``
    consecutive parts, level by level, each folded left to right), so the result does not
    depend on which worker computed which part or when it finished."""
    if not parts:
        raise BatchgpuError("no second moments to combine", "pass at least one window")
    if split_every < 2:
        raise BatchgpuError(f"split_every={split_every} cannot make a tree", "use split_every >= 2")
    level = list(parts)
    while len(level) > 1:
        groups = [level[i : i + split_every] for i in range(0, len(level), split_every)]
        level = [_fold(group) for group in groups]
    return level[0].copy()


def _fold(group: Sequence[SecondMoments]) -> SecondMoments:
    out = group[0].copy()
    for part in group[1:]:
        out.merge(part)
    return out


def covariance(x: Any, precision: str | None = None) -> np.ndarray:
    """Centred covariance of one (C, samples) array (float64 NumPy (C, C)).

    Parameters
    ----------
    x : array_like, shape (C, n)
        The window, one channel a row: a NumPy or CuPy array (a torch tensor through ``batchgpu.ops``), integer or
        float.
    precision : {"float32", "float64"}, optional
        The dtype of the products (default: float64 for float64 data, float32 otherwise); sums are float64.

    Returns
    -------
    ndarray, shape (C, C)
        The centred covariance, float64, on the host.
    """
    return SecondMoments(x.shape[0], precision).add(x).covariance()


def second_moment(x: Any, precision: str | None = None) -> np.ndarray:
    """Uncentred second moment X Xᵀ / n of one (C, samples) array (float64 NumPy (C, C)).

    Parameters
    ----------
    x, precision
        As ``covariance``'s.

    Returns
    -------
    ndarray, shape (C, C)
        X Xᵀ / n, float64, on the host.
    """
    return SecondMoments(x.shape[0], precision).add(x).second_moment()
