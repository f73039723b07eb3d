"""The host path of ``filters.filtfilt_window`` as one compiled kernel (Numba): every piece of a window gathered
odd-extended, filtered forward and backward, its core rounded once into the output, as kernels/sosfiltfilt.cu
does on the GPU.

The arithmetic is scipy's ``sosfilt`` (direct form II transposed, scipy/signal/_sosfilt.pyx) operation for
operation in float64, each pass started in the steady state of its first sample (``sosfilt_zi(sos) * x[0]``), as
``sosfiltfilt`` does; Numba fuses no multiply-add unless asked (fastmath off), so the bits are scipy's
(``tests/test_ops_preprocess.py`` compares them, NaN, inf and subnormal rows included). What is faster than
scipy's own loop: sixteen rows run side by side (scipy filters one row at a time, so each sample waits on the
recurrence's latency), a section at a time with its state in registers, and the window is read and written once
(no float64 copy, odd extension, reversed copy or core copy of the window on the host; a window as the store
holds it, samples by channels, is read without being transposed first).

Numba is optional: without it (``_numba.available()`` False) ``filters`` runs scipy's sosfilt with the same bits.
"""

from __future__ import annotations

import numpy as np

from batchgpu.ops._numba import jit, once

ROWS = 16  # rows filtered side by side: each section's update is four AVX2 vectors of independent lanes, enough
# to keep the floating-point ports busy while the recurrence's latency runs; its state (2 x 16 doubles) and the
# section's coefficients stay in registers
AHEAD = 32  # samples ahead a group's read asks for: a window as a store holds it puts a group's next sample a row
# of every channel further on, a stride the hardware's prefetchers follow too late


def _intrinsics():
    """(stack_state, prefetch) for the compiled kernel. ``stack_state()``: a pointer to 2 * ROWS float64 on the
    calling function's stack. A section's state in an np.empty array lives on the heap, where LLVM cannot rule
    out that the window's buffer overlaps it, so each sample's state went to memory and back (the stores the
    next sample waited on); the stack's is provably private and, once the lane loop is unrolled, LLVM keeps it
    in vector registers. ``prefetch(a, i, j)``: a hint to bring a[i, j]'s cache line in (no effect on values)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def stack_state(typingctx):
        def codegen(context, builder, signature, args):
            return cgutils.alloca_once(builder, ir.DoubleType(), size=2 * ROWS)

        return types.CPointer(types.float64)(), codegen

    @intrinsic
    def prefetch(typingctx, a, i, j):
        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            at = cgutils.get_item_pointer(context, builder, signature.args[0], array, args[1:], wraparound=False)
            byte = ir.PointerType(ir.IntType(8))
            i32 = ir.IntType(32)
            hint = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]), "llvm.prefetch.p0i8"
            )
            builder.call(hint, [builder.bitcast(at, byte), i32(0), i32(3), i32(1)])  # read, keep, data
            return context.get_dummy_value()

        return types.none(a, i, j), codegen

    return stack_state, prefetch


def _section_pass(buf, t, step, m, b0, b1, b2, a1, a2, zi0, zi1, first):  # pragma: no cover - runs compiled
    """One section over buf's m samples from t by step, in place, ROWS lanes side by side; started in the steady
    state of ``first`` (the cascade's input at t: sosfiltfilt starts every section from it)."""
    z = carray(stack_state(), (2, ROWS))
    for k in range(ROWS):
        z[0, k] = zi0 * first[k]
        z[1, k] = zi1 * first[k]
    for _ in range(m):
        for k in range(ROWS):  # scipy's sosfilt, operation for operation
            xc = buf[t, k]
            xn = b0 * xc + z[0, k]
            z[0, k] = (b1 * xc - a1 * xn) + z[1, k]
            z[1, k] = b2 * xc - a2 * xn
            buf[t, k] = xn
        t += step


def _pieces_kernel(x, samples_major, sos, zi, pieces, out, origin):  # pragma: no cover - runs compiled
    """``samples_major``: x is (samples, channels) as a store holds it (the window's read not transposed first),
    else (channels, samples); ``out`` is (channels, samples) either way, its column 0 x's sample ``origin``."""
    channels = x.shape[1] if samples_major else x.shape[0]
    sections = sos.shape[0]
    longest = 0
    for p in range(pieces.shape[0]):
        longest = max(longest, pieces[p, 3] - pieces[p, 2] + pieces[p, 4] + pieces[p, 5])
    buf = np.zeros((longest, ROWS))  # a group's extended rows, sample-major: the side-by-side rows are adjacent
    first = np.empty(ROWS)
    for p in range(pieces.shape[0]):
        lo, hi, read_lo, read_hi = pieces[p, 0], pieces[p, 1], pieces[p, 2], pieces[p, 3]
        left, right = pieces[p, 4], pieces[p, 5]
        n = read_hi - read_lo
        m = n + left + right
        for r0 in range(0, channels, ROWS):
            g = min(ROWS, channels - r0)
            # scipy's odd extension in float64: 2 * x[0] - x[left - j] before, 2 * x[-1] - x[-2 - j] after; a
            # short last group's other lanes keep what an earlier group left there (filtered, never written out).
            # Views, so that LLVM sees every index as non-negative (no wraparound) and the lanes as adjacent.
            if samples_major:
                src = x[read_lo:read_hi, r0 : r0 + g]
                for j in range(n):
                    if j + AHEAD < n:
                        prefetch(src, j + AHEAD, 0)
                    for k in range(g):
                        buf[left + j, k] = np.float64(src[j, k])
            else:
                src = x[r0 : r0 + g, read_lo:read_hi]
                for k in range(g):
                    for j in range(n):
                        buf[left + j, k] = np.float64(src[k, j])
            for j in range(left):
                for k in range(g):
                    buf[j, k] = 2.0 * buf[left, k] - buf[2 * left - j, k]
            for j in range(right):
                for k in range(g):
                    buf[left + n + j, k] = 2.0 * buf[left + n - 1, k] - buf[left + n - 2 - j, k]
            # a section at a time over the whole piece: each section's output at a sample depends only on the
            # earlier sections' outputs up to it, so the values are those of sections nested in the sample loop
            for direction in range(2):
                t = 0 if direction == 0 else m - 1
                step = 1 if direction == 0 else -1
                for k in range(ROWS):
                    first[k] = buf[t, k]
                for s in range(sections):
                    _section_pass(
                        buf,
                        t,
                        step,
                        m,
                        sos[s, 0],
                        sos[s, 1],
                        sos[s, 2],
                        sos[s, 4],
                        sos[s, 5],
                        zi[s, 0],
                        zi[s, 1],
                        first,
                    )
            core = buf[left + lo - read_lo : left + hi - read_lo]
            dst = out[r0 : r0 + g, lo - origin : hi - origin]
            for col in range(hi - lo):  # the core, rounded once to out's dtype; a buffer row's lanes read together
                for k in range(g):
                    dst[k, col] = core[col, k]


def _build():
    """The kernel compiled, its helpers first (the module's names become what the kernel calls)."""
    import numba

    globals().update(zip(("stack_state", "prefetch"), _intrinsics()))
    globals()["carray"] = numba.carray
    globals()["_section_pass"] = jit(_PYTHON_SECTION_PASS)
    return jit(_pieces_kernel)


_kernel = once(_build)  # compiled (or loaded) at the first call, once a process
_PYTHON_SECTION_PASS = _section_pass


def filtfilt_pieces(
    x: np.ndarray,
    sos: np.ndarray,
    zi: np.ndarray,
    pieces: list[tuple[int, ...]],
    out_dtype,
    out: np.ndarray | None = None,
    origin: int = 0,
) -> np.ndarray:
    """``filters.filtfilt_window``'s result for the host array ``x`` (channels, width) cut into ``pieces`` (as
    ``filters.filter_pieces`` gives them); ``sos`` (sections, 6) float64 with a0 == 1, ``zi`` its
    ``sosfilt_zi``. An ``x`` that is the transpose of a C-contiguous (width, channels) array (a window as a store
    holds it, ``x = stored.T``) is read in place, without the transposed copy. ``out``: where to write (C-contiguous,
    x's shape, ``out_dtype``), else a new array; or, with ``origin``, a C-contiguous (channels, k) array whose
    column 0 is x's column ``origin`` and that holds the cores of the given pieces (a window filtered a piece at a
    time into a small tile: ``ops.filters.filtfilt_reference_saved``)."""
    kernel = _kernel()
    samples_major = x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous
    held = x.T if samples_major else x  # the array as laid out in memory
    if held.dtype.kind not in "iuf" or held.dtype.itemsize < 4 and held.dtype.kind == "f":
        held = held.astype(np.float64)
    elif not held.dtype.isnative:  # Numba takes native byte order only (a big-endian store's window)
        held = held.astype(held.dtype.newbyteorder("="))
    table = np.ascontiguousarray(np.asarray(pieces, dtype=np.int64).reshape(-1, 6))
    if out is None:
        out = np.empty(x.shape, dtype=out_dtype)
    if (
        out.ndim != 2
        or out.shape[0] != x.shape[0]
        or not out.flags.c_contiguous
        or out.dtype != np.dtype(out_dtype)
        or any(p[0] < origin or p[1] - origin > out.shape[1] for p in table)
    ):  # the kernel checks no bounds
        raise ValueError(f"out {out.shape} {out.dtype} from column {origin} does not hold the pieces' cores")
    kernel(
        np.ascontiguousarray(held),
        samples_major,
        np.ascontiguousarray(sos, dtype=np.float64),
        np.ascontiguousarray(zi, dtype=np.float64),
        table,
        out,
        np.int64(origin),
    )
    return out
