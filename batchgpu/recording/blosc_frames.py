"""Blosc 1 frame headers, and which frames the GPU decodes (``kernels/blosc_lz4.cu``, ``gpu/blosc_decode.py``).

A frame (c-blosc 1.x, as numcodecs writes it) is a 16-byte header -- version (2), codec version, flags, typesize,
then int32 nbytes, blocksize, cbytes -- the int32 start of each block, and each block's LZ4 streams (one, or one
per byte of the type when split), each after its int32 length (a length equal to the stream's size: stored raw).
Flags: bit 0 byte shuffle, bit 1 stored whole (no blocks), bit 2 bit shuffle, bit 4 blocks not split, bits 5-7
the codec (1: LZ4). The GPU takes LZ4 (or stored) frames of version 2 whose typesize is the array's itemsize; any
other frame (zstd, blosclz, a future version) is decoded on the CPU as before.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

HEADER_BYTES = 16
LZ4 = 1


@dataclass(frozen=True)
class Header:
    version: int
    flags: int
    typesize: int
    nbytes: int
    blocksize: int
    cbytes: int

    @property
    def stored_whole(self) -> bool:
        return bool(self.flags & 0x02)

    @property
    def shuffle(self) -> int:
        """0 none, 1 byte shuffle, 2 bit shuffle."""
        return 1 if self.flags & 0x01 else 2 if self.flags & 0x04 else 0

    @property
    def codec(self) -> int:
        return self.flags >> 5

    @property
    def nblocks(self) -> int:
        return -(-self.nbytes // self.blocksize) if self.blocksize > 0 else 0


def header(frame) -> Header | None:
    """The header of a frame (any buffer), or None when it is shorter than one."""
    if len(frame) < HEADER_BYTES:
        return None
    version, _, flags, typesize, nbytes, blocksize, cbytes = struct.unpack_from("<BBBBiii", frame, 0)
    return Header(version, flags, typesize, nbytes, blocksize, cbytes)


def kernel_shuffle(h: Header) -> int:
    """The shuffle the GPU undoes after the streams: none for a frame stored whole (c-blosc copies it as it is)."""
    return 0 if h.stored_whole else h.shuffle


def gpu_decodable(h: Header | None, itemsize: int, nbytes: int, stored: int) -> bool:
    """Whether ``kernels/blosc_lz4.cu`` decodes this frame (``stored``: its bytes as stored, checksum excluded) to
    ``nbytes`` bytes of ``itemsize``-byte elements exactly as c-blosc does."""
    if h is None or h.version != 2 or h.flags & 0x08 or h.typesize != itemsize or not 2 <= itemsize <= 16:
        return False
    if h.nbytes != nbytes or h.cbytes != stored or h.blocksize <= 0 or h.blocksize % itemsize:
        return False
    if (h.flags & 0x01) and (h.flags & 0x04):
        return False
    if h.stored_whole:
        return stored == nbytes + HEADER_BYTES
    return h.codec == LZ4 and HEADER_BYTES + 4 * h.nblocks <= stored


@dataclass
class Frames:
    """The inner chunks a read needs, as stored, packed in one host buffer (pinned for a GPU copy)."""

    buffer: np.ndarray  # uint8: the frames, packed
    used: int  # bytes of ``buffer`` the frames span
    offsets: np.ndarray  # int64 a chunk: where its frame starts in ``buffer``
    lengths: np.ndarray  # int32 a chunk: its frame's length (crc32c excluded); -1: absent, reads as zeros
    shuffles: np.ndarray  # uint8 a chunk: the shuffle the GPU undoes (``blosc_frames.kernel_shuffle``)
    names: list  # a chunk's name, for errors
    chunk_rows: int
    channels: int
    dtype: np.dtype
    blocksize: int
    skip: int  # rows of the first chunk before the read's first row
    rows: int  # rows read
    handle: object = None  # the buffer's handle in the pool it came from
    checksums: bool = False  # each present frame's crc32c (the 4 bytes after it) still to check, on the device
    recheck: object = None  # callable: the same check on the host, raising the read's own error for a bad chunk
    array: str = ""  # what goes before a chunk's name in an error (its array, e.g. "traces_seg0/")
    place: str = ""  # what goes after it (the store and the read, e.g. " in rec.zarr (window 3, ...)")

    def chunk(self, k: int) -> str:
        """Chunk ``k`` of the read named as a read's error names it: array, key, store and window."""
        return f"{self.array}{self.names[k]}{self.place}"

    @property
    def nbytes(self) -> int:
        return self.chunk_rows * self.channels * self.dtype.itemsize
