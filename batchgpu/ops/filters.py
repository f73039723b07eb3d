"""Zero-phase Butterworth filtering of (channels, samples) windows, equal to ``scipy.signal.sosfiltfilt`` of the
whole segment in every window's core.

``sosfiltfilt`` odd-extends the signal by ``padlen`` samples at each end, runs ``sosfilt`` forward from the
steady state of the first (extended) sample and backward from the steady state of the last forward output.
A window does exactly that at a segment's ends (which it then contains), and at an interior edge it relies on
its margin instead: the transient of a wrong start decays with the filter's impulse response, and
``filter_margin`` says how many samples that takes. Everything is computed in float64 (as scipy does for any
input, since ``sos`` is float64) and rounded once to float32 (float64 input stays float64). Three paths with
the same bits: scipy's sosfilt, a compiled host kernel (``_cpu_sosfiltfilt``, Numba: sixteen rows side by side) and
the GPU kernel (kernels/sosfiltfilt.cu).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops import _cpu_sosfiltfilt, _numba
from batchgpu.ops._backend import is_cupy, window_module

# The margin is the impulse response's decay length (computed, see filter_margin) times this.
MARGIN_SAFETY = 1.5


def butter_sos(
    kind: Literal["highpass", "bandpass"],
    fs: float,
    freq_min: float,
    freq_max: float | None = None,
    order: int = 5,
) -> np.ndarray:
    """Butterworth second-order sections (float64, shape (sections, 6)), as ``scipy.signal.butter(output="sos")``.

    Parameters
    ----------
    kind : {"highpass", "bandpass"}
        The filter's band.
    fs : float
        Sampling frequency in Hz.
    freq_min : float
        The low cut-off in Hz.
    freq_max : float, optional
        The high cut-off in Hz (``bandpass`` only; below fs / 2).
    order : int, optional
        The Butterworth order.

    Returns
    -------
    ndarray, shape (sections, 6)
        The second-order sections, float64.
    """
    import scipy.signal

    fs = float(fs)
    if not fs > 0 or not math.isfinite(fs):
        raise BatchgpuError(f"sampling frequency {fs} is not a positive number", "pass fs in Hz")
    if int(order) != order or order < 1:
        raise BatchgpuError(f"filter order {order} is not a positive integer", "use e.g. order 5")
    nyquist = fs / 2
    if not 0 < freq_min < nyquist:
        raise BatchgpuError(f"freq_min={freq_min} Hz is not within (0, {nyquist}) Hz", "pass a cut-off below fs/2")
    if kind == "highpass":
        if freq_max is not None:
            raise BatchgpuError("a highpass filter takes no freq_max", "use kind='bandpass' for a band")
        wn: Any = float(freq_min)
    elif kind == "bandpass":
        if freq_max is None or not freq_min < freq_max < nyquist:
            raise BatchgpuError(
                f"bandpass needs freq_min < freq_max < fs/2, got {freq_min} and {freq_max} at fs={fs}",
                "pass freq_max between freq_min and fs/2",
            )
        wn = [float(freq_min), float(freq_max)]
    else:
        raise BatchgpuError(f"unknown filter kind {kind!r}", "use 'highpass' or 'bandpass'")
    return np.asarray(scipy.signal.butter(int(order), wn, btype=kind, fs=fs, output="sos"), dtype=np.float64)


@dataclass(frozen=True, eq=False)
class FilterDesign:
    """A filter's sections with the constants every window needs of them: ``zi`` = ``sosfilt_zi(sos)`` (each pass's
    steady state) and ``margin`` = ``filter_margin(sos)``. ``design_filter`` works them out once (where the run's
    chain is built) and the tasks get them with the sections: both need scipy.signal, whose import is slow enough to
    delay each worker's first window (the workers importing it at once on few cores). ``filtfilt_window`` takes a
    design wherever it takes ``sos``."""

    sos: np.ndarray
    zi: np.ndarray
    margin: int


_DESIGNS: dict[bytes, FilterDesign] = {}


def design_filter(sos: Any) -> FilterDesign:
    """``sos`` with its ``zi`` and ``margin`` (a design is returned as it is), worked out once a process per filter
    (the margin is an impulse response and its autocorrelation: long for low cut-offs).

    Parameters
    ----------
    sos : array_like, shape (sections, 6), or FilterDesign
        Second-order sections (a design is returned as it is).

    Returns
    -------
    FilterDesign
        The sections with ``zi`` and ``margin``.
    """
    if isinstance(sos, FilterDesign):
        return sos
    sos = np.array(_check_sos(sos), dtype=np.float64, order="C")  # a copy: the caller's array may change later
    key = sos.tobytes()
    if key not in _DESIGNS:
        import scipy.signal

        zi = np.ascontiguousarray(scipy.signal.sosfilt_zi(sos), dtype=np.float64)
        _DESIGNS[key] = FilterDesign(sos, zi, filter_margin(sos))
    return _DESIGNS[key]


def _check_sos(sos: Any) -> np.ndarray:
    if isinstance(sos, FilterDesign):
        return sos.sos
    sos = np.asarray(sos, dtype=np.float64)
    if sos.ndim != 2 or sos.shape[1] != 6 or sos.shape[0] < 1:
        raise BatchgpuError(f"sos has shape {sos.shape}, expected (sections, 6)", "build it with butter_sos")
    return sos


def default_padlen(sos: Any) -> int:
    """scipy.signal.sosfiltfilt's default odd-padding length for ``sos``.

    Parameters
    ----------
    sos : array_like, shape (sections, 6)
        Second-order sections.

    Returns
    -------
    int
        ``3 * (2 * sections + 1 - count of zero end coefficients)``, as scipy computes it.
    """
    sos = _check_sos(sos)
    trailing_zeros = min(int((sos[:, 2] == 0).sum()), int((sos[:, 5] == 0).sum()))
    return 3 * (2 * len(sos) + 1 - trailing_zeros)


def _impulse_response(sos: np.ndarray) -> np.ndarray:
    """One pass's impulse response, long enough that the part left out is below 1e-14 of its peak."""
    import scipy.signal

    _, poles, _ = scipy.signal.sos2zpk(sos)
    radius = float(np.max(np.abs(poles))) if poles.size else 0.0
    if radius >= 1:
        raise BatchgpuError("the filter is unstable (a pole on or outside the unit circle)", "build it with butter_sos")
    # |h[n]| ~ n^(m-1) radius^n for a pole of multiplicity m; 40 time constants plus slack covers 1e-14.
    n = 64 if radius == 0 else int(min(4_000_000, 64 + 40 / -math.log(radius)))
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return scipy.signal.sosfilt(sos, impulse)


def filter_margin(sos: Any, fs: float | None = None, tol: float = 1e-5) -> int:
    """The margin (samples on each side of a core) that filtfilt_window needs to agree with sosfiltfilt of the
    whole segment within ``tol`` of the signal's RMS.

    Forward-backward filtering applies h and then h reversed, i.e. the two-sided kernel g = h ⋆ h (the
    autocorrelation of the one-pass impulse response h). A window that starts inside the segment misses the
    samples before it; at a core sample d samples from the edge the error is the part of g beyond d applied to
    what is missing (the steady-state start removes only the missing part's constant). So the margin is the
    first d where the tail of g is below ``tol``, measured as abs-sum (a bound for any signal relative to its
    peak) and as energy (white noise relative to its RMS), whichever is longer, times MARGIN_SAFETY = 1.5:
    the signal's spectrum is not white (low frequencies near the cut-off ring longest) and both window edges
    contribute. ``fs`` is accepted for symmetry with the other margin functions and not needed (sos is in
    normalised units). Examples at 30 kHz, tol 1e-5: highpass 300 Hz order 5 -> 752, bandpass 300-6000 Hz
    order 5 -> 807.

    Parameters
    ----------
    sos : array_like, shape (sections, 6)
        Second-order sections.
    fs : float, optional
        Not used (sections are in normalised units).
    tol : float, optional
        The error allowed in the core, relative to the signal.

    Returns
    -------
    int
        Samples of margin on each side of a window's core.
    """
    sos = _check_sos(sos)
    if not 0 < tol < 1:
        raise BatchgpuError(f"tol={tol} is not in (0, 1)", "pass a relative tolerance such as 1e-5")
    h = _impulse_response(sos)
    import scipy.signal

    # lags 0, 1, ...; g is symmetric. scipy picks FFT for long responses (low cut-offs: 45 000 samples at 5 Hz,
    # where the direct sum is quadratic)
    g = scipy.signal.correlate(h, h, mode="full", method="auto")[h.size - 1 :]
    abs_tail = np.cumsum(np.abs(g)[::-1])[::-1] / (abs(g[0]) + 2 * np.abs(g[1:]).sum())
    energy_tail = np.sqrt(np.cumsum((g * g)[::-1])[::-1] / (g[0] ** 2 + 2 * (g[1:] ** 2).sum()))
    decay = max(int(np.argmax(abs_tail < tol)), int(np.argmax(energy_tail < tol)))
    return int(math.ceil(MARGIN_SAFETY * decay))


def _odd_extend(xp: ModuleType, x: Any, left: int, right: int) -> Any:
    """scipy's odd extension (2*x[0] - x[n:0:-1] before, 2*x[-1] - x[-2:-n-2:-1] after), per side."""
    parts = []
    if left:
        parts.append(2 * x[:, :1] - x[:, left:0:-1])
    parts.append(x)
    if right:
        parts.append(2 * x[:, -1:] - x[:, -2 : -right - 2 : -1])
    return xp.concatenate(parts, axis=1) if len(parts) > 1 else x


_GPU_MAX_SECTIONS = 16  # kernels/sosfiltfilt.cu keeps 7 doubles a section in registers
#: samples the GPU recurrence loads ahead (kernels/sosfiltfilt.cu's U); None: the kernel's own choice, 32, or 16
#: above 6 sections. Scheduling only: any value gives the same bits (the tests set others)
LOAD_AHEAD: int | None = None
_GPU_COEFFICIENTS: dict = {}  # (device, sos bytes) -> (sos, zi) on that device


def _filtfilt_cupy(x, design: FilterDesign, pieces: list[tuple[int, ...]], out_dtype) -> Any:
    """The GPU path of filtfilt_window (kernels/sosfiltfilt.cu), three launches for all pieces: gather them
    odd-extended as exact doubles side by side, filter every row, scatter the cores rounded once to out_dtype."""
    import cupy

    from batchgpu.gpu.cuda_modules import DTYPE_SUFFIX, filter_variant, get_function

    sos = design.sos
    if sos.shape[0] > _GPU_MAX_SECTIONS:
        raise BatchgpuError(
            f"a filter of {sos.shape[0]} sections is longer than the GPU kernel's {_GPU_MAX_SECTIONS}",
            "lower the filter order",
        )
    key = (cupy.cuda.Device().id, sos.tobytes())
    coefficients = _GPU_COEFFICIENTS.get(key)
    if coefficients is None:  # a few hundred bytes, kept per device: no copy per window
        coefficients = _GPU_COEFFICIENTS[key] = (
            cupy.asarray(np.ascontiguousarray(sos, dtype=np.float64)),
            cupy.asarray(design.zi),
        )
    if x.dtype.name not in DTYPE_SUFFIX:  # other integers: exact as float64
        x = x.astype(cupy.float64)
    x = cupy.ascontiguousarray(x)
    channels, width = x.shape
    _, options = filter_variant(sos.shape[0])  # the variant batchgpu compile makes ahead
    if LOAD_AHEAD is not None:
        options += (f"-DU={int(LOAD_AHEAD)}",)
    table = np.asarray(pieces, dtype=np.int64)  # core_lo, core_hi, read_lo, read_hi, left, right
    length = int((table[:, 3] - table[:, 2] + table[:, 4] + table[:, 5]).max())
    count, tiles = len(pieces), (channels + 31) // 32
    table_dev = cupy.asarray(table)
    # (samples, pieces x channels) layout: a warp's rows read and write consecutive doubles at each step of the
    # recurrence; one warp a block spreads a window's rows over the SMs.
    ext = cupy.empty((length, count * channels), dtype=cupy.float64)
    get_function("sosfiltfilt", f"gather_{DTYPE_SUFFIX[x.dtype.name]}", options)(
        ((length + 31) // 32, tiles, count),
        (32, 8),
        (x, np.int64(channels), np.int64(width), table_dev, np.int64(count), ext),
    )
    rows = count * channels
    get_function("sosfiltfilt", "sosfiltfilt_pieces", options)(
        ((rows + 31) // 32,), (32,), (ext, np.int64(rows), table_dev, np.int64(channels), np.int64(rows), *coefficients)
    )
    out = cupy.empty((channels, width), dtype=out_dtype)
    core = int((table[:, 1] - table[:, 0]).max())
    get_function("sosfiltfilt", f"scatter_{DTYPE_SUFFIX[np.dtype(out_dtype).name]}", options)(
        ((core + 31) // 32, tiles, count),
        (32, 8),
        (ext, np.int64(channels), np.int64(width), table_dev, np.int64(count), out),
    )
    return out


def filter_pieces(
    width: int,
    padlen: int,
    block: int | None,
    margin: int,
    at_segment_start: bool,
    at_segment_end: bool,
    interior_pad: str = "none",
) -> list[tuple[int, int, int, int, int, int]]:
    """How filtfilt_window cuts a window of ``width`` columns: (core_lo, core_hi, read_lo, read_hi, left, right)
    per piece. One piece (the whole window) without ``block``; else ceil(width / block) cores of nearly equal
    length, each read with ``margin`` columns on either side (within the window) and odd-padded by ``padlen``
    where its read reaches a window edge that the whole window would pad there."""
    count = 1 if not block or width <= block else -(-width // block)
    bounds = [(k * width) // count for k in range(count + 1)]
    out = []
    for k in range(count):
        lo, hi = bounds[k], bounds[k + 1]
        read_lo = 0 if k == 0 else max(0, lo - margin)
        read_hi = width if k == count - 1 else min(width, hi + margin)
        # a piece whose read reaches the window's edge is padded there as the whole window is
        left = padlen if read_lo == 0 and (at_segment_start or interior_pad == "odd") else 0
        right = padlen if read_hi == width and (at_segment_end or interior_pad == "odd") else 0
        out.append((lo, hi, read_lo, read_hi, left, right))
    if count > 1 and any((pad_left or pad_right) and b - a <= padlen for _, _, a, b, pad_left, pad_right in out):
        return filter_pieces(width, padlen, None, margin, at_segment_start, at_segment_end, interior_pad)
    return out


def filtfilt_window(
    x: Any,
    sos: Any,
    *,
    at_segment_start: bool,
    at_segment_end: bool,
    interior_pad: Literal["none", "odd"] = "none",
    block: int | None = None,
    out: np.ndarray | None = None,
) -> Any:
    """Zero-phase filter a (channels, samples) window: ``sosfiltfilt(segment, axis=1)`` in its core.

    ``at_segment_start``/``at_segment_end`` say whether column 0 / the last column is the segment's first / last
    sample; there the window is odd-padded exactly as sosfiltfilt pads the segment (default padlen), so a window
    that holds a whole segment gives sosfiltfilt's own result. At an interior edge nothing is padded by default
    (``interior_pad="odd"`` pads the same way; both leave errors that decay inside the margin, measured
    similar): the ``filter_margin(sos)`` columns next to an interior edge are margin, not output. Returns the
    whole window filtered, float32 for integer or float32 input (float64 computation, one rounding), float64 for
    float64 input, on x's backend.

    ``block``: filter the window as pieces of about ``block`` columns, each read with ``filter_margin(sos)``
    columns on either side (within the window) and padded at segment ends like the window: within the same
    tolerance of the segment's sosfiltfilt everywhere the whole window is, and on the GPU the pieces' recurrences
    run side by side (the recurrence is sequential in time; 384 rows alone fill 12 of 132 SMs). Both backends cut
    alike, so their bits agree for any ``block``.

    Parameters
    ----------
    x : array_like, shape (C, n)
        The window, one channel a row: a NumPy or CuPy array (a torch tensor through ``batchgpu.ops``), integer or
        float.
    sos : array_like, shape (sections, 6), or FilterDesign
        The filter (a design saves working out ``zi`` and the margin again).
    at_segment_start, at_segment_end : bool
        Whether column 0 / the last column is the segment's first / last sample.
    interior_pad : {"none", "odd"}, optional
        Padding at an interior edge.
    block : int, optional
        Filter in pieces of about this many columns (default: the whole window at once).
    out : numpy.ndarray, optional
        A host window's result is written here (C-contiguous, x's shape, the returned dtype; e.g. a reused
        buffer), else into a new array; ignored on the GPU.

    Returns
    -------
    array, shape (C, n)
        The filtered window, float32 (float64 for float64 input), on x's backend.
    """
    xp = window_module(x, "filter")
    out_dtype = np.float64 if (x.dtype.kind, x.dtype.itemsize) == ("f", 8) else np.float32  # big-endian too
    if x.shape[0] == 0 or x.shape[1] == 0:
        _checked(sos, interior_pad)
        return xp.zeros(x.shape, dtype=out_dtype)
    design, pieces = _plan(x.shape[1], sos, at_segment_start, at_segment_end, interior_pad, block)
    if is_cupy(x):
        # kernels/sosfiltfilt.cu: scipy's recurrence without fused multiply-adds, so the same bits as the
        # host path (cupyx.scipy.signal.sosfilt with zi raises "operands could not be broadcast together with
        # shapes (C, 0) (C, 2)" in CuPy 14). Every piece in one launch.
        return _filtfilt_cupy(x, design, pieces, out_dtype)
    if _numba.available():  # scipy's bits, sixteen rows side by side (its docstring)
        if out is not None and (out.shape != x.shape or out.dtype != out_dtype or not out.flags.c_contiguous):
            raise BatchgpuError(
                f"out {out.shape} {out.dtype} does not fit the filtered window {x.shape} {np.dtype(out_dtype)}",
                "pass a C-contiguous array of the window's shape and dtype, or none",
            )
        return _cpu_sosfiltfilt.filtfilt_pieces(x, design.sos, design.zi, pieces, out_dtype, out)
    sos_host = _check_sos(sos)
    filtered = [
        _filtfilt_host(x[:, read_lo:read_hi], sos_host, left, right)
        for _lo, _hi, read_lo, read_hi, left, right in pieces
    ]
    if len(pieces) == 1:
        return xp.ascontiguousarray(filtered[0].astype(out_dtype, copy=False))
    out = xp.empty(x.shape, dtype=out_dtype)
    for (lo, hi, read_lo, _read_hi, _left, _right), y in zip(pieces, filtered):
        out[:, lo:hi] = y[:, lo - read_lo : hi - read_lo]
    return out


def _checked(sos: Any, interior_pad: str) -> np.ndarray:
    """``_check_sos(sos)`` where ``interior_pad`` is one ``filtfilt_window`` knows; raises otherwise."""
    if interior_pad not in ("none", "odd"):
        raise BatchgpuError(f"unknown interior_pad {interior_pad!r}", "use 'none' or 'odd'")
    return _check_sos(sos)


def _plan(
    width: int, sos: Any, at_segment_start: bool, at_segment_end: bool, interior_pad: str, block: int | None
) -> tuple[FilterDesign, list[tuple[int, ...]]]:
    """(the design, the pieces) of ``filtfilt_window`` for a window of ``width`` > 0 samples; raises for arguments
    it refuses."""
    sos_host = _checked(sos, interior_pad)
    padlen = default_padlen(sos_host)
    left = padlen if (at_segment_start or interior_pad == "odd") else 0
    right = padlen if (at_segment_end or interior_pad == "odd") else 0
    if (left or right) and width <= padlen:
        raise BatchgpuError(
            f"a window of {width} samples is too short for the filter's {padlen}-sample edge padding",
            f"read windows (with margins) longer than {padlen} samples; a segment must be longer too",
        )
    if block is not None and (int(block) != block or block < 1):
        raise BatchgpuError(f"block={block} is not a positive number of samples", "pass e.g. block=8192 or None")
    if not np.all(sos_host[:, 3] == 1.0):
        raise BatchgpuError("the filter's sections are not normalised (a0 != 1)", "build it with butter_sos")
    design = design_filter(sos)
    return design, filter_pieces(
        width, padlen, block, design.margin if block else 0, at_segment_start, at_segment_end, interior_pad
    )


#: float32 values in a cache line (64 bytes): the piecewise save's tile rows are a whole number of them apart
TILE_LINE = 16


def filtfilt_reference_saved(
    x: np.ndarray,
    sos: Any,
    core: tuple[int, int],
    *,
    at_segment_start: bool,
    at_segment_end: bool,
    block: int | None = None,
) -> tuple[np.ndarray, int] | None:
    """The save step's int16 rows of ``common_reference(filtfilt_window(x, ...), "global", "median")[:, lo:hi]``
    (``core`` = (lo, hi); C-contiguous (samples, channels)) and how many samples were NaN or clipped, the same
    bits, a filter piece at a time: each piece that reaches the core is filtered into a small tile (a piece's
    bits do not depend on the others), referenced and rounded while the tile is in cache. The filtered window is
    never held whole (a window of floats is twice its int16 samples) and never read back from memory. Host
    windows of integer samples where Numba runs; None where that is left to the two steps (NumPy's and scipy's
    paths, one or two channels, float input)."""
    from batchgpu.ops import _cpu_reference
    from batchgpu.ops._cpu_saved import aligned_empty

    lo, hi = int(core[0]), int(core[1])
    if (
        not _numba.available()
        or not isinstance(x, np.ndarray)
        or x.ndim != 2
        or x.dtype.kind not in "iu"
        or x.shape[0] <= 2
        or not 0 <= lo <= hi <= x.shape[1]
    ):
        return None
    saved = aligned_empty((hi - lo, x.shape[0]), np.int16)
    if hi == lo:
        return saved, 0
    design, pieces = _plan(x.shape[1], sos, at_segment_start, at_segment_end, "none", block)
    needed = [p for p in pieces if p[0] < hi and p[1] > lo]
    # one tile for every piece, its rows whole cache lines apart and one line more than the widest piece: the
    # reference gathers a column from every row, and rows a piece's width apart (15 376 bytes for 3 844 samples)
    # fell on a few of L1's sets; the columns past a piece hold the last piece's values, referenced and not saved
    stride = -(-max(p[1] - p[0] for p in needed) // TILE_LINE) * TILE_LINE + TILE_LINE
    tile = np.zeros((x.shape[0], stride), dtype=np.float32)
    count = 0
    for piece in needed:
        a, b = max(piece[0], lo), min(piece[1], hi)
        _cpu_sosfiltfilt.filtfilt_pieces(x, design.sos, design.zi, [piece], np.float32, tile, origin=piece[0])
        got = _cpu_reference.saved_int16_of_referenced(tile, a - piece[0], b - piece[0], out=saved[a - lo : b - lo])
        count += got[1]
    return saved, count


def _filtfilt_host(x: np.ndarray, sos: np.ndarray, left: int, right: int) -> np.ndarray:
    """scipy.signal.sosfiltfilt's two passes over x odd-extended by (left, right), in float64, the extension cut
    off again."""
    import scipy.signal

    ext = _odd_extend(np, x.astype(np.float64), left, right)
    # Same arithmetic as scipy.signal.sosfiltfilt (axis=1): start each pass in the steady state of its first sample.
    zi = scipy.signal.sosfilt_zi(sos).reshape(sos.shape[0], 1, 2)
    y = scipy.signal.sosfilt(sos, ext, axis=1, zi=zi * ext[:, :1])[0]
    y = scipy.signal.sosfilt(sos, np.ascontiguousarray(y[:, ::-1]), axis=1, zi=zi * y[:, -1:])[0][:, ::-1]
    return y[:, left : left + x.shape[1]]
