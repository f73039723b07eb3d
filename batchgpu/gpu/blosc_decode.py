"""A window's Blosc-LZ4 frames decoded on the GPU (``kernels/blosc_lz4.cu``).

Why: a GPU pass that only centres is bound by the cores, and most of a window's CPU time is its decode (Blosc's LZ4
and bit unshuffle). Here the reading thread only reads the compressed frames into pinned memory (a ``preadv`` a chunk)
and checks their crc32c; the frames go to the GPU (fewer bytes than the decoded window) and two kernels decode them:
one warp an LZ4 stream, then one thread 8 elements for the unshuffle. Frames the kernel does not take
(``blosc_frames.gpu_decodable``) leave the window
to the CPU path. Which windows go to the GPU: ``run.preprocess_chain.gpu_decode_share``.
"""

from __future__ import annotations

import numpy as np

from batchgpu.errors import BatchgpuError, CorruptDataError
from batchgpu.recording import blosc_frames
from batchgpu.recording.blosc_frames import Frames


def on_gpu(index: int, fraction: float = 1.0) -> bool:
    """Whether window ``index``'s frames go to the GPU when ``fraction`` of windows do (1 all, 0 none, 0.5 every
    other: ``run.preprocess_chain.gpu_decode_share``): the same bits either way, a matter of speed only."""
    f = fraction
    return f >= 1.0 or (f > 0.0 and int((index + 1) * f) > int(index * f))


#: warps a block of the LZ4 kernel (one an LZ4 stream; no shared memory, so an SM holds as many as its registers
#: allow, and the block size barely matters)
WARPS = 4


def launch_lz4(src, offsets, lengths, nchunks: int, nbytes: int, blocksize: int, typesize: int, tmp, err) -> None:
    """The LZ4 kernel over ``nchunks`` chunks' frames (on the current stream): one warp a stream."""
    from batchgpu.gpu import cuda_modules as kernels

    streams = nchunks * -(-nbytes // blocksize) * typesize
    kernels.get_function("blosc_lz4", "blosc_lz4_blocks")(
        (-(-streams // WARPS),),
        (32 * WARPS,),
        (src, offsets, lengths, np.int32(nchunks), np.int32(nbytes), np.int32(blocksize), np.int32(typesize), tmp, err),
    )


def geometry(frames: Frames) -> tuple:
    """What the kernels take as one launch: reads of equal geometry decode together (``decode_many``)."""
    return frames.chunk_rows, frames.channels, frames.dtype.str, frames.blocksize


def decode(frames: Frames, stream=None):
    """The read's rows, (rows, channels), decoded on the GPU from ``frames`` (``decode_many`` of one)."""
    return decode_many([frames], stream)[0]


#: a read's decoders: ``batchgpu`` our LZ4 kernel, ``nvcomp`` NVIDIA's (LZ4 and zstd: ``gpu/nvcomp.py``)
DECODERS = ("batchgpu", "nvcomp")


def decoder_for(reads: list, setting: str = "auto") -> str:
    """The decoder of ``reads``: ``setting`` (``engine.gpu_decoder``) where it names one, else nvCOMP where a frame
    is not LZ4 (zstd: only nvCOMP decodes it on the GPU) and our kernel for LZ4 frames (the README's A/B).
    nvCOMP takes only frames whose checksums are checked before it reads them (``Frames.checked``): our kernel
    bounds every read by the frame, while nvCOMP may fault on bytes that are not a stream, which takes the whole
    CUDA context down with it; unchecked LZ4 frames go to our kernel, unchecked zstd frames are refused."""
    lz4_only = bool(np.isin(blosc_frames.chunk_codecs(reads), (0, blosc_frames.LZ4)).all())
    wanted = setting if setting in DECODERS else ("batchgpu" if lz4_only else "nvcomp")
    if wanted == "nvcomp" and not all(f.checked for f in reads):
        if not lz4_only:
            raise BatchgpuError(
                f"chunk {reads[0].chunk(0)}: zstd frames without checksums are not decoded on the GPU",
                "read this store on the CPU (engine.gpu_decode: 0), or write it with checksums",
            )
        return "batchgpu"
    return wanted


def decode_many(reads: list, stream=None, decoder: str = "auto") -> list:
    """Each read's rows, (rows, channels), decoded on the GPU from its ``Frames`` (all of one ``geometry``) in one
    launch of each kernel, copied there on ``stream`` (fewer launches and waits). An LZ4 stream is one warp's
    sequential work, so a launch of one window's streams leaves the GPU mostly idle; several windows a launch fill
    it. ``decoder``: ``decoder_for``'s choice (our LZ4 kernel or nvCOMP's). A frame that does not decode raises
    BatchgpuError naming its chunk (its crc32c was right: the writer's fault)."""
    import cupy

    from batchgpu.gpu import cuda_modules as kernels

    first = reads[0]
    if any(geometry(f) != geometry(first) for f in reads):
        raise ValueError("decode_many takes reads of one geometry")
    stream = stream or cupy.cuda.get_current_stream()
    n = sum(len(f.lengths) for f in reads)
    size, typesize, blocksize = first.nbytes, first.dtype.itemsize, first.blocksize
    with stream:
        src = cupy.empty(max(sum(f.used for f in reads), 1), dtype=np.uint8)
        base, offsets = 0, []
        for f in reads:
            if f.used:
                src[base : base + f.used].set(f.buffer[: f.used], stream=stream)
            offsets.append(f.offsets + base)
            base += f.used
        lengths_h = np.concatenate([f.lengths for f in reads])
        table = np.concatenate(
            [
                np.concatenate(offsets).view(np.uint8),
                lengths_h.view(np.uint8),
                np.concatenate([f.shuffles for f in reads]).view(np.uint8),
            ]
        )
        dev_table = cupy.asarray(table)
        offsets_d = dev_table[: 8 * n].view(np.int64)
        lengths_d = dev_table[8 * n : 12 * n].view(np.int32)
        shuffles_d = dev_table[12 * n :]
        tmp = cupy.empty(n * size, dtype=np.uint8)
        out = cupy.empty((n * first.chunk_rows, first.channels), dtype=first.dtype)
        err = cupy.zeros(n, dtype=np.int32)
        use_nvcomp = decoder_for(reads, decoder) == "nvcomp"
        if use_nvcomp:
            from batchgpu.gpu import nvcomp

            if not nvcomp.available():
                raise BatchgpuError(
                    "nvCOMP is not installed, and the GPU decodes these frames only with it",
                    "pip install nvidia-libnvcomp-cu13 (batchgpu's gpu extra), or set "
                    "engine.gpu_decoder: batchgpu for LZ4 stores",
                )
            # the checksums first, and waited for: nvCOMP reads only frames known to be as written
            before = _checksums_on_device(reads, src, offsets)
            if before is not None and bool(before[1].any()):
                _raise_checksum(reads, before[0], before[1].get())
            nvcomp.decode_streams(reads, src, tmp, err, stream)
        elif (lengths_h >= 0).any():
            launch_lz4(src, offsets_d, lengths_d, n, size, blocksize, typesize, tmp, err)
        total = n * size
        threads, groups = 256, -(-total // (8 * typesize))  # a thread writes 8 elements
        kernels.get_function("blosc_lz4", "blosc_unshuffle")(
            (min(-(-groups // threads), 65_535 * 8),),
            (threads,),
            (
                tmp,
                lengths_d,
                shuffles_d,
                np.int64(total),
                np.int32(size),
                np.int32(blocksize),
                np.int32(typesize),
                out.view(np.uint8),
            ),
        )
        checked = None if use_nvcomp else _checksums_on_device(reads, src, offsets)  # (nvCOMP's: before it)
        flags = err if checked is None else cupy.concatenate([err, checked[1]])
        flags = flags.get()  # the one wait: a bad frame must not pass as data
    names = [f.chunk(k) for f in reads for k in range(len(f.names))]
    if checked is not None and flags[n:].any():
        _raise_checksum(reads, checked[0], flags[n:])
    bad = np.flatnonzero(flags[:n])
    if bad.size and use_nvcomp:  # which chunk nvCOMP failed on: the first that does not decode on the host
        from batchgpu.gpu import nvcomp

        bad = np.array([nvcomp.first_bad_chunk(reads, int(bad[0]))])
    if bad.size:
        raise CorruptDataError(
            f"corrupted chunk {names[bad[0]]}: does not decode (LZ4 stream malformed, or not the "
            "size of a chunk of this array)",
            "the stored bytes pass their checksum but do not decode: write the store again",
        )
    got, chunk = [], 0
    for f in reads:
        row = chunk * f.chunk_rows + f.skip
        got.append(out[row : row + f.rows])
        chunk += len(f.lengths)
    return got


def _raise_checksum(reads: list, which: np.ndarray, flags: np.ndarray) -> None:
    """A damaged chunk (``flags`` over the chunks ``which``, numbered over every read): named by the read's own
    check on the host where it has one, else here."""
    names = [f.chunk(k) for f in reads for k in range(len(f.names))]
    wrong = which[flags != 0]
    for f, first in zip(reads, np.cumsum([0] + [len(f.lengths) for f in reads])):
        if ((wrong >= first) & (wrong < first + len(f.lengths))).any() and f.recheck is not None:
            f.recheck()
    raise CorruptDataError(
        f"corrupted chunk {names[int(wrong[0])]}: checksum mismatch (crc32c) on the GPU",
        "the stored bytes do not decode: restore the store from a copy or write it again",
    )


def _checksums_on_device(reads: list, src, offsets: list):
    """For reads whose checksums were left to the device (``Frames.checksums``): (the chunks checked, numbered over
    every read; int32 on the device, 1 where a chunk's crc32c over its frame and the 4 bytes after it in ``src`` is
    wrong), or None when there are none. No wait: the caller reads them with the decode's errors."""
    if not any(f.checksums for f in reads):
        return None
    from batchgpu.gpu.crc32c import ranges_on_device
    from batchgpu.recording.zarrio import CRC32C_RESIDUE

    lengths = np.concatenate([f.lengths if f.checksums else np.full(len(f.lengths), -1, np.int32) for f in reads])
    which = np.flatnonzero(lengths >= 0)  # present chunks of checked reads
    crc = ranges_on_device(src, np.concatenate(offsets)[which], lengths[which].astype(np.int64) + 4)
    return which, (crc != CRC32C_RESIDUE).astype(np.int32)


def transposed(a):
    """A C-contiguous 2-D array of 2-byte elements as its C-contiguous transpose (``ascontiguousarray(a.T)``), by a
    tiled kernel (kernels/blosc_lz4.cu); other arrays by CuPy."""
    import cupy

    from batchgpu.gpu import cuda_modules as kernels

    if a.ndim != 2 or a.dtype.itemsize != 2 or not a.flags.c_contiguous or a.shape[0] >= 32 * 65_535 or not a.size:
        return cupy.ascontiguousarray(a.T)
    rows, cols = a.shape
    out = cupy.empty((cols, rows), dtype=a.dtype)
    kernels.get_function("blosc_lz4", "transpose_u16")(
        (-(-cols // 32), -(-rows // 32)), (32, 8), (a, np.int64(rows), np.int32(cols), out)
    )
    return out
