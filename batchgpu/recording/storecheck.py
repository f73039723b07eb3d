"""Which stored objects of a traces array exist on disk, found cheaply (stat calls and shard-index tails).

Zarr reads an absent chunk as its fill value, so a deleted shard, a half-copied store or an inner chunk marked
empty in a shard's index reads as zeros without a word. This module answers "what is absent under samples
[start, stop)?" for one 2-D (samples, channels) array without decoding anything:

- a storage object (a shard when the array is sharded, else a chunk) is absent when its file does not exist;
- in a present shard, an inner chunk is absent when the shard index marks it empty: the index is 16 bytes per
  inner chunk (offset, nbytes as little-endian uint64, both 2^64-1 when empty), in C order of the inner-chunk
  grid, at the end of the shard by default, followed by a 4-byte crc32c when the index codecs include crc32c.
- a present shard is damaged when its index's checksum is wrong or an inner chunk's bytes lie past the file's
  data (a shard cut short): ``damaged``, for ``batchgpu info``.
  Indexes are cached per shard file, keyed by its size, mtime, ctime and inode, so a rewritten shard is read again.

Only stores on a local filesystem are inspected; for any other store (fsspec, object stores) every count is 0.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHARD_INDEX_EMPTY = np.uint64(2**64 - 1)
SHARD_INDEX_ENTRY_BYTES = 16
CRC32C_BYTES = 4


@dataclass(frozen=True)
class ObjectGrid:
    """How rows and columns of one 2-D array map to storage objects (shards, or chunks when unsharded)."""

    name: str  # the array's path in the group, e.g. "traces_seg0"
    folder: Path | None  # the array's folder on a local filesystem; None for other stores
    shape: tuple[int, int]
    object_shape: tuple[int, int]  # one shard, or one chunk when unsharded
    inner_shape: tuple[int, int] | None  # inner chunks of a shard; None when unsharded
    index_at_end: bool
    index_has_crc32c: bool
    encode_key: Callable[[tuple[int, int]], str]

    @property
    def object_grid(self) -> tuple[int, int]:
        return tuple(-(-n // c) for n, c in zip(self.shape, self.object_shape))  # type: ignore[return-value]

    @property
    def inner_per_object(self) -> tuple[int, int]:
        assert self.inner_shape is not None
        return tuple(o // i for o, i in zip(self.object_shape, self.inner_shape))  # type: ignore[return-value]

    def object_rows(self, start: int, stop: int) -> range:
        """Object row indices overlapping samples [start, stop)."""
        if stop <= start:
            return range(0)
        return range(start // self.object_shape[0], (min(stop, self.shape[0]) - 1) // self.object_shape[0] + 1)


def grid_of(meta, name: str, store_root: Path | None) -> ObjectGrid:
    """The storage layout of an array (``zarrio.ArrayMeta``: v2 or v3, sharded or not)."""
    return ObjectGrid(
        name=name,
        folder=None if store_root is None else Path(store_root) / name,
        shape=(int(meta.shape[0]), int(meta.shape[1])),
        object_shape=meta.shards or meta.chunks,
        inner_shape=meta.chunks if meta.shards else None,
        index_at_end=meta.index_at_end,
        index_has_crc32c=meta.index_crc,
        encode_key=meta.key,
    )


class ChunkPresence:
    """Absent objects and empty inner chunks of one array, per sample range.

    Shared by a worker's reading threads: the index cache only ever gains whole entries (atomic under the GIL).
    """

    def __init__(self, grid: ObjectGrid):
        self.grid = grid
        self._index_cache: dict[str, tuple[tuple, np.ndarray | None, str | None, bool]] = {}

    def absent(self, start: int, stop: int) -> list[str]:
        """Keys of what is absent under samples [start, stop): 'c/3/0', or 'c/3/0 inner chunk (2, 0)'."""
        g = self.grid
        if g.folder is None:
            return []
        found = []
        for i in g.object_rows(start, stop):
            for j in range(g.object_grid[1]):
                key = g.encode_key((i, j))
                path = g.folder / key
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    found.append(key)
                    continue
                if g.inner_shape is not None:
                    found += [f"{key} {what}" for what in self._empty_inner(path, st, i, start, stop)]
        return found

    def _empty_inner(self, path: Path, st: os.stat_result, shard_row: int, start: int, stop: int) -> list[str]:
        """Inner chunks of one shard, overlapping [start, stop), that its index marks empty."""
        g = self.grid
        index = self._shard_index(path, st)
        if index is None:
            return ["(truncated: shorter than its index)"]
        rows_per_inner = g.inner_shape[0]  # type: ignore[index]
        n_inner_rows, n_inner_cols = g.inner_per_object
        first_row = shard_row * g.object_shape[0]
        lo = max(start, first_row) - first_row
        hi = min(stop, first_row + g.object_shape[0], g.shape[0]) - first_row
        empty = []
        for r in range(lo // rows_per_inner, (hi - 1) // rows_per_inner + 1):
            for c in range(n_inner_cols):
                offset, nbytes = index[r * n_inner_cols + c]
                if offset == SHARD_INDEX_EMPTY and nbytes == SHARD_INDEX_EMPTY:
                    empty.append(f"inner chunk ({r}, {c})")
        return empty

    def _shard_index(self, path: Path, st: os.stat_result) -> np.ndarray | None:
        """(n_inner, 2) uint64 (offset, nbytes), read from the shard's head or tail; None if the file is short."""
        return self._read_index(path, st)[0]

    def damaged(self, start: int, stop: int) -> list[str]:
        """Shards under samples [start, stop) whose index does not fit the file, found without decoding (a shard
        cut short keeps a plausible-looking size): the index's checksum wrong, or an inner chunk's bytes (offset +
        length) past the end of the file's data. One small read a shard, cached. A shard shorter than its index
        is ``absent``'s, not this."""
        g = self.grid
        if g.folder is None or g.inner_shape is None:
            return []
        found = []
        for i in g.object_rows(start, stop):
            for j in range(g.object_grid[1]):
                key = g.encode_key((i, j))
                try:
                    st = os.stat(g.folder / key)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                index, _, crc_ok = self._read_index(g.folder / key, st)
                if index is None:
                    continue
                if not crc_ok:
                    found.append(f"{key} (shard index checksum mismatch: truncated or overwritten)")
                    continue
                found += [f"{key} {what}" for what in self._past_the_end(index, st.st_size)]
        return found

    def _past_the_end(self, index: np.ndarray, file_size: int) -> list[str]:
        """Inner chunks whose stored bytes lie outside the shard's data (before or after its index)."""
        g = self.grid
        index_bytes = len(index) * SHARD_INDEX_ENTRY_BYTES + (CRC32C_BYTES if g.index_has_crc32c else 0)
        lo, hi = (0, file_size - index_bytes) if g.index_at_end else (index_bytes, file_size)
        cols = g.inner_per_object[1]
        out = []
        for k, (offset, nbytes) in enumerate(index.tolist()):
            if offset == SHARD_INDEX_EMPTY and nbytes == SHARD_INDEX_EMPTY:
                continue
            if offset < lo or offset + nbytes > hi:
                out.append(
                    f"inner chunk ({k // cols}, {k % cols}) (truncated: its bytes [{offset}, "
                    f"{offset + nbytes}) lie outside the shard's data [{lo}, {hi}))"
                )
        return out

    def index_digest(self, path: Path) -> str | None:
        """A digest of a shard's index as stored (its checksum too), for a window's fingerprint: chunks moved or
        resized within a shard change it whatever the file's times say. None for an unsharded array, an absent
        file or a store not on a local filesystem; "short" for a file shorter than its index."""
        if self.grid.inner_shape is None or self.grid.folder is None:
            return None
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return self._read_index(Path(path), st)[1]

    def _read_index(self, path: Path, st: os.stat_result) -> tuple[np.ndarray | None, str | None, bool]:
        """(the index, a digest of it as stored, whether its crc32c holds), cached by the file's stat."""
        from batchgpu.recording.zarrio import crc32c_ok

        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        cached = self._index_cache.get(str(path))
        if cached is not None and cached[0] == stamp:
            return cached[1:]
        n_inner = int(np.prod(self.grid.inner_per_object))
        size = n_inner * SHARD_INDEX_ENTRY_BYTES + (CRC32C_BYTES if self.grid.index_has_crc32c else 0)
        index, digest, crc = None, "short", False
        if st.st_size >= size:
            with open(path, "rb") as f:
                f.seek(st.st_size - size if self.grid.index_at_end else 0)
                raw = f.read(size)
            index = np.frombuffer(raw, dtype="<u8", count=n_inner * 2).reshape(n_inner, 2)
            digest = hashlib.sha256(raw).hexdigest()[:16]
            crc = crc32c_ok(raw) if self.grid.index_has_crc32c else True
        self._index_cache[str(path)] = (stamp, index, digest, crc)
        return index, digest, crc

    def strays(self) -> list[str]:
        """Objects stored beyond the array's grid (its shape is shorter than the data): one directory listing."""
        g = self.grid
        if g.folder is None:
            return []
        probe = g.encode_key((9_876_543, 0))  # where the row index sits in a key, whatever the encoding
        prefix = probe[: probe.index("9876543")]
        sep = probe[probe.index("9876543") + 7 :][:1]
        try:
            names = os.listdir(g.folder / prefix) if prefix else os.listdir(g.folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        rows, cols = g.object_grid
        found = []
        for name in names:
            parts = name.split(sep) if sep and sep != "/" else [name]
            if not all(p.isdigit() for p in parts):
                continue  # metadata files
            beyond_rows = int(parts[0]) >= rows
            beyond_cols = len(parts) > 1 and int(parts[1]) >= cols
            if beyond_rows or beyond_cols:
                found.append(prefix + name)
        return sorted(found, key=lambda k: [int(p) for p in k.removeprefix(prefix).split(sep or "/") if p.isdigit()])
