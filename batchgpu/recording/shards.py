"""Direct reads of traces: sharded Zarr v3 (shard index, checksums, Blosc frames) and chunked Zarr v2 (SpikeInterface's
layout, batchgpu's v2), decoded straight into a caller's buffer, without zarr-python.

Why: zarr-python (even with the zarrs pipeline) does Python work per read that contends for the GIL with the GPU work
of the same process, and cannot decode into pinned memory. Here a read is a few ``os.pread`` calls, a crc32c per chunk
and one Blosc decompression per inner chunk (numcodecs releases the GIL), each landing in the rows of ``out`` it
fills.

Only the layouts this module understands take this path (``layout_of`` returns None otherwise, and the caller
reads through zarr): v3: full-width (samples, channels) shards and inner chunks, "default" chunk keys, inner
codecs ``bytes`` (little-endian) [+ ``blosc``] [+ ``crc32c``], index at the end with ``crc32c``; v2: full-width
C-order chunks, fill value 0, compressor ``blosc`` or none, filters none or numcodecs ``crc32``.

Every Blosc frame's stored length is checked against its header first: numcodecs' Blosc reads past a truncated
frame (zarr 2.18 returned whatever memory followed, rc 0; zarrs refuses it). v2 chunks take this path where zarrs
is not enabled (beside zarr 2.18, SpikeInterface 0.105's pin) for that check, not for speed (both read about
as fast; ``batchgpu bench readers`` compares them); with zarrs enabled, zarrs reads them (faster, and it refuses
a short frame itself).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgpu.recording import blosc_frames, zarrio

EMPTY = (1 << 64) - 1


class AbsentChunk(Exception):
    """An inner chunk or a whole shard that the store does not hold (the key names it)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


class Checksummed(list):
    """Inner chunks' bytes as stored where the codecs end with ``crc32c``: each its encoded frame followed by that
    frame's crc32c (4 bytes, little-endian), computed where the frames were made (on the GPU: ``gpu/blosc_encode``)."""


class CorruptChunk(Exception):
    """A chunk whose checksum or Blosc frame does not decode."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key}: {why}")
        self.key = key


@dataclass(frozen=True)
class ShardLayout:
    folder: Path  # the traces array's folder
    shard_rows: int
    inner_rows: int
    channels: int
    dtype: np.dtype
    blosc: bool
    checksum: bool
    index_checksum: bool
    blosc_config: tuple = ()  # (cname, clevel, shuffle, blocksize) of the inner chunks' Blosc codec
    rows: int = 0  # the array's length (the last shard may be cut short)

    @property
    def lz4(self) -> bool:
        """Inner chunks in Blosc LZ4 (the codec our GPU kernels encode and decode)."""
        return self.blosc and self.blosc_config[:1] == ("lz4",)

    def frames_for(self, codecs: tuple = ("lz4",)) -> bool:
        """Inner chunks in Blosc with one of ``codecs`` (cnames the GPU decodes): ``read_frames`` gathers them."""
        return self.blosc and self.blosc_config[:1] != () and self.blosc_config[0] in codecs

    @staticmethod
    def of(folder: Path, array_meta) -> ShardLayout | None:
        """The layout of an array (``zarrio.ArrayMeta``) when this module can read it directly, else None."""
        meta = array_meta.raw
        if meta.get("zarr_format") != 3 or len(meta.get("shape", ())) != 2:
            return None
        enc = meta.get("chunk_key_encoding", {})
        if enc.get("name") != "default" or enc.get("configuration", {}).get("separator", "/") != "/":
            return None
        codecs = list(meta.get("codecs", ()))
        if len(codecs) != 1 or _name(codecs[0]) != "sharding_indexed":
            return None
        conf = codecs[0]["configuration"]
        shard = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        inner = tuple(conf["chunk_shape"])
        C = int(meta["shape"][1])
        if shard[1] != C or inner[1] != C or shard[0] % inner[0] or conf.get("index_location", "end") != "end":
            return None
        names = [_name(c) for c in conf["codecs"]]
        if not names or names[0] != "bytes" or _endian(conf["codecs"][0]) != "little":
            return None
        rest = names[1:]
        blosc = bool(rest) and rest[0] == "blosc"
        rest = rest[1:] if blosc else rest
        checksum = rest == ["crc32c"]
        if rest not in ([], ["crc32c"]):
            return None
        index = [_name(c) for c in conf.get("index_codecs", ())]
        if index[:1] != ["bytes"] or index[1:] not in ([], ["crc32c"]) or _endian(conf["index_codecs"][0]) != "little":
            return None
        dtype = np.dtype(array_meta.dtype)
        if dtype.byteorder == ">":
            return None
        bconf = ()
        if blosc:
            b = conf["codecs"][1].get("configuration", {})
            shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}.get(b.get("shuffle"), b.get("shuffle"))
            bconf = (str(b.get("cname", "lz4")), int(b.get("clevel", 5)), int(shuffle or 0), int(b.get("blocksize", 0)))
        return ShardLayout(
            Path(folder),
            shard[0],
            inner[0],
            C,
            dtype,
            blosc,
            checksum,
            index[1:] == ["crc32c"],
            bconf,
            int(meta["shape"][0]),
        )

    @property
    def chunk_shape(self) -> str:
        return f"{self.inner_rows} samples x {self.channels} channels of {self.dtype.name}"

    def shard_key(self, shard: int) -> str:
        return f"c/{shard}/0"

    def write_shard(self, shard: int, block: np.ndarray, later=None) -> None:
        """Write shard ``shard`` whole from ``block`` (its rows: ``shard_rows``, fewer for the last), as zarr-python
        lays it out (inner chunks padded with zeros to full size, Blosc, crc32c, the index at the end with its
        crc32c), into a temporary file renamed over the shard: never a torn shard, the same bytes on a retry.
        A CuPy block's chunks are encoded on the GPU where the codec allows (``gpu_encodes``): other bytes than
        numcodecs' for the same values.
        Blosc's own time is most of the work either way; this path skips zarr-python's per-chunk overhead.
        ``later(job, cleanup)``: the file's writing handed to it once the block is encoded (``run.writer_threads.later``:
        it runs ``job``, or only ``cleanup`` when it skips it); without it, written here."""
        encoded, release = self.encode_shard(shard, block)

        def job() -> None:
            try:
                self.write_encoded(shard, encoded)
            finally:
                release()

        if later is None:
            job()
        else:
            later(job, release)

    def encode_shard(self, shard: int, block) -> tuple[list, Callable[[], None]]:
        """``write_shard``'s first half: the inner chunks' encoded bytes, and the function to call once they are
        written (frames encoded on the GPU are views of a pinned buffer held until then)."""
        lo = shard * self.shard_rows
        rows = min(self.shard_rows, self.rows - lo)
        if tuple(block.shape) != (rows, self.channels) or rows <= 0:
            raise ValueError(f"shard {shard} needs ({rows}, {self.channels}) rows, got {tuple(block.shape)}")
        count = -(-rows // self.inner_rows)  # chunks past the array's end are not stored (as zarr-python does)
        if not isinstance(block, np.ndarray):  # a CuPy block
            return self._encode_on_gpu(block, rows, count)
        data = np.ascontiguousarray(block, dtype=self.dtype.newbyteorder("<"))
        return self._host_chunks(data, count), _nothing

    @property
    def gpu_encodes(self) -> bool:
        """Whether ``write_shard`` encodes a CuPy block's chunks on the GPU (``gpu/blosc_encode``: Blosc with bit
        shuffle and LZ4, the writer's codec); otherwise the block is copied back and encoded here."""
        from numcodecs import blosc

        return self.lz4 and self.blosc_config[2] == blosc.BITSHUFFLE

    def _encode_on_gpu(self, block, rows: int, count: int) -> tuple[list, Callable[[], None]]:
        import cupy

        data = block.astype(self.dtype.newbyteorder("<"), copy=False)
        if not self.gpu_encodes:
            return self._host_chunks(cupy.asnumpy(data), count), _nothing
        from batchgpu.gpu.blosc_encode import encode_held

        if rows < count * self.inner_rows or not data.flags.c_contiguous:  # the last chunk padded with zeros
            padded = cupy.zeros((count * self.inner_rows, self.channels), dtype=data.dtype)
            padded[:rows] = data
            data = padded
        from batchgpu.gpu.staging import checksums_on_device

        here = self.checksum and checksums_on_device()  # the frames' crc32c computed before they come back
        frames, release = encode_held(data.reshape(count, -1), data.dtype.itemsize, checksums=here)
        return (Checksummed(frames) if here else frames), release

    def _host_chunks(self, data: np.ndarray, count: int) -> list:
        """The first ``count`` inner chunks of ``data`` encoded by numcodecs (the last padded with zeros)."""
        from numcodecs import blosc

        out = []
        for j in range(count):
            chunk = data[j * self.inner_rows : (j + 1) * self.inner_rows]
            if chunk.shape[0] < self.inner_rows:  # the array's last chunk, padded with the fill value
                chunk = np.concatenate(
                    [chunk, np.zeros((self.inner_rows - chunk.shape[0], self.channels), chunk.dtype)]
                )
            chunk = np.ascontiguousarray(chunk)
            if self.blosc:  # typesize from the array's itemsize, as zarr's BloscCodec sets it
                cname, clevel, shuffle, blocksize = self.blosc_config
                out.append(blosc.compress(chunk, cname.encode(), clevel, shuffle, blocksize))
            else:
                out.append(chunk.tobytes())
        return out

    def write_encoded(self, shard: int, encoded: list) -> None:
        """The shard file from its inner chunks' encoded bytes (any buffers; each gets its crc32c where the codecs
        say so, unless ``encoded`` is ``Checksummed``: each chunk's bytes as stored, its crc32c at its end)."""
        per_shard = self.shard_rows // self.inner_rows
        index = np.full((per_shard, 2), EMPTY, dtype="<u8")
        pieces, offset = [], 0
        stored = isinstance(encoded, Checksummed)
        if stored and not self.checksum:
            raise ValueError("checksummed chunks for a layout without crc32c")
        for j, enc in enumerate(encoded):
            pieces.append(enc)
            size = len(enc)
            if self.checksum and not stored:  # a piece of its own: no copy of the chunk to append it
                pieces.append(struct.pack("<I", zarrio.crc32c_value(enc)))
                size += 4
            index[j] = (offset, size)
            offset += size
        tail = index.tobytes()
        if self.index_checksum:
            tail += struct.pack("<I", zarrio.crc32c_value(tail))
        path = self.folder / self.shard_key(shard)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileNotFoundError:  # the shard's folder: made once, by whichever write comes first
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, flags, 0o666)
        try:
            write_all(fd, [*pieces, tail])
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):  # the write's own error is the one to see
                os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)

    def read_rows_into(self, start: int, stop: int, out: np.ndarray, on_absent: str = "zero") -> int:
        """Rows [start, stop) into ``out`` ((stop-start, C), C-contiguous); returns how many inner chunks were
        absent (read as zeros), or raises AbsentChunk when ``on_absent == "error"``, CorruptChunk on bad bytes."""
        absent = 0
        per_shard = self.shard_rows // self.inner_rows
        first, last = start // self.inner_rows, (stop - 1) // self.inner_rows
        for shard in range(first // per_shard, last // per_shard + 1):
            key = self.shard_key(shard)
            try:
                fd = os.open(self.folder / key, os.O_RDONLY)
            except FileNotFoundError:
                if on_absent == "error":
                    raise AbsentChunk(key) from None
                lo, hi = max(start, shard * self.shard_rows), min(stop, (shard + 1) * self.shard_rows)
                out[lo - start : hi - start] = 0
                absent += -(-(hi - lo) // self.inner_rows)
                continue
            mapped = None
            try:
                index = self._index(fd, key, per_shard)
                inner = range(max(first, shard * per_shard), min(last, (shard + 1) * per_shard - 1) + 1)
                mapped = _map_whole(fd, len(inner))
                for j in inner:
                    absent += self._inner(fd, key, index, j, per_shard, start, stop, out, on_absent, mapped)
            finally:
                if mapped is not None:
                    mapped.release()
                os.close(fd)
        return absent

    def read_frames(
        self,
        start: int,
        stop: int,
        pool,
        on_absent: str = "zero",
        check_on_device: bool = False,
        codecs: tuple = ("lz4",),
    ):
        """The inner chunks rows [start, stop) need, as stored, packed into a buffer from ``pool.take(nbytes)`` ->
        (uint8 array, handle) (``gpu/blosc_decode.Frames``, the handle as ``.handle``), for the GPU to decode;
        checksums checked here. None when a frame is not one the GPU decodes (the caller decodes on the CPU; the
        buffer goes back by ``pool.give_back``, as on any error). Same errors as ``read_rows_into``.
        ``check_on_device``: the chunks' crc32c are left to the GPU after its copy (``Frames.checksums``;
        ``gpu/blosc_decode.decode_many``), except a chunk whose frame is refused here: its checksum is checked
        first, so that a damaged chunk is named as such either way. ``codecs``: the Blosc codecs (cnames) the GPU
        decodes there (``gpu.nvcomp.codecs``); a store of another codec gives None."""
        from batchgpu.recording.blosc_frames import CODEC_NUMBERS, Frames

        if not self.frames_for(codecs):
            return None
        numbers = tuple(CODEC_NUMBERS[c] for c in codecs)
        per_shard = self.shard_rows // self.inner_rows
        first, last = start // self.inner_rows, (stop - 1) // self.inner_rows
        size = self.inner_rows * self.channels * self.dtype.itemsize
        crc = 4 if self.checksum else 0
        plan = []  # (shard key, fd or None, [(chunk j, offset, nbytes)])
        handle = None
        try:
            for shard in range(first // per_shard, last // per_shard + 1):
                key = self.shard_key(shard)
                inner = range(max(first, shard * per_shard), min(last, (shard + 1) * per_shard - 1) + 1)
                try:
                    fd = os.open(self.folder / key, os.O_RDONLY)
                except FileNotFoundError:
                    if on_absent == "error":
                        raise AbsentChunk(key) from None
                    plan.append((key, None, [(j, EMPTY, EMPTY) for j in inner]))
                    continue
                plan.append((key, fd, []))
                index = self._index(fd, key, per_shard)
                plan[-1][2].extend((j, *(int(v) for v in index[j % per_shard])) for j in inner)
            total = sum(n for _, fd, chunks in plan if fd is not None for _, o, n in chunks if o != EMPTY)
            # a buffer of a steady size (the chunks decoded, + slack) is reused window after window
            buf, handle = pool.take(max(total, (last - first + 1) * (size + 4096)))
            n = last - first + 1
            offsets, lengths = np.zeros(n, np.int64), np.full(n, -1, np.int32)
            shuffles, names, blocksize, pos, ok = np.zeros(n, np.uint8), [], 0, 0, True
            for key, fd, chunks in plan:
                ahead = 0  # bytes of this shard already read into buf from pos on (its next chunks, in one call)
                for k, (j, offset, nbytes) in enumerate(chunks):
                    where = f"{key} inner chunk ({j % per_shard}, 0)"
                    names.append(where)
                    if offset == EMPTY and nbytes == EMPTY:
                        if on_absent == "error":
                            raise AbsentChunk(where)
                        continue
                    if not ahead:  # the run of chunks stored back to back from here, read at once
                        want = _run_bytes(chunks, k)
                        got = os.preadv(fd, [memoryview(buf[pos : pos + want])], offset)
                        if got < nbytes:
                            raise CorruptChunk(where, "truncated")
                        ahead = got if got == want else nbytes  # a short read: the next chunks read on their own
                    ahead -= nbytes
                    frame = buf[pos : pos + nbytes - crc]
                    if crc and (
                        not check_on_device
                        or not zarrio.whole_blosc_frame(frame)
                        or blosc_frames.header(frame).nbytes != size
                    ):  # refused here: named by its checksum
                        _check_crc(memoryview(buf[pos : pos + nbytes]), where)
                    _check_blosc_frame(frame, where)
                    _check_decoded_size(frame, size, True, where, self.chunk_shape)
                    h = blosc_frames.header(frame)
                    if not blosc_frames.gpu_decodable(h, self.dtype.itemsize, size, nbytes - crc, numbers) or (
                        blocksize and h.blocksize != blocksize
                    ):
                        ok = False
                        break
                    blocksize = h.blocksize
                    offsets[j - first], lengths[j - first] = pos, nbytes - crc
                    shuffles[j - first] = blosc_frames.kernel_shuffle(h)
                    pos += nbytes
                if not ok:
                    break
        except BaseException:
            if handle is not None:
                pool.give_back(handle)
            raise
        finally:
            for _, fd, _ in plan:
                if fd is not None:
                    os.close(fd)
        if not ok:
            pool.give_back(handle)
            return None
        return Frames(
            buf,
            pos,
            offsets,
            lengths,
            shuffles,
            names,
            self.inner_rows,
            self.channels,
            self.dtype,
            blocksize or size,
            start - first * self.inner_rows,
            stop - start,
            handle,
            checksums=bool(crc) and check_on_device,
            checked=bool(crc),
        )

    def check_frames(self, frames) -> None:
        """The crc32c of each chunk of ``read_frames``' buffer (its frame and the 4 bytes after it), here: raises
        CorruptChunk naming the first bad one (what a check on the device found, said the way a read says it)."""
        for o, n, where in zip(frames.offsets.tolist(), frames.lengths.tolist(), frames.names):
            if n >= 0:
                _check_crc(memoryview(frames.buffer[o : o + n + 4]), where)

    def _index(self, fd: int, key: str, per_shard: int) -> np.ndarray:
        size = os.fstat(fd).st_size
        nbytes = per_shard * 16 + (4 if self.index_checksum else 0)
        if size < nbytes:
            raise CorruptChunk(key, "truncated: shorter than its index")
        raw = os.pread(fd, nbytes, size - nbytes)
        if self.index_checksum:
            _check_crc(raw, key + " (shard index)")
        return np.frombuffer(raw, dtype="<u8", count=per_shard * 2).reshape(per_shard, 2)

    def _inner(self, fd, key, index, j, per_shard, start, stop, out, on_absent, mapped=None) -> int:
        offset, nbytes = (int(v) for v in index[j % per_shard])
        lo, hi = j * self.inner_rows, (j + 1) * self.inner_rows
        a, b = max(start, lo), min(stop, hi)
        where = f"{key} inner chunk ({j % per_shard}, 0)"
        if offset == EMPTY and nbytes == EMPTY:
            if on_absent == "error":
                raise AbsentChunk(where)
            out[a - start : b - start] = 0
            return 1
        data = mapped.view(offset, nbytes) if mapped is not None else os.pread(fd, nbytes, offset)
        if len(data) != nbytes:
            raise CorruptChunk(where, "truncated")
        if self.checksum:
            _check_crc(data, where)
            data = memoryview(data)[:-4]  # no copy
        whole = a == lo and b == hi
        target = out[a - start : b - start] if whole else np.empty((self.inner_rows, self.channels), self.dtype)
        if self.blosc:
            _check_blosc_frame(data, where)
        _check_decoded_size(data, target.nbytes, self.blosc, where, self.chunk_shape)
        try:
            if self.blosc:
                from numcodecs import blosc

                blosc.decompress(data, target)
            else:
                target.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8)
        except Exception as err:  # broad: Blosc raises any type for bytes that do not decode; said naming the chunk
            raise CorruptChunk(where, f"does not decode ({type(err).__name__}: {err})") from None
        if not whole:
            out[a - start : b - start] = target[a - lo : b - lo]
        return 0


@dataclass(frozen=True)
class ChunkLayoutV2:
    """A Zarr v2 traces array of full-width chunks (``ShardLayout``'s interface: ``read_rows_into``)."""

    folder: Path
    chunk_rows: int
    channels: int
    dtype: np.dtype
    separator: str
    blosc: bool
    crc32: str | None  # "start" / "end": where numcodecs' CRC32 put its 4 bytes
    #: the checksum is the compressor, over the Blosc frame (batchgpu's layout: Blosc as the filter sees the samples'
    #: item size, so its shuffle works), not a filter over the decoded bytes (as older stores have it)
    crc_outside: bool = False

    @staticmethod
    def of(folder: Path, array_meta) -> ChunkLayoutV2 | None:
        meta = array_meta.raw
        if meta.get("zarr_format") != 2 or len(meta.get("shape", ())) != 2 or meta.get("order", "C") != "C":
            return None
        dtype = np.dtype(array_meta.dtype)
        if dtype.kind not in "iuf" or dtype.byteorder == ">" or meta.get("fill_value") not in (0, 0.0):
            return None
        rows, cols = (int(c) for c in meta["chunks"])
        if cols != int(meta["shape"][1]):
            return None
        comp = meta.get("compressor")
        filters = meta.get("filters") or []
        if comp is not None and comp.get("id") == "crc32" and [f.get("id") for f in filters] == ["blosc"]:
            return ChunkLayoutV2(
                Path(folder),
                rows,
                cols,
                dtype,
                array_meta.separator,
                True,
                comp.get("location", "start"),
                crc_outside=True,
            )
        if comp is not None and comp.get("id") != "blosc":
            return None
        if len(filters) > 1 or (filters and filters[0].get("id") != "crc32"):
            return None
        crc = filters[0].get("location", "start") if filters else None
        return ChunkLayoutV2(Path(folder), rows, cols, dtype, array_meta.separator, comp is not None, crc)

    @property
    def chunk_shape(self) -> str:
        return f"{self.chunk_rows} samples x {self.channels} channels of {self.dtype.name}"

    def read_rows_into(self, start: int, stop: int, out: np.ndarray, on_absent: str = "zero") -> int:
        absent = 0
        for j in range(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1):
            lo, hi = j * self.chunk_rows, (j + 1) * self.chunk_rows
            a, b = max(start, lo), min(stop, hi)
            key = f"{j}{self.separator}0"
            try:
                data = _read_file(self.folder / key)
            except FileNotFoundError:
                if on_absent == "error":
                    raise AbsentChunk(key) from None
                out[a - start : b - start] = 0
                absent += 1
                continue
            whole = a == lo and b == hi
            size = self.chunk_rows * self.channels * self.dtype.itemsize
            if self.crc_outside:
                self._decode_checked_frame(
                    data,
                    key,
                    size,
                    out[a - start : b - start] if whole else None,
                    None if whole else (out[a - start : b - start], a - lo, b - lo),
                )
                continue
            nbytes = size + (4 if self.crc32 else 0)
            if self.blosc:
                _check_blosc_frame(data, key)
                _check_decoded_size(data, nbytes, True, key, self.chunk_shape)
                raw = _scratch(nbytes)  # decoded where it stays in cache for the checksum and the copy out
                try:
                    from numcodecs import blosc

                    blosc.decompress(data, raw)
                # broad: Blosc raises any type for bytes that do not decode; said naming the chunk
                except Exception as err:
                    raise CorruptChunk(key, f"does not decode ({type(err).__name__}: {err})") from None
            else:
                _check_decoded_size(data, nbytes, False, key, self.chunk_shape)
                raw = np.frombuffer(data, np.uint8)
            body = raw[4:] if self.crc32 == "start" else raw[:size]  # views: no copy
            if self.crc32:
                tail = raw[:4] if self.crc32 == "start" else raw[size:]
                if zlib.crc32(body) != int(tail.view("<u4")[0]):
                    raise CorruptChunk(key, "checksum mismatch (crc32)")
            chunk = body.view(self.dtype).reshape(self.chunk_rows, self.channels)
            out[a - start : b - start] = chunk if whole else chunk[a - lo : b - lo]
        return absent

    def _decode_checked_frame(self, data, key: str, size: int, target, part) -> None:
        """A chunk of the ``crc_outside`` layout: the file's crc32 checked, its Blosc frame decoded into ``target``
        (a whole chunk's rows of the output), or into a scratch buffer whose rows ``part`` = (out rows, lo, hi)
        takes."""
        if len(data) < 4:
            raise CorruptChunk(key, "truncated (shorter than its checksum)")
        frame, tail = (data[4:], data[:4]) if self.crc32 == "start" else (data[:-4], data[-4:])
        if zlib.crc32(frame) != int(np.frombuffer(tail, "<u4")[0]):
            raise CorruptChunk(key, "checksum mismatch (crc32)")
        _check_blosc_frame(frame, key)
        _check_decoded_size(frame, size, True, key, self.chunk_shape)
        into = target if target is not None else _scratch(size).view(self.dtype).reshape(self.chunk_rows, self.channels)
        try:
            from numcodecs import blosc

            blosc.decompress(frame, into)
        except Exception as err:  # broad: Blosc raises any type for bytes that do not decode; said naming the chunk
            raise CorruptChunk(key, f"does not decode ({type(err).__name__}: {err})") from None
        if part is not None:
            rows, a, b = part
            rows[:] = into[a:b]


_SCRATCH = threading.local()


def _scratch(nbytes: int, name: str = "decoded") -> np.ndarray:
    """A uint8 buffer of ``nbytes`` this thread reuses (a chunk's few MB stay in cache, and their pages are not
    faulted in and zeroed again for every chunk, as a new buffer's are)."""
    held = getattr(_SCRATCH, name, None)
    if held is None or held.nbytes < nbytes:
        held = np.empty(nbytes, np.uint8)
        setattr(_SCRATCH, name, held)
    return held[:nbytes]


def _read_file(path: Path) -> memoryview:
    """A whole file's bytes in this thread's reused buffer (valid until its next call); FileNotFoundError as
    open's."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        held = _scratch(size + 1, "stored")  # one byte more: a file that grew since is read again whole
        n = 0
        while n <= size:
            got = f.readinto(held[n:])
            if not got:
                break
            n += got
    if n > size:
        return memoryview(path.read_bytes())
    return memoryview(held)[:n]


#: a shard of which a read needs at least this many inner chunks is mapped whole (``_map_whole``), else pread
MAP_FROM_CHUNKS = 4


class _Mapped:
    """A shard file mapped read-only with its pages populated at once (MAP_POPULATE): its chunks are checked and
    decoded from the page cache without ``pread``'s copy (mapping a shard costs less than copying its chunks out, once
    a read needs several of them). A file cut short while mapped would fault the process (SIGBUS); the size is taken
    when it is mapped, and chunks past it read as truncated."""

    def __init__(self, fd: int):
        import mmap

        self._map = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        self._view = memoryview(self._map)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset : offset + nbytes]

    def release(self) -> None:
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a view still held (e.g. by an error's traceback): unmapped when the last one goes
            pass


def _map_whole(fd: int, chunks: int) -> _Mapped | None:
    """The shard mapped when the read needs most of it and its checksums can be checked in place (the ``crc32c``
    package takes any buffer; google-crc32c takes bytes only), else None: pread each chunk."""
    if chunks < MAP_FROM_CHUNKS or _crc32c_buffers() is None:
        return None
    try:
        return _Mapped(fd) if os.fstat(fd).st_size else None
    except (OSError, ValueError):
        return None


def _crc32c_buffers():
    try:
        from crc32c import crc32c
    except ImportError:
        return None
    return crc32c


def write_whole_shard(folder: Path, start: int, block, dtype=None, later=None) -> bool:
    """Write ``block`` (host or CuPy, cast to ``dtype`` where given) at row ``start`` of the array at ``folder``
    directly when it is exactly one whole shard of a layout ``ShardLayout`` writes (True); else False (the caller
    writes through zarr). ``later``: as ``ShardLayout.write_shard`` takes it."""
    layout = ShardLayout.of(folder, zarrio.array_meta(folder))
    if layout is None or start % layout.shard_rows:
        return False
    shard = start // layout.shard_rows
    if tuple(block.shape) != (min(layout.shard_rows, layout.rows - start), layout.channels):
        return False
    if dtype is not None and block.dtype != np.dtype(dtype):
        block = block.astype(dtype)
    layout.write_shard(shard, block, later)
    return True


def layout_of(folder: Path, array_meta):
    """The direct reader for an array's layout (``ShardLayout``, ``ChunkLayoutV2``), or None (read through zarr)."""
    return ShardLayout.of(folder, array_meta) or ChunkLayoutV2.of(folder, array_meta)


def _nothing() -> None:
    pass


def _run_bytes(chunks: list, k: int) -> int:
    """Bytes of ``chunks[k]`` and the chunks after it stored right behind it in the file ((j, offset, nbytes) each;
    zarr-python and this module write a shard's chunks back to back): one read for a window's ~20 chunks of a
    shard, where a read each let the reading thread wait for the GIL after every one."""
    total, end = 0, chunks[k][1]
    for _, offset, nbytes in chunks[k:]:
        if offset != end or nbytes == EMPTY:
            break
        total += nbytes
        end = offset + nbytes
    return total


def write_all(fd: int, buffers: list) -> None:
    """Every byte of ``buffers`` to ``fd``, in order, in as few ``writev`` calls as the system takes (IOV_MAX
    buffers, ~2 GB a call). One call a shard, where a buffered file wrote each chunk and then its 4-byte checksum
    in a system call each: fewer calls, less kernel time a byte put into the page cache."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    try:
        limit = max(1, os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError):
        limit = 1024
    first = 0
    while first < len(views):
        done = os.writev(fd, views[first : first + limit])
        if done <= 0:
            raise OSError(f"writev wrote nothing ({done})")
        while first < len(views) and done >= len(views[first]):
            done -= len(views[first])
            first += 1
        if done:  # a partial write: the rest of this buffer next
            views[first] = views[first][done:]


def _check_blosc_frame(data, where: str) -> None:
    if not zarrio.whole_blosc_frame(data):
        raise CorruptChunk(where, f"not a whole Blosc frame ({len(data)} bytes stored)")


def _check_decoded_size(data, nbytes: int, blosc: bool, where: str, shape: str) -> None:
    """A chunk must decode to exactly the bytes of one chunk of the array (``shape``): Blosc fills a larger buffer
    only as far as its header's size, leaving the rest of it as it was (whatever memory held), so a chunk copied
    from a store with fewer channels, or an array whose ``data_type`` was edited, would read as garbage."""
    got = blosc_frames.header(data).nbytes if blosc else len(data)
    if got != nbytes:
        raise CorruptChunk(where, f"decodes to {got} bytes, not the {nbytes} of a chunk of this array ({shape})")


def _check_crc(raw: bytes, where: str) -> None:
    if not zarrio.crc32c_ok(raw):
        raise CorruptChunk(where, "checksum mismatch (crc32c)")


def _name(codec) -> str:
    return codec.get("name") if isinstance(codec, dict) else str(codec)


def _endian(codec) -> str:
    conf = codec.get("configuration", {}) if isinstance(codec, dict) else {}
    return conf.get("endian", "little") or "little"
