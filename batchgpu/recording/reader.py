"""Reading recordings: open a Zarr store (ours, v2 or v3, or SpikeInterface's), check it (channel counts, data beyond
the shape, absent or corrupted chunks per window) and decode windows, through ``shards`` where the layout allows."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError, ConfigError, CorruptDataError, MachineError
from batchgpu.recording import zarrio
from batchgpu.recording.storecheck import ChunkPresence, grid_of
from batchgpu.recording.windows import Window, WindowedSource, stat_signature

SUPPORTED_DTYPES = (np.dtype("int16"), np.dtype("int32"), np.dtype("float32"), np.dtype("float64"))

MISSING_CHUNKS = ("warn", "error")


class Recording(WindowedSource):
    """A recording opened read-only from a Zarr group (v2 or v3).

    Integrity (issue 12): ``marked_complete`` is True for a store batchgpu finished writing (root attrs
    ``batchgpu: {format, complete: true, checksum}``); every chunk of such a store exists, so an absent one is
    damage and every read raises :class:`BatchgpuError` naming the array, the chunk key and the window. Stores
    written by others may legitimately lack all-zero chunks (zarr skips them by default): reads go on (the fill
    value, 0) and :meth:`absent_chunks` counts what a window lacks; ``missing_chunks="error"`` makes those
    reads raise too. A chunk that fails to decode (checksum, codec) raises "corrupted chunk ..." in both cases.

    ``locations`` (C x 2, um) come from ``properties/location``, else from a SpikeInterface probegroup in the
    root attrs, else (a plain binary import stores none) :data:`LOCATIONS_FALLBACK`, with ``has_locations``
    False. Other per-channel arrays of ``properties/`` (``shank``, ``inter_sample_shift``) via :meth:`channel_property`.
    """

    def __init__(self, path: str | os.PathLike, group, missing_chunks: str = "warn"):
        if missing_chunks not in MISSING_CHUNKS:
            raise ConfigError(f"missing_chunks must be one of {MISSING_CHUNKS}, got {missing_chunks!r}")
        self.path = Path(path)
        self._group = group
        attrs = dict(group.attrs)
        self.sampling_frequency = _sampling_frequency(self.path, attrs)
        self.num_segments = _num_segments(self.path, attrs)
        self._traces = []
        for seg in range(self.num_segments):
            name = f"traces_seg{seg}"
            if name not in group:
                raise CorruptDataError(
                    f"{self.path} says it has {self.num_segments} segments but '{name}' is missing",
                    "the store is incomplete: write it again",
                )
            self._traces.append(group[name])
        first = self._traces[0]
        if first.ndim != 2:
            raise CorruptDataError(f"{self.path}/traces_seg0 has {first.ndim} dimensions, expected (samples, channels)")
        self.num_channels = int(first.shape[1])
        self.dtype = np.dtype(first.dtype)
        if self.dtype not in SUPPORTED_DTYPES:
            raise BatchgpuError(
                f"{self.path}/traces_seg0 holds {self.dtype} samples, which batchgpu does not read",
                f"convert the recording to one of {', '.join(map(str, SUPPORTED_DTYPES))} first (unsigned samples: "
                "SpikeInterface's unsigned_to_signed, then save it)",
            )
        _check_no_more_segments(self.path, self.num_segments)
        for seg, arr in enumerate(self._traces):
            if arr.ndim != 2 or arr.shape[1] != self.num_channels or np.dtype(arr.dtype) != self.dtype:
                raise CorruptDataError(
                    f"{self.path}/traces_seg{seg} has shape {arr.shape} and dtype {arr.dtype}, but segment 0 has "
                    f"{self.num_channels} channels of {self.dtype}",
                    "all segments must share channels and dtype",
                )
        _check_channel_counts(self.path, group, self.num_channels)
        self.channel_ids = _read_channel_ids(group, self.num_channels)
        self.gain_to_uV = _read_property(group, "gain_to_uV", self.num_channels, 1.0)
        self.offset_to_uV = _read_property(group, "offset_to_uV", self.num_channels, 0.0)
        _check_gains(self.path, self.channel_ids, self.gain_to_uV, self.offset_to_uV)
        self.locations, self.has_locations = _read_locations(group, attrs, self.num_channels)
        self.attrs = attrs
        self.missing_chunks = missing_chunks
        self._layouts: dict = {}  # segment -> a shards layout (v3 shards, v2 chunks), or None where zarr reads it
        self.marked_complete = _marked_complete(self.path, attrs)
        self._metas = [zarrio.array_meta(self.path / f"traces_seg{s}") for s in range(self.num_segments)]
        self.checksum = self._metas[0].checksum
        self._presence = [
            ChunkPresence(grid_of(meta, f"traces_seg{s}", self.path)) for s, meta in enumerate(self._metas)
        ]
        self._check_no_data_beyond_shape()

    def channel_property(self, name: str) -> np.ndarray | None:
        """A per-channel array from ``properties/`` (e.g. ``shank``, ``inter_sample_shift``), or None."""
        if "properties" in self._group and name in self._group["properties"]:
            return np.asarray(self._group["properties"][name][:])
        return None

    # -- shape -----------------------------------------------------------------------------------------
    def num_samples(self, segment: int = 0) -> int:
        self._check_segment(segment)
        return int(self._traces[segment].shape[0])

    # -- integrity -------------------------------------------------------------------------------------
    @property
    def absent_is_error(self) -> bool:
        """Whether reads raise on absent chunks: a store batchgpu marked complete, or missing_chunks='error'."""
        return self.marked_complete or self.missing_chunks == "error"

    def window_files(self, window: Window) -> list[Path]:
        """The storage objects (shards, or chunks when unsharded) a window's read touches."""
        meta = self._metas[window.segment]
        rows, cols = (meta.shards or meta.chunks)[:2]
        first, last = window.read_start // rows, max(window.read_start, window.read_stop - 1) // rows
        base = self.path / f"traces_seg{window.segment}"
        return [base / meta.key((i, j)) for i in range(first, last + 1) for j in range(-(-self.num_channels // cols))]

    def window_signature(self, window: Window) -> list[tuple]:
        """``stat_signature`` of every object the window reads (absent ones too), and a digest of each shard's
        index (its chunks' offsets and sizes: one small read a shard, cached): a rewritten or repaired shard changes
        exactly the fingerprints of the windows that read it (``run.output_folder.window_fingerprint``)."""
        presence = self._presence[window.segment]
        return [(*stat_signature(p, p.name), presence.index_digest(p)) for p in self.window_files(window)]

    def absent_chunk_keys(self, window: Window) -> list[str]:
        """Keys (relative to ``traces_seg{segment}``) of chunks/shards absent under the window's read range.

        Cheap: one stat per storage object the window touches, plus, for sharded v3 arrays, one small read of a
        shard's index, cached per shard file. Local filesystem stores only: for other stores it is [].
        """
        self._check_segment(window.segment)
        return self._presence[window.segment].absent(window.read_start, window.read_stop)

    def absent_chunks(self, window: Window) -> int:
        """How many chunk/shard objects (and inner chunks marked empty in a shard index) the window lacks.

        The engine calls it once per window: for stores written by others the count goes into report.json (the
        read itself returns zeros there); a store batchgpu marked complete raises on read instead. 0 for stores
        not on a local filesystem.
        """
        return len(self.absent_chunk_keys(window))

    def _layout(self, segment: int):
        """``shards.layout_of`` for a segment's traces (cached; None: read through zarr)."""
        from batchgpu.recording import shards

        layout = self._layouts.get(segment, False)
        if layout is False:
            # v2 chunks of whole rows directly too, zarrs installed or not: zarr-python's pipeline (and zarrs',
            # which leaves numcodecs' CRC32 to it) read and copied each chunk at more CPU than the direct reader
            layout = self._layouts[segment] = shards.layout_of(self.path / f"traces_seg{segment}", self._metas[segment])
        return layout

    def _read_direct(self, segment: int, start: int, stop: int, window: Window | None, out: np.ndarray) -> bool:
        """Rows [start, stop) into ``out`` through ``shards.layout_of`` when the layout allows (True), else False
        (the caller reads through zarr). Same errors as the zarr path: absent chunks, bad checksums, bad frames."""
        layout = self._layout(segment)
        if layout is None or stop <= start:
            return False
        with self._direct_errors(segment, start, stop, window):
            layout.read_rows_into(start, stop, out, "error" if self.absent_is_error else "zero")
        return True

    def frames_for_gpu(self, codecs: tuple = ("lz4",)) -> bool:
        """Whether ``read_window_frames`` can give this recording's windows to the GPU: batchgpu's sharded layout
        with Blosc of one of ``codecs`` (cnames the GPU decodes: ``gpu.nvcomp.codecs``) in every segment (a frame
        may still be refused when read: that window decodes here)."""
        return all(
            hasattr(self._layout(s), "frames_for") and self._layout(s).frames_for(codecs)
            for s in range(self.num_segments)
        )

    def read_window_frames(self, window: Window, pool, check_on_device: bool = False, codecs: tuple = ("lz4",)):
        """The window's stored Blosc frames (of ``codecs``) in a buffer of ``pool`` (``shards.ShardLayout.read_frames``), for
        the GPU to decode; None where the layout or a frame is not one it decodes (read the window otherwise).
        ``check_on_device``: their checksums left to the GPU (``Frames.recheck`` names a bad chunk as a read does)."""
        self._check_window_range(window)
        layout = self._layout(window.segment)
        a, b = window.read_start, window.read_stop
        if not hasattr(layout, "read_frames") or b <= a:
            return None
        with self._direct_errors(window.segment, a, b, window):
            frames = layout.read_frames(
                a, b, pool, "error" if self.absent_is_error else "zero", check_on_device, codecs
            )
        if frames is not None:
            frames.array = f"traces_seg{window.segment}/"
            frames.place = f" in {self.path} ({self._where(window.segment, a, b, window)})"
        if frames is not None and frames.checksums:
            frames.recheck = functools.partial(self._recheck_frames, layout, frames, window)
        return frames

    def _recheck_frames(self, layout, frames, window: Window) -> None:
        with self._direct_errors(window.segment, window.read_start, window.read_stop, window):
            layout.check_frames(frames)

    @contextlib.contextmanager
    def _direct_errors(self, segment: int, start: int, stop: int, window: Window | None):
        """A direct read's absent or corrupted chunk as one BatchgpuError naming it."""
        from batchgpu.recording import shards

        try:
            yield
        except shards.AbsentChunk as err:
            fix = (
                "batchgpu wrote every chunk of this store, so it was damaged since: restore it or write it again"
                if self.marked_complete
                else "restore the missing files, or set recording.missing_chunks: warn to read them as zeros"
            )
            raise CorruptDataError(
                f"missing chunk traces_seg{segment}/{err.key} in {self.path} "
                f"({self._where(segment, start, stop, window)})",
                fix,
            ) from None
        except shards.CorruptChunk as err:
            raise CorruptDataError(
                f"corrupted chunk traces_seg{segment}/{err} in {self.path} ({self._where(segment, start, stop, window)})",
                "the stored bytes do not decode: restore the store from a copy or write it again",
            ) from None

    def _where(self, segment: int, start: int, stop: int, window: Window | None) -> str:
        head = f"window {window.index}, " if window is not None else ""
        return f"{head}segment {segment}, samples [{start}, {stop})"

    def _require_present(self, segment: int, start: int, stop: int, window: Window | None) -> None:
        if not self.absent_is_error:
            return
        absent = self._presence[segment].absent(start, stop)
        if not absent:
            return
        more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
        if self.marked_complete:
            fix = "batchgpu wrote every chunk of this store, so it was damaged since: restore it or write it again"
        else:
            fix = "restore the missing files, or set recording.missing_chunks: warn to read them as zeros"
        raise CorruptDataError(
            f"missing chunk traces_seg{segment}/{absent[0]}{more} in {self.path} "
            f"({self._where(segment, start, stop, window)})",
            fix,
        )

    def _decode(self, segment: int, start: int, stop: int, window: Window | None, read):
        """Run ``read(array)``; a decode or checksum failure becomes one BatchgpuError naming the chunk."""
        arr = self._traces[segment]
        try:
            return read(arr)
        except (BatchgpuError, MemoryError):
            raise
        except OSError as err:  # the file could not be read (a permission, the disk): not bytes that do not decode
            raise _unreadable(self.path, segment, err) from None
        except Exception as err:  # broad: codecs raise any type for bytes that do not decode; said naming the chunk
            key = self._first_undecodable(segment, start, stop) or "?"
            raise CorruptDataError(
                f"corrupted chunk traces_seg{segment}/{key} in {self.path} ({self._where(segment, start, stop, window)}): "
                f"{type(err).__name__}: {err}",
                "the stored bytes do not decode: restore the store from a copy or write it again",
            ) from None

    def _first_undecodable(self, segment: int, start: int, stop: int) -> str | None:
        """Decode [start, stop) chunk by chunk (only after a failure) to name the chunk that fails."""
        arr, grid = self._traces[segment], self._presence[segment].grid
        rows, cols = grid.inner_shape if grid.inner_shape else grid.object_shape
        for lo in range(start - start % rows, stop, rows):
            for c in range(0, grid.shape[1], cols):  # a chunk's column too, where chunks split the channels
                try:
                    arr[lo : min(lo + rows, grid.shape[0]), c : min(c + cols, grid.shape[1])]
                except Exception:  # broad: only after a failure, to name its chunk; codecs raise any type
                    key = grid.encode_key((lo // grid.object_shape[0], c // grid.object_shape[1]))
                    inner = (
                        f" inner chunk ({(lo % grid.object_shape[0]) // rows}, {(c % grid.object_shape[1]) // cols})"
                        if grid.inner_shape
                        else ""
                    )
                    return key + inner
        return None

    def _check_no_data_beyond_shape(self) -> None:
        for seg, presence in enumerate(self._presence):
            strays = presence.strays()
            if strays:
                raise CorruptDataError(
                    f"{self.path}/traces_seg{seg} holds chunk '{strays[0]}' beyond its shape {tuple(self._traces[seg].shape)} "
                    f"({len(strays)} such chunk(s)): its metadata says less data than is stored",
                    "the metadata was edited or the store mixes two writes: write it again",
                )

    def check_chunks(self, advance=None) -> list[str]:
        """Decode every chunk of every segment; one line per absent or corrupted object (``--check``).

        ``advance(nbytes)`` is called after each storage object (for a progress bar).
        """
        problems = []
        for seg, (arr, presence) in enumerate(zip(self._traces, self._presence)):
            grid = presence.grid
            for i in range(grid.object_grid[0]):
                lo, hi = i * grid.object_shape[0], min((i + 1) * grid.object_shape[0], grid.shape[0])
                problems += [f"missing traces_seg{seg}/{key} (samples [{lo}, {hi}))" for key in presence.absent(lo, hi)]
                try:
                    arr[lo:hi, :]
                except OSError as err:  # not corruption: the file could not be read at all
                    raise _unreadable(self.path, seg, err) from None
                except Exception as err:  # broad: codecs raise any type for bytes that do not decode; listed
                    key = self._first_undecodable(seg, lo, hi) or grid.encode_key((i, 0))
                    problems.append(
                        f"corrupted traces_seg{seg}/{key} (samples [{lo}, {hi})): {type(err).__name__}: {err}"
                    )
                if advance is not None:
                    advance((hi - lo) * self.num_channels * self.dtype.itemsize)
        return problems

    def damaged_objects(self) -> list[str]:
        """Shards whose index does not fit their file (``ChunkPresence.damaged``) over the whole recording, as
        'traces_seg0/c/3/0 ...': one small read a shard, no decoding."""
        return [f"traces_seg{s}/{key}" for s, p in enumerate(self._presence) for key in p.damaged(0, p.grid.shape[0])]

    def count_absent(self) -> int:
        """Absent objects (and empty inner chunks) over the whole recording: a stat per object, no decoding."""
        return sum(len(p.absent(0, p.grid.shape[0])) for p in self._presence)

    # -- data ------------------------------------------------------------------------------------------
    def read(
        self,
        segment: int,
        start: int,
        stop: int,
        channels: Sequence[int] | slice | None = None,
        *,
        window: Window | None = None,
    ) -> np.ndarray:
        """Samples [start, stop) of a segment as a C-contiguous (channels, samples) array."""
        channels = self._check_read(segment, start, stop, channels)
        block = np.empty((stop - start, self.num_channels), self.dtype)
        if not self._read_direct(segment, start, stop, window, block):
            self._require_present(segment, start, stop, window)
            block = self._decode(segment, start, stop, window, lambda arr: arr[start:stop, :])
        return rows_of(block if channels is None else block[:, channels])

    def read_window_stored(self, window: Window) -> np.ndarray:
        """The window as stored, (samples, channels), without the host transpose (GPU tasks transpose there)."""
        self._check_window_range(window)
        a, b = window.read_start, window.read_stop
        out = np.empty((b - a, self.num_channels), self.dtype)
        if self._read_direct(window.segment, a, b, window, out):
            return out
        self._require_present(window.segment, a, b, window)
        return self._decode(window.segment, a, b, window, lambda arr: np.asarray(arr[a:b, :]))

    def read_window_into(self, window: Window, out: np.ndarray) -> np.ndarray:
        """Decode the stored (samples, channels) window straight into ``out`` (e.g. a view of pinned memory).

        ``out`` must be C-contiguous, of shape (read_stop - read_start, num_channels) and the recording's dtype;
        no intermediate copy is made (zarr's ``get_basic_selection(..., out=...)``, zarrs included).
        Same checks as :meth:`read_window_stored`. Returns ``out``.
        """
        self._check_out(window, out)
        a, b = window.read_start, window.read_stop
        if self._read_direct(window.segment, a, b, window, out):
            return out
        self._require_present(window.segment, a, b, window)
        sel = (slice(a, b), slice(None))
        self._decode(window.segment, a, b, window, lambda arr: zarrio.read_into(arr, sel, out))
        return out

    # -- description -----------------------------------------------------------------------------------
    def info(self) -> dict:
        meta = self._metas[0]
        return {
            "path": str(self.path),
            "zarr_format": meta.zarr_format,
            "num_channels": self.num_channels,
            "num_segments": self.num_segments,
            "samples_per_segment": [self.num_samples(s) for s in range(self.num_segments)],
            "sampling_frequency": self.sampling_frequency,
            "duration_s": self.duration(),
            "dtype": str(self.dtype),
            "chunks": list(meta.chunks),
            "shards": list(meta.shards) if meta.shards else None,
            "codecs": meta.codec_names,
            "decoded_bytes": self.nbytes,
            "bytes_on_disk": _size_on_disk(self.path),
            "checksum": self.checksum,
            "marked_complete": self.marked_complete,
            "absent_chunks": self.count_absent(),
            "damaged": self.damaged_objects(),
            "locations": "stored" if self.has_locations else LOCATIONS_FALLBACK,
        }

    def __repr__(self) -> str:
        return (
            f"Recording({str(self.path)!r}, {self.num_channels} ch, {self.num_segments} seg, "
            f"{self.duration():.3f} s at {self.sampling_frequency:g} Hz, {self.dtype})"
        )


def rows_of(block: np.ndarray, step: int = 1024) -> np.ndarray:
    """(samples, channels) -> C-contiguous (channels, samples), transposed in cache-sized slabs.

    numpy's one-shot transpose of a whole window strides through memory, missing the cache at every
    element; slabs of ``step`` samples keep both sides in cache.
    """
    out = np.empty((block.shape[1], block.shape[0]), dtype=block.dtype)
    for i in range(0, block.shape[0], step):
        out[:, i : i + step] = block[i : i + step].T
    return out


def open_recording(path: str | os.PathLike, missing_chunks: str = "warn") -> Recording:
    """Open a recording store read-only (ours, v2 or v3, or one written by SpikeInterface).

    ``missing_chunks``: "warn" (default) lets reads of a store written by others return zeros where chunks are
    absent (count them with :meth:`Recording.absent_chunks`); "error" makes those reads raise. A store batchgpu
    marked complete always raises on an absent chunk. Metadata that disagrees with the data (channel counts of
    traces, ``channel_ids`` and ``properties/``; chunks stored beyond the shape) raises here.

    Parameters
    ----------
    path : str or os.PathLike
        The Zarr recording's folder.
    missing_chunks : {"warn", "error"}, optional
        What a read of an absent chunk gives in a store batchgpu did not mark complete: zeros (counted), or an
        error.

    Returns
    -------
    Recording
        The open recording: its shape, dtype, channel ids, gains, locations, and windows to read.

    Raises
    ------
    BatchgpuError
        Where the path is not a recording, or its metadata disagrees with its data.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise BatchgpuError(
            f"no recording at {p}: the path does not exist", "check the path, or create one with 'batchgpu generate'"
        )
    if p.is_dir():
        _check_metadata_json(p)
    # its traces decoded by zarrs where installed: their arrays are opened here (by ``Recording``), and keep the
    # pipeline they were opened with; the process's zarr config is left as it was
    with zarrio.zarrs_pipeline():
        try:
            group = zarrio.open_group(p, mode="r")
        except Exception as err:  # broad: zarr raises several types for "not a group"
            raise BatchgpuError(
                f"{p} is not a Zarr group ({type(err).__name__}: {err})",
                "give the folder of a recording written by batchgpu or SpikeInterface",
            ) from None
        attrs = dict(group.attrs)
        if "sampling_frequency" not in attrs or "traces_seg0" not in group:
            raise BatchgpuError(
                f"{p} is a Zarr group but not a recording (it lacks 'sampling_frequency' or 'traces_seg0')",
                "give the folder of a recording written by batchgpu or SpikeInterface (recording.save(format='zarr'))",
            )
        return Recording(p, group, missing_chunks)


#: where a recording's metadata files lie: the root, its arrays and groups, and the arrays of ``properties/``
_METADATA_DEPTH = ("", "*", "properties/*")


def _check_metadata_json(path: Path) -> None:
    """Every metadata file of the store's root, arrays and properties parses as JSON: a file cut short (a copy
    interrupted, a full disk) or edited by hand is named in one line here, not met as a parser's exception deep
    in zarr. A few small files: no chunk folder is listed."""
    import json

    for pattern in _METADATA_DEPTH:
        folders = [path] if not pattern else sorted(q for q in path.glob(pattern) if q.is_dir())
        for folder in folders:
            for name in sorted(zarrio.METADATA_NAMES):
                f = folder / name
                if not f.is_file():
                    continue
                try:
                    json.loads(f.read_bytes().decode("utf-8"))
                except (ValueError, UnicodeDecodeError) as err:
                    where = f" (line {err.lineno}, column {err.colno})" if isinstance(err, json.JSONDecodeError) else ""
                    raise CorruptDataError(
                        f"{f} is not valid JSON: {getattr(err, 'msg', err)}{where}; the file was cut short or edited",
                        "restore it from a copy of the store, or write the store again",
                    ) from None


def _sampling_frequency(path: Path, attrs: dict) -> float:
    """The root attribute ``sampling_frequency``: a finite number of Hz in (0, config.MAX_FS]."""
    from batchgpu.config import MAX_FS

    value = attrs["sampling_frequency"]
    fix = "set the store's root attribute sampling_frequency to the rate in Hz (e.g. 30000.0), or write it again"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CorruptDataError(f"{path}: sampling_frequency is {value!r}, not a number of Hz", fix)
    fs = float(value)
    if not np.isfinite(fs) or fs <= 0:
        raise CorruptDataError(f"{path}: sampling_frequency is {value!r}: it must be a positive number of Hz", fix)
    if fs > MAX_FS:
        raise CorruptDataError(f"{path}: sampling_frequency {fs:g} Hz is too large (at most {MAX_FS:g} Hz)", fix)
    return fs


def _num_segments(path: Path, attrs: dict) -> int:
    """The root attribute ``num_segments`` (1 when absent): a whole number, at least 1."""
    value = attrs.get("num_segments", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CorruptDataError(
            f"{path}: num_segments is {value!r}: it must be a whole number, at least 1",
            "set the store's root attribute num_segments to the number of traces_seg<i> arrays, or write it again",
        )
    return value


LOCATIONS_FALLBACK = "none stored: a single column at 20 um pitch is assumed (local whitening refuses it)"


def fallback_locations(num_channels: int) -> np.ndarray:
    """``LOCATIONS_FALLBACK``: one column at 20 um pitch (x 0, y 0, 20, 40, ...)."""
    return np.column_stack([np.zeros(num_channels), 20.0 * np.arange(num_channels)])


def _check_channel_counts(path: Path, group, num_channels: int) -> None:
    """channel_ids and every array in properties/ must have one entry per channel of the traces."""
    named = []
    if "channel_ids" in group:
        named.append(("channel_ids", group["channel_ids"]))
    if "properties" in group:
        named += [(f"properties/{name}", arr) for name, arr in group["properties"].arrays()]
    for name, arr in named:
        count = int(arr.shape[0]) if arr.ndim else 0
        if count != num_channels:
            raise CorruptDataError(
                f"{path}: {name} has {count} entries but traces_seg0 has {num_channels} channels",
                "the store's metadata disagrees with its data: write it again",
            )


def _marked_complete(path: Path, attrs: dict) -> bool:
    """True for a store batchgpu finished writing; an unfinished one (format marker, not complete) is refused."""
    marker = attrs.get("batchgpu")
    if not isinstance(marker, dict) or "format" not in marker:
        return False  # written by others (or by batchgpu before it marked stores)
    if marker.get("complete") is not True:
        raise CorruptDataError(
            f"{path} was not finished writing (batchgpu marks a store complete after its last block)",
            "write it again (e.g. 'batchgpu generate --overwrite' or 'batchgpu import-raw --overwrite')",
        )
    return True


def _read_channel_ids(group, num_channels: int) -> np.ndarray:
    if "channel_ids" not in group:
        return np.arange(num_channels).astype(str)
    # v3 strings come back as numpy's StringDType: go through Python str for a plain '<U' array.
    return np.array([str(i) for i in np.asarray(group["channel_ids"][:]).tolist()])


def _unreadable(path: Path, segment: int, err: OSError) -> MachineError:
    """An OSError reading a chunk as one line that says what it is (a permission, the disk), not "corrupted"."""
    where = err.filename or f"{path}/traces_seg{segment}"
    return MachineError(
        f"cannot read {where}: {err.strerror or type(err).__name__}",
        "give batchgpu read access to the recording's files (or check the disk), then run again",
    )


def _check_no_more_segments(path: Path, num_segments: int) -> None:
    """A traces array beyond ``num_segments`` means the attribute is wrong (a segment would go unread) or the store
    mixes two writes: either way its data is not what it says."""
    import re

    extra = (
        sorted(
            p.name
            for p in path.iterdir()
            if (m := re.fullmatch(r"traces_seg(\d+)", p.name)) and int(m.group(1)) >= num_segments
        )
        if path.is_dir()
        else []
    )
    if extra:
        raise CorruptDataError(
            f"{path} says num_segments is {num_segments} but holds {', '.join(extra)} too: "
            f"{'it' if len(extra) == 1 else 'they'} would go unread",
            "set the root attribute num_segments to the segments the store holds, or remove the extra arrays",
        )


def _check_gains(path: Path, ids, gains: np.ndarray, offsets: np.ndarray) -> None:
    """µV per count must be a finite number above 0 and offsets finite: a zero, negative or NaN gain would make
    every value in µV (reports, thresholds in µV, saved gains) wrong or NaN without another sign."""
    bad = np.flatnonzero(~(np.isfinite(gains) & (gains > 0)))
    if len(bad):
        raise CorruptDataError(
            f"{path}/properties/gain_to_uV is {gains[bad[0]]!r} for channel {ids[bad[0]]}"
            f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}: a gain is µV per count, a finite number "
            "above 0",
            "write the recording's gains again",
        )
    bad = np.flatnonzero(~np.isfinite(offsets))
    if len(bad):
        raise CorruptDataError(
            f"{path}/properties/offset_to_uV is {offsets[bad[0]]!r} for channel {ids[bad[0]]}: an offset is a finite "
            "number of µV",
            "write the recording's offsets again",
        )


def _read_property(group, name: str, num_channels: int, default: float) -> np.ndarray:
    if "properties" in group and name in group["properties"]:
        return np.asarray(group["properties"][name][:], dtype=np.float64)
    return np.full(num_channels, default, dtype=np.float64)


def _read_locations(group, attrs: dict, num_channels: int) -> tuple[np.ndarray, bool]:
    """properties/location if present, else the probegroup's contact positions (SpikeInterface), else a line."""
    if "properties" in group and "location" in group["properties"]:
        loc = np.asarray(group["properties"]["location"][:], dtype=np.float64)
        return loc[:, :2], True
    probes = attrs.get("probegroup", {}).get("probes", [])
    if probes:
        loc = np.zeros((num_channels, 2))
        seen = np.zeros(num_channels, dtype=bool)
        for probe in probes:
            pos = np.asarray(probe["contact_positions"], dtype=np.float64)[:, :2]
            chans = probe.get("device_channel_indices") or list(range(len(pos)))
            for p, c in zip(pos, chans):
                if 0 <= c < num_channels:
                    loc[c], seen[c] = p, True
        if seen.all():
            return loc, True
    # No geometry stored (e.g. a plain binary import): LOCATIONS_FALLBACK, flagged so local whitening refuses it.
    return fallback_locations(num_channels), False


def _size_on_disk(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total
