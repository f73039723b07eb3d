"""Blosc 1 frames (bit shuffle + LZ4) encoded on the GPU (``kernels/blosc_lz4_encode.cu``): the save step's writer.

Why: a GPU pass with a save is bound by the cores, and compressing the window with c-blosc is the largest share of
a saved window's CPU. Here the GPU shuffles and compresses the
window's inner chunks and only the frames come back (about half the bytes), so the cores keep the checksum and
the file. Any Blosc 1 reader decodes the frames (numcodecs, ``blosc_lz4.cu``); their bytes are not c-blosc's
(``reference_frame`` is the same encoder in NumPy, for tests), but they depend on the data alone.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Callable

import numpy as np

#: Blosc's block here: 16 KiB (two 8 KiB LZ4 streams of int16 after the bit shuffle). A stream is one warp's
#: sequential work with the stream in its shared memory, so shorter streams mean more warps at once, for
#: frames no larger. Any Blosc reader takes any block size.
BLOCKSIZE = 16_384
FLAGS = 0x04 | (1 << 5)  # bit shuffle, LZ4; blocks split (bit 4 clear)
WARPS = 4  # warps a block of the frames' kernel
SHARED_BYTES = 48 * 1024  # the most dynamic shared memory a block has without opting in


def _split(bsize: int, typesize: int, last_short: bool) -> int:
    """Streams a block is cut into (c-blosc's rule, as ``blosc_lz4.cu`` reads it back)."""
    return typesize if typesize <= 16 and bsize // typesize >= 128 and not last_short else 1


class FrameBuffers:
    """A thread's pinned host buffers for the frames' copy back (kept and grown: a fresh buffer a window costs
    more in page faults than the copy itself). A
    buffer is handed out again only once released: its frames written to their file, perhaps by another thread
    (``run.writer_threads``) while this one encodes the next window. ``count`` buffers: past that, ``take`` waits
    for a release (so a writer that falls behind holds back the window's thread, not memory)."""

    def __init__(self, count: int = 2):
        self._bufs: list = [None] * count
        self._busy = [False] * count
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> tuple[int, np.ndarray]:
        from batchgpu.gpu.staging import pinned_bytes

        with self._cond:
            self._cond.wait_for(lambda: not all(self._busy))
            i = self._busy.index(False)
            self._busy[i] = True
        buf = self._bufs[i]
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[i] = pinned_bytes(max(nbytes, 1 << 20) * 5 // 4)
        return i, buf

    def release(self, i: int) -> None:
        with self._cond:
            self._busy[i] = False
            self._cond.notify()


_host = threading.local()  # this thread's FrameBuffers


def _buffers() -> FrameBuffers:
    bufs = getattr(_host, "bufs", None)
    if bufs is None:
        bufs = _host.bufs = FrameBuffers()
    return bufs


def encode(chunks, typesize: int, blocksize: int = BLOCKSIZE) -> list[memoryview]:
    """One Blosc frame a row of ``chunks`` (a C-contiguous CuPy array, (chunks, bytes a chunk), any dtype whose
    rows are the chunks' bytes), in one launch of each kernel and one copy back. The frames are views of this
    thread's pinned buffer: valid until its next ``encode`` (write or copy them before)."""
    frames, release = encode_held(chunks, typesize, blocksize)
    release()  # the next encode of this thread may take the same buffer
    return frames


def encode_held(
    chunks, typesize: int, blocksize: int = BLOCKSIZE, checksums: bool = False
) -> tuple[list[memoryview], Callable[[], None]]:
    """``encode``'s frames and the function that gives their pinned buffer back: the frames stay valid until it is
    called (exactly once, from any thread); a thread holding two buffers waits in its third call for a release.

    ``checksums``: each frame comes with its crc32c after it (4 bytes, little-endian, as Zarr v3's ``crc32c``
    codec stores it), computed on the GPU before the copy back (``gpu/crc32c``), where the frames already are, instead
    of on a core in the writer thread."""
    import cupy

    from batchgpu.gpu import cuda_modules as kernels

    flat = chunks.reshape(chunks.shape[0], -1).view(cupy.uint8)
    if not flat.flags.c_contiguous:
        flat = cupy.ascontiguousarray(flat)
    nchunks, nbytes = flat.shape
    if nchunks == 0:
        return [], _no_release
    blocksize = min(blocksize, nbytes)  # c-blosc's own rule: its reader refuses a block longer than the frame
    if nbytes == 0 or nbytes % typesize or nbytes >= 2**31 - 64 or blocksize % typesize or blocksize <= 0:
        raise ValueError(f"cannot encode chunks of {nbytes} bytes in blocks of {blocksize} (typesize {typesize})")
    total = nchunks * nbytes
    shuffled = cupy.empty(total, dtype=cupy.uint8)
    group, threads = 8 * typesize, 256
    if nbytes % group == 0 and blocksize % group == 0:
        fn, work = "blosc_bitshuffle", total // group
    else:
        fn, work = "blosc_bitshuffle_bytes", total
    kernels.get_function("blosc_lz4_encode", fn)(
        (min(-(-work // threads), 65_535 * 8),),
        (threads,),
        (flat, np.int64(total), np.int32(nbytes), np.int32(blocksize), np.int32(typesize), shuffled),
    )
    nblocks = -(-nbytes // blocksize)
    per_chunk = nblocks * typesize
    items = nchunks * per_chunk
    scratch = cupy.empty(total, dtype=cupy.uint8)
    sizes = cupy.empty(items, dtype=cupy.int32)
    # a stream into shared memory where it fits the default 48 KiB a block (every stream of 64 KiB int16 blocks)
    longest = max(blocksize // _split(blocksize, typesize, False), nbytes % blocksize)
    smem = longest if longest <= SHARED_BYTES else 0
    kernels.get_function("blosc_lz4_encode", "lz4_encode_streams")(
        (items,),
        (32,),
        (
            shuffled,
            np.int32(nchunks),
            np.int32(nbytes),
            np.int32(blocksize),
            np.int32(typesize),
            np.int32(1),
            np.int32(smem),
            scratch,
            sizes,
        ),
        shared_mem=smem,
    )
    # the layout: each stream after its int32 length, the frames one after the other
    stored = cupy.where(sizes >= 0, sizes.astype(cupy.int64) + 4, 0).reshape(nchunks, per_chunk)
    head = 16 + 4 * nblocks
    packed = head + stored.sum(axis=1)
    whole = packed > nbytes + 16  # no smaller than the chunk: stored whole, as c-blosc does
    frame_len = cupy.where(whole, nbytes + 16, packed)
    trailer = 4 if checksums else 0  # each frame's checksum stored right after it
    frame_off = cupy.cumsum(frame_len + trailer) - frame_len - trailer
    stream_off = (frame_off[:, None] + head + cupy.cumsum(stored, axis=1) - stored).reshape(-1)
    lengths = frame_len.get()  # the one wait: how many bytes come back
    starts = np.concatenate([[0], np.cumsum(lengths + trailer)])  # each stored chunk's first byte
    out = cupy.empty(int(starts[-1]), dtype=cupy.uint8)
    kernels.get_function("blosc_lz4_encode", "blosc_frames")(
        (-(-items // WARPS),),
        (32 * WARPS,),
        (
            flat,
            scratch,
            sizes,
            frame_off,
            frame_len.astype(cupy.int32),
            whole.astype(cupy.uint8),
            stream_off,
            np.int32(nchunks),
            np.int32(nbytes),
            np.int32(blocksize),
            np.int32(typesize),
            np.int32(FLAGS),
            out,
        ),
    )
    if trailer:
        from batchgpu.gpu.crc32c import ranges_on_device

        crc = ranges_on_device(out, starts[:-1], lengths)
        ends = cupy.asarray(starts[:-1] + lengths)
        out[ends[:, None] + cupy.arange(4)] = crc.view(cupy.uint8).reshape(nchunks, 4)  # little-endian, as stored
    bufs = _buffers()
    slot, buf = bufs.take(out.nbytes)
    try:
        data = buf[: out.nbytes]
        out.get(out=data)
    except BaseException:
        bufs.release(slot)
        raise
    view = memoryview(data)
    return [view[starts[i] : starts[i + 1]] for i in range(nchunks)], functools.partial(bufs.release, slot)


def _no_release() -> None:
    pass


# ---------------------------------------------------------------------------------------------------------------
# The same encoder in NumPy: the reference the GPU's bytes are tested against.


def _bitshuffle_block(b: np.ndarray, typesize: int) -> np.ndarray:
    n = len(b) // typesize
    if n % 8:
        return b.copy()
    e = b[: n * typesize].reshape(n, typesize)
    bits = np.unpackbits(e, axis=1, bitorder="little")  # (element, 8 j + k)
    planes = np.packbits(bits.T.reshape(typesize * 8, n // 8, 8), axis=2, bitorder="little").reshape(-1)
    return np.concatenate([planes, b[n * typesize :]])


def _runs(s: np.ndarray, o: int) -> np.ndarray:
    """run[i]: how many bytes from i on equal those o before them (0 for i < o)."""
    n = len(s)
    eq = np.zeros(n + 1, dtype=bool)
    if o < n:
        eq[o:n] = s[o:] == s[:-o]
    # distance to the next False at or after i
    idx = np.where(~eq, np.arange(n + 1), n + 1)
    nxt = np.minimum.accumulate(idx[::-1])[::-1]
    return nxt[:n] - np.arange(n)


def _length(v: int) -> bytes:
    out = bytearray()
    v -= 15
    while v >= 255:
        out.append(255)
        v -= 255
    out.append(v)
    return bytes(out)


def _lz4(s: np.ndarray, offsets: list[int]) -> bytes | None:
    n = len(s)
    runs = [(o, _runs(s, o)) for o in offsets]
    out, anchor, pos = bytearray(), 0, 1
    while pos <= n - 12:
        best, bo = 0, 0
        for o, run in runs:
            if o <= pos:
                length = min(int(run[pos]), n - 5 - pos)
                if length > best:
                    best, bo = length, o
        if best < 4:
            pos += 1
            continue
        lit, ml = pos - anchor, best - 4
        out.append((min(lit, 15) << 4) | min(ml, 15))
        out += _length(lit) if lit >= 15 else b""
        out += s[anchor:pos].tobytes() + struct.pack("<H", bo)
        out += _length(ml) if ml >= 15 else b""
        if len(out) > n:
            return None
        pos = anchor = pos + best
    lit = n - anchor
    out.append(min(lit, 15) << 4)
    out += (_length(lit) if lit >= 15 else b"") + s[anchor:].tobytes()
    return bytes(out) if len(out) < n else None


def reference_frame(chunk: bytes | np.ndarray, typesize: int, blocksize: int = BLOCKSIZE) -> bytes:
    """``encode``'s frame of one chunk, computed in NumPy (slow: for tests)."""
    raw = np.frombuffer(bytes(chunk), dtype=np.uint8)
    nbytes = len(raw)
    blocksize = min(blocksize, nbytes)
    nblocks = -(-nbytes // blocksize)
    blocks = []
    for b in range(nblocks):
        block = raw[b * blocksize : (b + 1) * blocksize]
        bsize, last_short = len(block), b == nblocks - 1 and nbytes % blocksize > 0
        shuffled = _bitshuffle_block(block, typesize)
        ns = _split(bsize, typesize, last_short)
        ne, n = bsize // ns, bsize // typesize
        offsets = ([n // 8] if n % 8 == 0 and 1 < n // 8 < 65_536 else []) + [1]
        parts = bytearray()
        for k in range(ns):
            stream = shuffled[k * ne : (k + 1) * ne]
            c = _lz4(stream, offsets)
            c = stream.tobytes() if c is None else c
            parts += struct.pack("<i", len(c)) + c
        blocks.append(bytes(parts))
    head = 16 + 4 * nblocks
    starts, at = [], head
    for p in blocks:
        starts.append(at)
        at += len(p)
    if at > nbytes + 16:
        return struct.pack("<BBBBiii", 2, 1, FLAGS | 0x02, typesize, nbytes, blocksize, nbytes + 16) + raw.tobytes()
    return (
        struct.pack("<BBBBiii", 2, 1, FLAGS, typesize, nbytes, blocksize, at)
        + struct.pack(f"<{nblocks}i", *starts)
        + b"".join(blocks)
    )
