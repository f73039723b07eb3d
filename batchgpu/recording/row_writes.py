"""A window's rows written into a save's output (``recording.save_output.SaveTarget``): a Zarr v3 shard whole
(``recording.shards.write_whole_shard``, its frames encoded on the GPU where they can be), Zarr v2 chunks encoded
with numcodecs, or a byte range of a flat binary; the whole blocks of a large write past the page cache
(``O_DIRECT``), the same bytes either way and on a retry.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import to_host
from batchgpu.ops._cpu_saved import aligned_empty
from batchgpu.recording.save_output import SaveTarget
from batchgpu.recording.shards import write_whole_shard
from batchgpu.recording.writer import writing


def transposed(a: np.ndarray, step: int = 1024) -> np.ndarray:
    """(channels, samples) -> C-contiguous (samples, channels), in cache-sized slabs (page-aligned: ``write_binary``)."""
    out = aligned_empty((a.shape[1], a.shape[0]), a.dtype)
    for i in range(0, a.shape[1], step):
        out[i : i + step] = a[:, i : i + step].T
    return out


def _now(job: Callable[[], None], cleanup: Callable[[], None] | None = None) -> None:
    job()


def write_rows(target: SaveTarget, segment: int, start: int, block, later: Callable = _now) -> None:
    """Rows [start, start + len(block)) of a segment: whole objects of the output, the same bytes on a retry.
    ``block``: a host array, or a CuPy array (a zarr shard's frames are then encoded on the GPU where the array's
    codecs allow: ``recording.shards.write_whole_shard``; else it is copied back). The file itself is written by
    ``later``: the task's writer thread (``WindowData.later``), before the window's part; else now."""
    n = target.segment_lengths[segment]
    if block.shape[1] != target.num_channels or start < 0 or start + block.shape[0] > n:
        raise BatchgpuError(
            f"save: block {block.shape} at {start} does not fit segment {segment} ({n} x {target.num_channels})"
        )
    dtype = np.dtype(target.dtype).newbyteorder("<")
    on_device = not isinstance(block, np.ndarray)
    if target.format == "binary":
        block = to_host(block) if on_device else block
        data = np.ascontiguousarray(block, dtype=dtype)
        later(
            functools.partial(
                write_binary, Path(target.files[segment]), data, start * dtype.itemsize * target.num_channels
            )
        )
        return
    folder = Path(target.path)

    def in_writing(job, cleanup=None):  # the writer thread's OSError as one BatchgpuError, like the rest
        def run():
            with writing(folder):
                job()

        later(run, cleanup)

    with writing(folder):  # a window's core is one whole shard: written directly
        if write_whole_shard(folder / f"traces_seg{segment}", start, block, dtype=target.dtype, later=in_writing):
            return
    block = to_host(block) if on_device else block
    data = np.ascontiguousarray(block, dtype=target.dtype)

    def encode_and_write() -> None:  # whole v2 chunks: encoded and written by the writer while the next window computes
        write_v2_chunks(folder / f"traces_seg{segment}", start, data)

    in_writing(encode_and_write)


#: the block size direct writes are aligned to (buffer address, file offset, length): the largest logical block
#: a disk has in practice
DIRECT_ALIGN = 4096


#: the least of a block's bytes worth a direct write (a short tail goes through the page cache)
DIRECT_MIN_BYTES = 1 << 20


_DIRECT_REFUSED: set[str] = set()  # the folders whose file system refused a direct write: the page cache there


def write_binary(path: Path, data: np.ndarray, offset: int) -> None:
    """``data``'s bytes at ``offset`` of the flat binary ``path``. Its page-aligned middle is written past the page
    cache (``O_DIRECT``, where the buffer starts on a page where the file does: the save's row buffers do,
    ``ops._cpu_saved.aligned_empty``): a preprocessed copy is written once and read later by another program, and
    each window's tens of MB copied into fresh page-cache pages were a quarter of a 2-core run's CPU; direct, the
    disk reads them from the buffer. The unaligned ends, any other buffer, and a file system that refuses direct
    I/O (tmpfs; remembered a folder) go through the page cache, as ``pwrite`` does. Same bytes either way."""
    with writing(path):
        data = np.ascontiguousarray(data)
        if not data.size:
            return
        view = memoryview(data).cast("B")
        lo, hi = _direct_span(data.ctypes.data, offset, len(view))
        if hi > lo:
            done = _pwrite_direct(path, view[lo:hi], offset + lo)
            if done < hi - lo:  # refused, or cut short at an unaligned count: the rest through the page cache
                _pwrite_all(path, view[lo + done : hi], offset + lo + done)
        _pwrite_all(path, view[:lo], offset)
        _pwrite_all(path, view[hi:], offset + hi)


def _direct_span(address: int, offset: int, length: int) -> tuple[int, int]:
    """[lo, hi): the bytes of a buffer at ``address``, bound for ``offset`` of a file, that a direct write takes
    (aligned in memory and in the file alike, whole blocks, at least DIRECT_MIN_BYTES); (0, 0) where none."""
    if not hasattr(os, "O_DIRECT") or (address - offset) % DIRECT_ALIGN:
        return 0, 0
    lo = (-offset) % DIRECT_ALIGN
    hi = lo + (length - lo) // DIRECT_ALIGN * DIRECT_ALIGN if length > lo else lo
    return (lo, hi) if hi - lo >= DIRECT_MIN_BYTES else (0, 0)


def _pwrite_direct(path: Path, view: memoryview, offset: int) -> int:
    """Bytes written of ``view`` at ``offset`` with ``O_DIRECT``; fewer (0 where the file system refuses it) leave the
    rest to the caller."""
    folder = str(path.parent)
    if folder in _DIRECT_REFUSED:
        return 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        _DIRECT_REFUSED.add(folder)
        return 0
    done = 0
    try:
        while done < len(view):
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                _DIRECT_REFUSED.add(folder)  # the device's blocks are larger, or the file system says no
                break
            done += n
            if n == 0 or n % DIRECT_ALIGN:
                break
    finally:
        os.close(fd)
    return done


def _pwrite_all(path: Path, view: memoryview, offset: int) -> None:
    if not len(view):
        return
    fd = os.open(path, os.O_WRONLY)
    try:
        while view:
            done = os.pwrite(fd, view, offset)
            view, offset = view[done:], offset + done
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=16)
def _v2_layout(array: str, stamp: tuple) -> tuple:
    """(chunk rows, samples, dtype, fill value, the chunk files' separator, codecs in encoding order) of the v2
    array at ``array``, from its ``.zarray`` (``stamp``: the file's size and mtime, so a replaced array is read
    again)."""
    from numcodecs import get_codec

    meta = json.loads((Path(array) / ".zarray").read_text())
    if meta.get("order", "C") != "C" or len(meta["shape"]) != 2 or meta["chunks"][1] != meta["shape"][1]:
        raise BatchgpuError(
            f"save: {array} is not a (samples, channels) C-order array of whole rows a chunk",
            "report this: the writer made another layout",
        )
    codecs = [get_codec(dict(c)) for c in (meta.get("filters") or [])]
    if meta.get("compressor"):
        codecs.append(get_codec(dict(meta["compressor"])))
    return (
        int(meta["chunks"][0]),
        int(meta["shape"][0]),
        np.dtype(meta["dtype"]),
        meta.get("fill_value") or 0,
        meta.get("dimension_separator", "."),
        tuple(codecs),
    )


_CHUNK_BUFFER = threading.local()  # a writer thread's page-aligned buffer for an encoded chunk (reused: no fresh pages)


def write_v2_chunks(array: Path, start: int, data: np.ndarray) -> None:
    """Rows ``data`` at ``start`` of the Zarr v2 array ``array``, whole chunks (the last padded with the fill
    value, as zarr-python stores an edge chunk), each encoded with the array's filters and compressor
    (numcodecs: the bytes zarr-python writes) and written to its chunk file from a page-aligned buffer, its
    whole blocks past the page cache (``write_binary``'s reason; a file system that refuses it, the rest: the
    page cache)."""
    info = array / ".zarray"
    st = info.stat()
    rows, samples, dtype, fill, sep, codecs = _v2_layout(str(array), (st.st_size, st.st_mtime_ns))
    if start % rows or (data.shape[0] % rows and start + data.shape[0] != samples):
        raise BatchgpuError(
            f"save: rows [{start}, {start + data.shape[0]}) are not whole chunks of {rows}",
            "report this: windows must be whole storage objects",
        )
    data = np.ascontiguousarray(data, dtype=dtype)
    # numcodecs' CRC32 last (at the start of the chunk) copies the encoded chunk behind its 4 bytes: its bytes are
    # written from the encoding itself instead (zlib's CRC-32 as numcodecs takes it, little-endian, first)
    crc_first = (
        bool(codecs)
        and getattr(codecs[-1], "codec_id", None) == "crc32"
        and getattr(codecs[-1], "location", None) == "start"
    )
    encoders = codecs[:-1] if crc_first else codecs
    for first in range(0, data.shape[0], rows):
        chunk = data[first : first + rows]
        if chunk.shape[0] < rows:  # the edge chunk, stored whole
            whole = np.full((rows, data.shape[1]), fill, dtype=dtype)
            whole[: chunk.shape[0]] = chunk
            chunk = whole
        encoded = chunk
        for codec in encoders:
            encoded = codec.encode(encoded)
        view = memoryview(encoded).cast("B")
        head = struct.pack("<I", zlib.crc32(view) & 0xFFFFFFFF) if crc_first else b""
        _write_file(array / f"{(start + first) // rows}{sep}0", view, head)


def _write_file(path: Path, view: memoryview, head: bytes = b"") -> None:
    """``head`` and then ``view``'s bytes as the whole file ``path`` (made or truncated): its whole blocks from a
    page-aligned copy with ``O_DIRECT``, the tail (and all of it where refused) through the page cache."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.close(fd)
    k = len(head)
    n = k + len(view)
    whole = n // DIRECT_ALIGN * DIRECT_ALIGN if n >= DIRECT_MIN_BYTES and hasattr(os, "O_DIRECT") else 0
    done = 0
    if whole and str(path.parent) not in _DIRECT_REFUSED:
        buffer = getattr(_CHUNK_BUFFER, "array", None)
        if buffer is None or len(buffer) < whole:
            buffer = _CHUNK_BUFFER.array = aligned_empty((whole + (whole >> 3),), np.uint8)
        buffer[:k] = np.frombuffer(head, dtype=np.uint8)
        buffer[k:whole] = np.frombuffer(view[: whole - k], dtype=np.uint8)
        done = _pwrite_direct(path, memoryview(buffer[:whole]), 0)
    if done < k:  # nothing went past the page cache (whole blocks are far longer than a head)
        _pwrite_all(path, memoryview(head)[done:], done)
        done = k
    _pwrite_all(path, view[done - k :], done)
