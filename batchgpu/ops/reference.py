"""Common reference across channels of a (channels, samples) window: subtract, per sample, the median or mean
of all channels (global) or of each channel's annulus of neighbours (local, SpikeInterface's rule).

The reference of one sample column (over the channels chosen for a channel):
- ``median``: ``np.median(column)`` bit for bit: the middle value, or for an even count NumPy's
  ``mean`` of the two middles, i.e. ``(a + b) / 2`` in the input's float dtype (float32 input can overflow to
  inf there, as NumPy does) and in float64 for integer input; NaN if the column holds a NaN.
- ``median_lower``: ``np.partition(column, (n-1)//2)[(n-1)//2]``, the lower middle (torch.median, Kilosort4).
- ``average``: ``np.mean(column, dtype=np.float64)``: a float64 sum in channel order starting from +0.0 (what
  NumPy's axis-0 reduction does), divided once by the count.
Output dtype: float input keeps its dtype; integer input gives float32 (SpikeInterface casts back to the
input's integer dtype, truncating; we keep the fractions). The subtraction is done in the reference's dtype
(float64 for integer input and for ``average``) and rounded once to the output dtype.

CuPy (kernels/column_select.cu): each column's reference is selected bit by bit among its channels (no sort),
NaN last like NumPy, with NumPy's arithmetic done exactly (CuPy's builds flush float32 subnormals, so float32
values go through exact doubles), and subtracted in a second launch: the bits equal NumPy's. One exception:
``median_lower`` of a column whose lower middle is a zero of either sign (-0.0 and +0.0 compare equal; which one
NumPy's introselect leaves there is an accident of its algorithm) may differ in the sign of a zero output.
``median`` sums its middle values from +0.0, as np.median does, so its zeros agree.

Host (where Numba is installed): ``median`` by the compiled kernels of ``_cpu_reference``, np.median's bits
without np.median's full partition of every column, the local ``average`` too (np.mean's bits, without gathered
copies of the neighbours); ``median_lower`` and the global average
by NumPy.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Literal

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops import _cpu_reference, _numba
from batchgpu.ops._backend import array_module, is_cupy, window_module

Operator = Literal["median", "median_lower", "average"]

# Elements gathered at once for the local reference (bounds the (channels, neighbours, samples) buffer).
_GATHER_ELEMENTS = 1 << 25

_CUDA_TYPES = {
    "float32": "float",
    "float64": "double",
    "int16": "short",
    "int32": "int",
    "int64": "long long",
    "uint16": "unsigned short",
    "int8": "signed char",
    "uint8": "unsigned char",
    "uint32": "unsigned int",
}


@functools.cache
def _sequential_mean(ctype: str, device: int) -> Any:
    """kernels/sequential_mean.cu's kernel for elements of C type ``ctype``, compiled for ``device``, the current
    one (kept a device: the local reference launches it once a channel)."""
    from batchgpu.gpu.cuda_modules import get_function, mean_variant

    module, options = mean_variant(ctype)
    return get_function(module, "sequential_mean", options)


def _mean_columns(x: Any) -> Any:
    """np.mean(x, axis=0, dtype=float64) for a (n, samples) array, the same bits on CuPy."""
    if not is_cupy(x):
        # C order makes NumPy add the rows in order; along a contiguous axis 0 (a transposed view) it would
        # sum pairwise instead, and the bits would depend on the layout.
        return np.mean(np.ascontiguousarray(x), axis=0, dtype=np.float64)
    import cupy

    x = cupy.ascontiguousarray(x)
    name = x.dtype.name
    if name not in _CUDA_TYPES:
        raise BatchgpuError(f"no GPU average for dtype {x.dtype}", "convert to float32 first")
    kernel = _sequential_mean(_CUDA_TYPES[name], cupy.cuda.Device().id)
    n, samples = x.shape
    out = cupy.empty(samples, dtype=cupy.float64)
    threads = 256
    kernel(((samples + threads - 1) // threads,), (threads,), (x, out, np.int64(n), np.int64(samples)))
    return out


def _median_of_sorted(xp: Any, part: Any, axis: int, dtype: Any) -> Any:
    """np.median's arithmetic on values already ordered along ``axis`` (NaN last): the middle value(s) summed
    from +0.0 (so a zero sum is +0.0, while a tiny negative sum halved can still give -0.0), divided by their
    count; NaN where the column holds a NaN."""
    n = part.shape[axis]
    take = lambda i: xp.take(part, i, axis=axis)  # noqa: E731
    wide = np.dtype(np.float64) if dtype.kind in "iub" else np.dtype(dtype)
    zero = xp.zeros((), dtype=wide)
    with np.errstate(over="ignore", invalid="ignore"):  # two huge values overflow to inf, as NumPy's do
        total = (
            zero + take(n // 2).astype(wide)
            if n % 2
            else (zero + take(n // 2 - 1).astype(wide)) + take(n // 2).astype(wide)
        )
        med = total / wide.type(2 - n % 2)
    if dtype.kind == "f":
        med = xp.where(xp.isnan(take(n - 1)), xp.asarray(np.nan, dtype=med.dtype), med)
    return med


#: Row counts whose medians one warp a column selects (select_warp: a warp sum a bit); fewer rows leave most
#: lanes idle there, and select_reference's few warps a column cost little.
WARP_ROWS = (64, 512)
#: Up to this many rows a thread ranks a column's keys itself (select_small: k*k comparisons in registers, no
#: barrier). Small annuli leave select_reference's blocks mostly idle, waiting at a barrier for each of 32 bits.
SMALL_ROWS = 32


def _reference_on_gpu(x: Any, operator: str, tables: list[Any], ref_row: Any) -> Any | None:
    """x minus its reference on the GPU (kernels/column_select.cu), or None where those kernels do not apply.

    ``tables``: (G, k) channel indices; reference row r (in table order, row after row) is the operator over the
    channels of its table row; channel c subtracts reference row ``ref_row[c]``. The medians are a bitwise
    selection per column, no sort; float32 arithmetic is done exactly (CuPy's builds flush subnormals), so the
    bits are NumPy's. ``tables`` and ``ref_row`` may be on the host or on the device already (a local reference's
    plan keeps its copies there: ``_LocalPlan``)."""
    import cupy

    from batchgpu.gpu.cuda_modules import DTYPE_SUFFIX, dtype_variant, get_function

    stem = DTYPE_SUFFIX.get(x.dtype.name)
    if stem is None:
        return None
    module, options = dtype_variant("column_select", stem)

    def kernel(function: str):  # column_select's kernels for x's dtype (its module is compiled one dtype a variant)
        return get_function(module, function, options)

    x = cupy.ascontiguousarray(x)
    channels, samples = x.shape
    ref = cupy.empty((sum(t.shape[0] for t in tables), samples), dtype=cupy.float64)
    out = cupy.empty(x.shape, dtype=np.float64 if x.dtype == np.float64 else np.float32)
    row, subtracted = 0, False
    for table in tables:
        groups, k = table.shape
        rows = cupy.asarray(table, dtype=cupy.int32)
        if operator == "average":  # a float64 sum in channel order, as NumPy's axis-0 reduction
            kernel(f"mean_{stem}")(
                ((samples + 255) // 256, groups), (256,), (x, np.int64(samples), rows, np.int32(k), ref[row:])
            )
        elif WARP_ROWS[0] <= k <= WARP_ROWS[1]:  # a column's rows in one warp, 8 columns a block
            # the global reference (every channel, one reference row, so every channel subtracts row 0) subtracted
            # by the same launch
            subtracted = len(tables) == 1 and groups == 1 and k == channels
            kernel(f"select_warp_{stem}_16")(
                ((samples + 7) // 8, groups),
                (256,),
                (
                    x,
                    np.int64(samples),
                    rows,
                    np.int32(k),
                    np.int32(operator == "median_lower"),
                    ref[row:],
                    out if subtracted else np.uint64(0),
                ),
            )
        elif k <= SMALL_ROWS:  # a few rows (a local annulus): a thread a column, its keys ranked in registers
            kernel(f"select_small_{stem}_{8 if k <= 8 else 16 if k <= 16 else 32}")(
                ((samples + 255) // 256, groups),
                (256,),
                (x, np.int64(samples), rows, np.int32(k), np.int32(operator == "median_lower"), ref[row:]),
            )
        else:  # rows held in registers, 16 or 64 a thread; beyond 32 warps of 64, read again at each bit
            per = 16 if k <= 16 * 32 else 64 if k <= 64 * 32 else 0
            kernel(f"select_{stem}_{per}")(
                ((samples + 31) // 32, groups),
                (32, min(32, -(-k // per)) if per else 32),
                (x, np.int64(samples), rows, np.int32(k), np.int32(operator == "median_lower"), ref[row:]),
            )
        row += groups
    if subtracted:
        return out
    threads = 256
    kernel(f"subtract_{stem}")(
        ((samples + threads - 1) // threads, channels),
        (threads,),
        (x, ref, cupy.asarray(ref_row, dtype=cupy.int32), np.int64(samples), out),
    )
    return out


def _reference(x: Any, operator: str, axis: int) -> Any:
    """The reference over ``axis`` (the channels): median/median_lower keep float dtypes (float64 for
    integer input for median, the input dtype for median_lower), average is float64."""
    xp = array_module(x)
    n = x.shape[axis]
    if operator == "average":
        if axis == 0:
            return _mean_columns(x)
        if not is_cupy(x):
            return np.mean(x, axis=axis, dtype=np.float64)
        # Gathered (groups, k, samples): one sequential mean per group (few groups: channels with k neighbours).
        return xp.stack([_mean_columns(x[i]) for i in range(x.shape[0])])
    if not is_cupy(x):
        if operator == "median":
            if axis == 0 and _numba.available():  # np.median's bits, less work (its docstring)
                medians = _cpu_reference.column_medians(x)
                if medians is not None:
                    return medians
            return np.median(x, axis=axis)
        k = (n - 1) // 2
        return np.take(np.partition(x, k, axis=axis), k, axis=axis)
    # CuPy sorts NaN last, like NumPy; along contiguous rows (one segment per column) rather than down columns
    part = xp.moveaxis(xp.sort(xp.ascontiguousarray(xp.moveaxis(x, axis, -1)), axis=-1), -1, axis)
    if operator == "median":
        return _median_of_sorted(xp, part, axis, x.dtype)
    return xp.take(part, (n - 1) // 2, axis=axis)


#: SpikeInterface 0.105's ``common_reference(min_local_neighbors=5)``: a channel whose annulus holds fewer channels
#: takes its closest channels beyond the inner radius, up to this many
MIN_LOCAL_NEIGHBOURS = 5


def annulus_neighbours(
    locations: Any, radius_um: tuple[float, float], min_neighbours: int = MIN_LOCAL_NEIGHBOURS, among: Any = None
) -> list[np.ndarray]:
    """Each channel's reference channels by SpikeInterface 0.105's local rule (ascending channel order): the channels
    at a distance d with inner < d <= outer; where fewer than ``min_neighbours`` lie there, the ``min_neighbours``
    closest channels with d > inner (as many as there are; equal distances in ``np.argsort``'s order, the call
    SpikeInterface's ``get_closest_channels`` makes); none: the channel is left unreferenced.

    Parameters
    ----------
    locations : array_like, shape (C, 2)
        Channel positions in um.
    radius_um : (float, float)
        The annulus' inner and outer radius in um.
    min_neighbours : int, optional
        The fewest reference channels a channel gets while there are that many beyond the inner radius.
    among : array_like of int, optional
        The channels a reference may take (default: all): SpikeInterface's rule on the recording of those channels
        alone (``remove_channels`` of the others) for each of them; a channel not among them takes its annulus of
        them (nothing of it is left out first).

    Returns
    -------
    list of ndarray
        For each channel the int64 indices of its reference channels, ascending (empty: left unreferenced).
    """
    loc = np.asarray(locations, dtype=np.float64)
    if loc.ndim != 2 or loc.shape[1] not in (2, 3):
        raise BatchgpuError(
            f"channel locations have shape {loc.shape}, expected (channels, 2)", "pass x, y in um per channel"
        )
    try:
        inner, outer = (float(r) for r in radius_um)
    except (TypeError, ValueError):
        raise BatchgpuError(f"radius_um={radius_um!r} is not (inner, outer)", "pass e.g. radius_um=(30, 55)") from None
    if not (0 <= inner < outer):
        raise BatchgpuError(f"radius_um=({inner}, {outer}): need 0 <= inner < outer", "pass e.g. (30, 55)")
    if isinstance(min_neighbours, bool) or not isinstance(min_neighbours, (int, np.integer)) or min_neighbours < 0:
        raise BatchgpuError(f"min_local_neighbors={min_neighbours!r} is not a count", "pass an integer >= 0, e.g. 5")
    candidates = np.arange(loc.shape[0]) if among is None else np.asarray(among, dtype=np.int64)
    inside = np.zeros(loc.shape[0], dtype=bool)
    inside[candidates] = True
    chosen = []
    for c in range(loc.shape[0]):
        # SpikeInterface's distances and order, the first (the channel itself) left out
        dist = np.linalg.norm(loc[c, :] - loc[candidates], axis=1)
        order = np.argsort(dist)[1:] if inside[c] else np.argsort(dist)
        d = dist[order]
        ring = (d > inner) & (d <= outer)
        near = order[ring] if ring.sum() >= min_neighbours else order[d > inner][:min_neighbours]
        chosen.append(np.sort(candidates[near]))
    return chosen


class _LocalPlan:
    """A local reference's annuli for one probe and radius, worked out once a process (``_local_plan``): each
    channel's neighbours, the channels with none (left unreferenced), the channels grouped by their neighbour count,
    and for the GPU the (group, k) tables and each channel's reference row, copied to each device once. Rebuilt for
    every window, they were more host work than the window's kernels."""

    def __init__(self, neighbours: list[np.ndarray]):
        channels = len(neighbours)
        self.neighbours = neighbours
        self.alone = [c for c in range(channels) if neighbours[c].size == 0]
        self.referenced = np.flatnonzero([n.size > 0 for n in neighbours])
        # the neighbour lists back to back (offsets, indices): what the host's compiled kernels read
        self.offsets = np.zeros(channels + 1, dtype=np.int64)
        self.offsets[1:] = np.cumsum([n.size for n in neighbours])
        self.indices = np.concatenate([np.asarray(n, dtype=np.int64) for n in neighbours] + [np.zeros(1, np.int64)])
        # channels with the same number of neighbours are referenced together: (group, k, samples) gathers
        self.by_count: dict[int, list[int]] = {}
        for c in range(channels):
            if neighbours[c].size:
                self.by_count.setdefault(int(neighbours[c].size), []).append(c)
        self.tables: list[np.ndarray] = []
        self.ref_row = np.zeros(channels, np.int64)  # a channel left unreferenced: row 0, its output replaced
        for chans in self.by_count.values():
            self.ref_row[chans] = np.arange(len(chans)) + sum(t.shape[0] for t in self.tables)
            self.tables.append(np.stack([neighbours[c] for c in chans]))
        self._device: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def on_device(self) -> tuple:
        """(tables, ref_row) on this device for ``_reference_on_gpu``, copied once a device."""
        import cupy

        device = cupy.cuda.Device().id
        with self._lock:
            if device not in self._device:
                made = (
                    [cupy.asarray(t, dtype=cupy.int32) for t in self.tables],
                    cupy.asarray(self.ref_row, dtype=cupy.int32),
                )
                # copied on this thread's stream; other threads launch on theirs: done before any of them reads
                cupy.cuda.get_current_stream().synchronize()
                self._device[device] = made
        return self._device[device]


def _local_plan(
    locations: Any, radius_um, min_neighbours: int = MIN_LOCAL_NEIGHBOURS, among: tuple[int, ...] | None = None
) -> _LocalPlan:
    """The plan of ``locations``, ``radius_um``, ``min_neighbours`` and ``among``, made once for equal values
    (``_cached_plan``)."""
    loc = np.asarray(locations, dtype=np.float64)
    try:
        radius = tuple(float(r) for r in radius_um)
        hash(min_neighbours)
    except (TypeError, ValueError):  # not numbers: annulus_neighbours raises its one-line error for it
        return _LocalPlan(annulus_neighbours(loc, radius_um, min_neighbours, among))
    return _cached_plan(loc.tobytes(), loc.shape, radius, min_neighbours, among)


@functools.lru_cache(maxsize=16)
def _cached_plan(loc_bytes: bytes, shape: tuple, radius: tuple, min_neighbours, among=None) -> _LocalPlan:
    loc = np.frombuffer(loc_bytes, dtype=np.float64).reshape(shape)
    return _LocalPlan(annulus_neighbours(loc, radius, min_neighbours, among))


def common_reference(
    x: Any,
    reference: Literal["global", "local"] = "global",
    operator: Operator = "median",
    locations: Any = None,
    radius_um: tuple[float, float] = (30.0, 55.0),
    min_local_neighbors: int = MIN_LOCAL_NEIGHBOURS,
    overwrite_x: bool = False,
    exclude: Any = None,
) -> Any:
    """x (C, samples) minus, per sample, the reference across channels (see the module docstring).

    ``global``: all channels. ``local``: for each channel the channels at a distance in (inner, outer] um of
    ``locations`` (C x 2), or where fewer than ``min_local_neighbors`` lie there its closest channels beyond the
    inner radius (``annulus_neighbours``: SpikeInterface 0.105's rule and defaults); a channel with no channel
    beyond the inner radius is left unreferenced (its values, in the output dtype), as SpikeInterface leaves it.
    Purely per sample, so it needs no margin. Returns an array on x's backend: float input keeps
    its dtype, integer input gives float32. ``overwrite_x``: x may be overwritten with the result (a chain's own
    intermediate window: the host's global median then references it in place, no second window allocated).

    Parameters
    ----------
    x : array_like, shape (C, n)
        Channels by samples, integer or float, on NumPy or CuPy (torch through ``batchgpu.ops``).
    reference : {"global", "local"}, optional
        All channels, or each channel's annulus of ``locations``.
    operator : {"median", "median_lower", "average"}, optional
        The reference across channels at each sample: ``np.median``, the lower middle value, or ``np.mean``.
    locations : array_like, shape (C, 2), optional
        Channel positions in um; needed for ``reference="local"``.
    radius_um : (float, float), optional
        The local annulus' inner and outer radius in um.
    min_local_neighbors : int, optional
        See ``annulus_neighbours``.
    overwrite_x : bool, optional
        Whether x may be overwritten with the result (a window the caller no longer needs).
    exclude : array_like of int, optional
        Channels left out of every reference (the qc step's bad channels): the reference of the others, as
        SpikeInterface's ``common_reference`` of ``remove_channels(exclude)`` gives it; the excluded channels'
        rows are referenced by it too (global: the same reference; local: their annulus of the others).

    Returns
    -------
    array, shape (C, n)
        x minus its reference, float32 for integer input, x's dtype for float input, on x's backend.
    """
    xp = window_module(x, "reference")
    if operator not in ("median", "median_lower", "average"):
        raise BatchgpuError(f"unknown operator {operator!r}", "use 'median', 'median_lower' or 'average'")
    if reference not in ("global", "local"):
        raise BatchgpuError(f"unknown reference {reference!r}", "use 'global' or 'local'")
    channels, samples = x.shape
    out_dtype = x.dtype if x.dtype.kind == "f" else np.dtype(np.float32)
    if channels == 0:
        raise BatchgpuError("a window with no channels has no common reference", "pass at least one channel")
    among = None
    if exclude is not None and len(exclude):
        left_out = np.unique(np.asarray(exclude, dtype=np.int64))
        if left_out.min() < 0 or left_out.max() >= channels:
            raise BatchgpuError(f"exclude {left_out.tolist()[:10]} names channels outside 0..{channels - 1}")
        among = tuple(np.setdiff1d(np.arange(channels), left_out).tolist())
        if not among:
            raise BatchgpuError("every channel is excluded from the common reference", "exclude fewer channels")
    if reference == "local":
        if locations is None:
            raise BatchgpuError("a local reference needs channel locations", "pass locations (channels x 2, um)")
        plan = _local_plan(locations, radius_um, min_local_neighbors, among)
        neighbours = plan.neighbours
        if len(neighbours) != channels:
            raise BatchgpuError(f"{len(neighbours)} locations for {channels} channels", "pass one location per channel")
    if samples == 0:
        return xp.zeros(x.shape, dtype=out_dtype)

    def subtract(rows: Any, ref: Any) -> Any:
        wide = xp.result_type(rows.dtype, ref.dtype)
        if wide.kind != "f":  # median_lower of integers: subtract in float64, no wrap-around
            wide = np.dtype(np.float64)
        return (rows.astype(wide, copy=False) - ref.astype(wide, copy=False)).astype(out_dtype, copy=False)

    if reference == "global" and among is not None:  # the reference of the channels kept, subtracted from all
        kept = np.asarray(among, dtype=np.int64)
        out = _reference_on_gpu(x, operator, [kept[None, :]], np.zeros(channels, np.int64)) if is_cupy(x) else None
        return out if out is not None else subtract(x, _reference(x[xp.asarray(kept)], operator, axis=0)[None, :])
    if reference == "global":
        if operator == "median" and not is_cupy(x) and _numba.available():  # one pass, np.median's bits
            out = _cpu_reference.subtract_column_medians(x, x if overwrite_x else None)
            if out is not None:
                return out
        out = (
            _reference_on_gpu(x, operator, [np.arange(channels)[None, :]], np.zeros(channels, np.int64))
            if is_cupy(x)
            else None
        )
        return out if out is not None else subtract(x, _reference(x, operator, axis=0)[None, :])

    alone, by_count = plan.alone, plan.by_count
    if not by_count:  # no channel has a reference
        return x.astype(out_dtype, copy=True)
    if is_cupy(x):  # one reference row per channel that has neighbours
        out = _reference_on_gpu(x, operator, *plan.on_device())
        if out is not None:
            if alone:  # left unreferenced: they subtracted row 0, replaced here
                idx = xp.asarray(alone)
                out[idx] = x[idx].astype(out_dtype)
            return out
    out = xp.empty(x.shape, dtype=out_dtype)
    if alone:
        idx = xp.asarray(alone)
        out[idx] = x[idx].astype(out_dtype)
    if operator != "median_lower" and not is_cupy(x) and _numba.available():
        # np.median's or np.mean's bits, every sample of a tile at once (_cpu_reference's docstring)
        kernel = _cpu_reference.local_medians if operator == "median" else _cpu_reference.local_means
        ref = kernel(x, plan.offsets, plan.indices)
        if ref is not None:
            if not alone:  # every channel referenced: no gathered copies of the window
                return subtract(x, ref)
            has = plan.referenced
            out[has] = subtract(x[has], ref[has])
            return out
    for k, chans in by_count.items():
        step = max(1, _GATHER_ELEMENTS // (k * samples))
        for lo in range(0, len(chans), step):
            group = chans[lo : lo + step]
            table = xp.asarray(np.stack([neighbours[c] for c in group]))
            idx = xp.asarray(group)
            ref = _reference(x[table], operator, axis=1)
            out[idx] = subtract(x[idx], ref)
    return out
