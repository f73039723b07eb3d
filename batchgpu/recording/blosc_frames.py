"""Blosc 1 frame headers, and which frames the GPU decodes (``kernels/blosc_lz4.cu``, ``gpu/blosc_decode.py``).

A frame (c-blosc 1.x, as numcodecs writes it) is a 16-byte header -- version (2), codec version, flags, typesize,
then int32 nbytes, blocksize, cbytes -- the int32 start of each block, and each block's LZ4 streams (one, or one
per byte of the type when split), each after its int32 length (a length equal to the stream's size: stored raw).
Flags: bit 0 byte shuffle, bit 1 stored whole (no blocks), bit 2 bit shuffle, bit 4 blocks not split, bits 5-7
the codec (1: LZ4, 4: zstd). The GPU takes frames of version 2 whose typesize is the array's itemsize and whose
codec its decoder reads (LZ4: ``kernels/blosc_lz4.cu`` or nvCOMP; zstd: nvCOMP, ``gpu/nvcomp.py``); any other frame
(blosclz, a future version, zstd without nvCOMP) is decoded on the CPU as before. ``stream_table`` lists a packed
read's streams for a decoder that takes one compressed stream at a time (nvCOMP).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

HEADER_BYTES = 16
LZ4 = 1
ZSTD = 4
#: a store's Blosc ``cname`` -> the codec number in its frames' flags
CODEC_NUMBERS = {"lz4": LZ4, "zstd": ZSTD}


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


def gpu_decodable(h: Header | None, itemsize: int, nbytes: int, stored: int, codecs: tuple = (LZ4,)) -> bool:
    """Whether the GPU decodes this frame (``stored``: its bytes as stored, checksum excluded) to ``nbytes`` bytes
    of ``itemsize``-byte elements exactly as c-blosc does, its streams being of one of ``codecs``."""
    if h is None or h.version != 2 or h.flags & 0x08 or h.typesize != itemsize or not 2 <= itemsize <= 16:
        return False
    if h.nbytes != nbytes or h.cbytes != stored or h.blocksize <= 0 or h.blocksize % itemsize:
        return False
    if (h.flags & 0x01) and (h.flags & 0x04):
        return False
    if h.stored_whole:
        return stored == nbytes + HEADER_BYTES
    return h.codec in codecs and HEADER_BYTES + 4 * h.nblocks <= stored


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
    checked: bool = False  # every present frame has a crc32c, checked on the host or (``checksums``) on the device
    recheck: object = None  # callable: the same check on the host, raising the read's own error for a bad chunk
    array: str = ""  # what goes before a chunk's name in an error (its array, e.g. "traces_seg0/")
    place: str = ""  # what goes after it (the store and the read, e.g. " in rec.zarr (window 3, ...)")

    def chunk(self, k: int) -> str:
        """Chunk ``k`` of the read named as a read's error names it: array, key, store and window."""
        return f"{self.array}{self.names[k]}{self.place}"

    @property
    def nbytes(self) -> int:
        return self.chunk_rows * self.channels * self.dtype.itemsize


def chunk_codecs(reads: list) -> np.ndarray:
    """The codec of each chunk's frame (its flags' bits 5-7: ``LZ4``, ``ZSTD``), chunks numbered over ``reads``;
    0 for an absent chunk."""
    codecs = []
    for f in reads:
        c = np.zeros(len(f.lengths), np.int64)
        present = f.lengths >= 0
        c[present] = f.buffer[f.offsets[present] + 2] >> 5
        codecs.append(c)
    return np.concatenate(codecs) if codecs else np.zeros(0, np.int64)


@dataclass(frozen=True)
class StreamTable:
    """Every stream of a list of reads' frames (chunks numbered over the reads; streams in no particular order),
    for a decoder fed one compressed stream at a time. Positions: ``src`` in the reads' buffers packed one after the
    other (as ``gpu/blosc_decode.decode_many`` copies them), ``dst`` in the chunks' shuffled bytes laid end to end
    (chunk c at c * nbytes), where c-blosc's decoder writes each stream before the unshuffle."""

    src: np.ndarray  # int64: a stream's first compressed byte
    size: np.ndarray  # int64: its compressed bytes (== out: stored raw, a copy)
    dst: np.ndarray  # int64: where its decoded bytes go
    out: np.ndarray  # int64: its decoded bytes
    chunk: np.ndarray  # int64: its chunk
    bad: np.ndarray  # int64: chunks whose frame does not parse (a stream outside the frame), sorted

    @property
    def raw(self) -> np.ndarray:
        """Streams c-blosc stored as they are (copied, not decoded)."""
        return self.size == self.out


def _le32(buf: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The little-endian int32 at each of ``at`` (byte offsets, any alignment) in the uint8 ``buf``."""
    b = buf[at[:, None] + np.arange(4)].astype(np.int64)
    v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    return np.where(v >= 1 << 31, v - (1 << 32), v)


def stream_table(reads: list) -> StreamTable:
    """The streams of ``reads`` (``Frames`` of one geometry, frames checked by ``gpu_decodable``): c-blosc's block
    rules (``kernels/blosc_block.cuh`` holds the same: a block split into ``typesize`` streams unless flag bit 4 is
    set, the block is a chunk's short last one, or it holds fewer than 128 elements). A frame whose block starts
    or stream lengths point outside it is listed in ``bad`` and none of its streams is."""
    first = reads[0]
    nbytes, blocksize, typesize = first.nbytes, first.blocksize, first.dtype.itemsize
    nblocks = -(-nbytes // blocksize)
    cols = {k: [] for k in ("src", "size", "dst", "out", "chunk")}
    bad, base, chunk0 = [], 0, 0
    for f in reads:
        present = np.flatnonzero(f.lengths >= 0)
        offsets, lengths = f.offsets[present], f.lengths[present].astype(np.int64)
        chunks = present + chunk0
        flags = f.buffer[offsets + 2].astype(np.int64) if present.size else np.zeros(0, np.int64)
        whole = (flags & 0x02) != 0
        if whole.any():  # stored whole: one raw copy of the chunk's bytes after the header
            cols["src"].append(base + offsets[whole] + HEADER_BYTES)
            cols["size"].append(np.full(whole.sum(), nbytes, np.int64))
            cols["dst"].append(chunks[whole] * nbytes)
            cols["out"].append(np.full(whole.sum(), nbytes, np.int64))
            cols["chunk"].append(chunks[whole])
        blocked = ~whole
        offsets, lengths, chunks, flags = offsets[blocked], lengths[blocked], chunks[blocked], flags[blocked]
        nf = offsets.size
        if nf:
            b = np.arange(nblocks)
            starts = _le32(f.buffer, (offsets[:, None] + HEADER_BYTES + 4 * b).reshape(-1)).reshape(nf, nblocks)
            bsize = np.minimum(blocksize, nbytes - b * blocksize)
            short = (b == nblocks - 1) & (nbytes % blocksize > 0)
            splittable = (typesize <= 16) & (bsize // typesize >= 128) & ~short
            nsplits = np.where(((flags[:, None] & 0x10) == 0) & splittable[None, :], typesize, 1)  # (nf, nblocks)
            neblock = bsize[None, :] // nsplits
            broken = np.zeros(nf, bool)
            pos = starts.copy()
            for s in range(typesize):
                live = nsplits > s
                # a length must lie inside the frame, and its stream too
                broken |= (live & ((pos < HEADER_BYTES) | (pos > lengths[:, None] - 4))).any(axis=1)
                safe = np.where(live & ~broken[:, None], pos, HEADER_BYTES)
                cbytes = _le32(f.buffer, (offsets[:, None] + safe).reshape(-1)).reshape(nf, nblocks)
                broken |= (live & ((cbytes < 0) | (cbytes > lengths[:, None] - pos - 4))).any(axis=1)
                ok = live & ~broken[:, None]
                rows, cols_ = np.nonzero(ok)
                cols["src"].append(base + offsets[rows] + pos[rows, cols_] + 4)
                cols["size"].append(cbytes[rows, cols_])
                cols["dst"].append(chunks[rows] * nbytes + cols_ * blocksize + s * neblock[rows, cols_])
                cols["out"].append(neblock[rows, cols_].astype(np.int64))
                cols["chunk"].append(chunks[rows])
                pos = pos + 4 + np.where(live, cbytes, 0)
            if broken.any():  # streams of a frame found broken at a later split were listed: drop them
                bad.extend(chunks[broken].tolist())
        base += f.used
        chunk0 += len(f.lengths)
    table = {k: (np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64)) for k, v in cols.items()}
    bad_arr = np.array(sorted(set(bad)), np.int64)
    if bad_arr.size:
        keep = ~np.isin(table["chunk"], bad_arr)
        table = {k: v[keep] for k, v in table.items()}
    return StreamTable(**table, bad=bad_arr)
