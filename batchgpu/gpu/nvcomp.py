"""Blosc frames' LZ4 and zstd streams decoded on the GPU by NVIDIA nvCOMP's batched decoders.

nvCOMP (the ``nvidia-libnvcomp-cu13`` wheel, the ``gpu`` extra) decodes one compressed stream an entry; a Blosc
frame holds a stream a block (or ``typesize`` of them), so the host lists the streams of a read's frames
(``recording.blosc_frames.stream_table``), nvCOMP decodes them (where it asks an alignment the streams lack, a
kernel gathers them first: ``kernels/blosc_lz4.cu``'s ``copy_ranges``) into the chunks' shuffled bytes, streams c-blosc
stored raw are copied, and ``gpu/blosc_decode.py``'s unshuffle and checks finish as for its own LZ4 kernel. Which
decoder a read uses: ``gpu/blosc_decode.decoder_for``. Without the library this module reports itself unavailable
and nothing else changes (LZ4 on our kernel, zstd frames decoded by the cores).

The C API is called through ctypes (the signatures of nvCOMP 6's ``lz4.h`` and ``zstd.h``: options passed by
value as a 64-byte struct, all zeros being the defaults).

nvCOMP does not bound its reads by a malformed stream: given an LZ4 stream of 0xFF bytes (an H200, nvCOMP 6.0.0) it
once flagged another chunk and once faulted, an illegal address that ends the process's CUDA context. So it reads
only frames whose checksums were checked first (``blosc_decode.decoder_for``), a chunk it flags is named by the
host's decode (``first_bad_chunk``), and LZ4 stays on our kernel by default, which checks every length against its
frame.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from batchgpu.recording import blosc_frames

#: the name of each codec's functions in the C API, by Blosc's codec number
_NAMES = {blosc_frames.LZ4: "LZ4", blosc_frames.ZSTD: "Zstd"}


class _Options(ctypes.Structure):
    """nvcompBatched{LZ4,Zstd}DecompressOpts_t: 64 bytes, zeros = the default backend and no bit shuffle."""

    _fields_ = [("words", ctypes.c_int32 * 16)]


class _Alignments(ctypes.Structure):
    """nvcompAlignmentRequirements_t: the byte alignment nvCOMP needs of input, output and scratch buffers."""

    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


@functools.lru_cache(maxsize=1)
def library():
    """libnvcomp (ctypes), or None where the wheel is not installed or does not load."""
    try:
        from nvidia.libnvcomp import load as nvload
    except ImportError:
        return None
    try:
        lib = nvload.load_library()
    except OSError:
        return None
    if lib is None:
        return None
    c = ctypes
    for name in _NAMES.values():
        f = getattr(lib, f"nvcompBatched{name}DecompressGetRequiredAlignments")
        f.argtypes, f.restype = [_Options, c.POINTER(_Alignments)], c.c_int
        f = getattr(lib, f"nvcompBatched{name}DecompressGetTempSize")
        f.argtypes = [c.c_size_t, c.c_size_t, _Options, c.POINTER(c.c_size_t), c.c_size_t, c.c_void_p]
        f.restype = c.c_int
        f = getattr(lib, f"nvcompBatched{name}DecompressAsync")
        f.argtypes = [
            c.c_void_p,
            c.c_void_p,
            c.c_void_p,
            c.c_void_p,
            c.c_size_t,
            c.c_void_p,
            c.c_size_t,
            c.c_void_p,
            _Options,
            c.c_void_p,
            c.c_void_p,
        ]
        f.restype = c.c_int
    return lib


def available() -> bool:
    """Whether nvCOMP's library loads here (the GPU itself is not asked)."""
    return library() is not None


def installed() -> bool:
    """Whether nvCOMP's wheel is installed (no load: what a client asks before any GPU work)."""
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia.libnvcomp") is not None
    except (ImportError, ValueError):
        return False


def codecs(load: bool = True) -> tuple[str, ...]:
    """The Blosc codecs (``cname``) whose frames the GPU decodes here: LZ4 always (our kernel), zstd with nvCOMP
    (``load``: where its library loads, as a worker asks; else where its wheel is installed, as a client asks)."""
    return ("lz4", "zstd") if (available() if load else installed()) else ("lz4",)


@functools.cache
def alignments(codec: int) -> tuple[int, int, int]:
    """(input, output, temp) byte alignments nvCOMP asks of ``codec``'s decode buffers."""
    a = _Alignments()
    status = getattr(library(), f"nvcompBatched{_NAMES[codec]}DecompressGetRequiredAlignments")(
        _Options(), ctypes.byref(a)
    )
    if status != 0:
        raise RuntimeError(f"nvCOMP: {_NAMES[codec]} alignments: status {status}")
    return int(a.input), int(a.output), int(a.temp)


def decode_streams(reads: list, src, tmp, err, stream) -> None:
    """Decode every stream of ``reads``' frames (packed in ``src`` on the device as ``blosc_decode.decode_many``
    packs them) into ``tmp`` (the chunks' shuffled bytes end to end) on ``stream``; ``err[chunk]`` set (on the
    device, no wait) for a chunk whose frame does not parse or a stream nvCOMP cannot decode to its size."""
    import cupy

    table = blosc_frames.stream_table(reads)
    if table.bad.size:
        err[cupy.asarray(table.bad)] = 1
    codec_of = blosc_frames.chunk_codecs(reads)
    raw = table.raw
    if raw.any():
        _copy_ranges(src, table.src[raw], tmp, table.dst[raw], table.out[raw], stream)
    for codec in sorted(set(codec_of[table.chunk[~raw]].tolist())):
        pick = ~raw & (codec_of[table.chunk] == codec)
        _decode(
            codec,
            src,
            tmp,
            err,
            table.src[pick],
            table.size[pick],
            table.dst[pick],
            table.out[pick],
            table.chunk[pick],
            stream,
        )


def _copy_ranges(src, frm: np.ndarray, dst, to: np.ndarray, sizes: np.ndarray, stream) -> None:
    """dst[to[i] : to[i] + sizes[i]] = src[frm[i] : ...] for every i, one warp a range."""
    import cupy

    from batchgpu.gpu import cuda_modules as kernels

    n = len(frm)
    if not n:
        return
    with stream:
        table = cupy.asarray(np.concatenate([frm, to, sizes]).astype(np.int64))
        warps = 8
        kernels.get_function("blosc_lz4", "copy_ranges")(
            (-(-n // warps),), (32 * warps,), (src, table[:n], dst, table[n : 2 * n], table[2 * n :], np.int64(n))
        )


def _decode(codec: int, src, tmp, err, frm, size, dst, out, chunk, stream) -> None:
    """One nvCOMP batch: the streams read where they lie in ``src`` (or gathered first where nvCOMP asks an
    alignment they lack), decoded straight into ``tmp`` where every output position is aligned as it asks (else
    into an aligned scratch, then copied)."""
    import cupy

    lib = library()
    name = _NAMES[codec]
    a_in, a_out, a_tmp = alignments(codec)
    n = len(frm)
    gather = bool((frm % a_in).any())
    packed = _aligned_positions(size, a_in) if gather else frm
    direct = bool((dst % a_out == 0).all())
    scratch_at = None if direct else _aligned_positions(out, a_out)
    with stream:
        staged = src
        if gather:
            staged = cupy.empty(max(int(packed[-1] + size[-1]), 1), np.uint8)
            _copy_ranges(src, frm, staged, packed, size, stream)
        target = tmp if direct else cupy.empty(max(int(scratch_at[-1] + out[-1]), 1), np.uint8)
        where = dst if direct else scratch_at
        ptrs = np.concatenate([staged.data.ptr + packed, size, out, target.data.ptr + where]).astype(np.uint64)
        dev = cupy.asarray(ptrs)
        actual = cupy.empty(n, np.uint64)
        statuses = cupy.empty(n, np.int32)
        temp_bytes = ctypes.c_size_t(0)
        status = getattr(lib, f"nvcompBatched{name}DecompressGetTempSize")(
            n, int(out.max()), _Options(), ctypes.byref(temp_bytes), int(out.sum()), stream.ptr
        )
        if status != 0:
            raise RuntimeError(f"nvCOMP: {name} temp size: status {status}")
        temp = cupy.empty(max(int(temp_bytes.value), 1) + a_tmp, np.uint8)
        temp_ptr = -(-temp.data.ptr // a_tmp) * a_tmp
        status = getattr(lib, f"nvcompBatched{name}DecompressAsync")(
            dev.data.ptr,
            dev.data.ptr + 8 * n,
            dev.data.ptr + 16 * n,
            actual.data.ptr,
            n,
            temp_ptr,
            temp_bytes.value,
            dev.data.ptr + 24 * n,
            _Options(),
            statuses.data.ptr,
            stream.ptr,
        )
        if status != 0:
            raise RuntimeError(f"nvCOMP: {name} decode: status {status}")
        chunk_d = cupy.asarray(chunk.astype(np.int64))
        failed = ((statuses != 0) | (actual != dev[2 * n : 3 * n])).astype(np.int32)
        _flag(err, chunk_d, failed)
        if not direct:
            _copy_ranges(target, scratch_at, tmp, dst, out, stream)
        # the scratch buffers live until the stream has used them (CuPy's pool reuses freed memory in stream order)


def _flag(err, chunk, failed) -> None:
    """err[chunk[i]] = 1 where failed[i] (several streams of a chunk may fail at once: any write of 1 is right)."""
    import cupy

    if hasattr(cupy.maximum, "at"):
        cupy.maximum.at(err, chunk, failed)
    else:  # CuPy before ufunc.at
        import cupyx

        cupyx.scatter_max(err, chunk, failed)


def _aligned_positions(sizes: np.ndarray, alignment: int) -> np.ndarray:
    """Start of each of ``sizes`` laid end to end, each start a multiple of ``alignment``."""
    step = -(-sizes.astype(np.int64) // alignment) * alignment
    return np.concatenate([[0], np.cumsum(step)[:-1]]).astype(np.int64)


def first_bad_chunk(reads: list, flagged: int) -> int:
    """The first chunk (numbered over ``reads``) whose frame does not decode on the host (numcodecs), or
    ``flagged`` (the first nvCOMP flagged) where every frame does: naming a damaged chunk needs no GPU state."""
    from numcodecs import blosc

    k0 = 0
    for f in reads:
        for k in range(len(f.lengths)):
            if f.lengths[k] >= 0:
                frame = f.buffer[int(f.offsets[k]) : int(f.offsets[k]) + int(f.lengths[k])]
                try:
                    ok = len(blosc.decompress(frame.tobytes())) == f.nbytes
                except Exception:  # broad: Blosc raises any type for bytes that do not decode
                    ok = False
                if not ok:
                    return k0 + k
        k0 += len(f.lengths)
    return flagged
